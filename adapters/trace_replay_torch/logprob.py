"""``token_logprob_rank`` for torch tensors: logprob, rank, optional top-k, greedy token and entropy per row.

Runs :func:`trace_replay_core.token_logprob_rank` on torch's current stream of the logits'
device (or in numpy for CPU tensors); no host synchronisation, capturable in a CUDA graph
once warmed up. A row gives the same bits whatever else is in the batch (the core's kernels
reduce in an order fixed by the vocabulary). Calls are bound once per layout of their tensors
(data pointers, dtypes, shapes, strides; torch's caching allocator hands a decode loop the same
few addresses step after step), so a repeated call only launches the kernels.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import torch

from trace_replay_core import BoundCache, bind_logprob_rank, check_top_k, logprob_rank_workspace_bytes
from trace_replay_core import token_logprob_rank as core_token_logprob_rank

from .logprob_results import (
    LogprobRank,
    LogprobRankArgmax,
    LogprobRankArgmaxEntropy,
    LogprobRankEntropy,
    LogprobRankResult,
    LogprobRankTopK,
    LogprobRankTopKArgmax,
    LogprobRankTopKArgmaxEntropy,
    LogprobRankTopKEntropy,
    named_result,
)
from .views import FUNCTORCH_ACTIVE, layout_key, raw_stream

__all__ = [
    "token_logprob_rank",
    "compute_logprob_rank",
    "LogprobRank",
    "LogprobRankTopK",
    "LogprobRankArgmax",
    "LogprobRankTopKArgmax",
    "LogprobRankEntropy",
    "LogprobRankTopKEntropy",
    "LogprobRankArgmaxEntropy",
    "LogprobRankTopKArgmaxEntropy",
]


_workspace_bytes = functools.lru_cache(maxsize=256)(logprob_rank_workspace_bytes)
_BOUND = BoundCache(64)  # bound calls by tensor layout


def _bound(tensors, top_k, stream):
    """The bound call for this exact layout of tensors, binding (over DLPack) on a miss.
    ``tensors``: logits, ids, logprobs, ranks, workspace, temperature, topk logprobs, topk ids,
    argmax, entropy (the last five may be None); every one of them is part of the key."""

    def bind():
        t = [None if x is None else x.detach() for x in tensors]  # logits may require grad: read-only use
        return bind_logprob_rank(
            t[0],
            t[1],
            out_logprobs=t[2],
            out_ranks=t[3],
            stream=stream,
            workspace=t[4],
            temperature=t[5],
            top_k=top_k,
            out_topk_logprobs=t[6],
            out_topk_ids=t[7],
            out_argmax=t[8],
            out_entropy=t[9],
        )

    key = (top_k,) + tuple(None if x is None else layout_key(x) for x in tensors)
    return _BOUND.bind(key, bind)


def _temperature(temperature, batch: int, device) -> torch.Tensor | None:
    if temperature is None:
        return None
    if isinstance(temperature, numbers.Real) and not isinstance(temperature, bool):
        # Not checked: a T that is not finite and > 0 scores its rows as NaN logits, as a tensor does.
        return torch.full((batch,), float(temperature), dtype=torch.float32, device=device)
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature must be None, a float or a torch.Tensor (got {type(temperature).__name__})")
    return temperature


def token_logprob_rank(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    top_k: int = 0,
    temperature: None | float | torch.Tensor = None,
    out: Sequence[torch.Tensor] | None = None,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobRankResult:
    """Log-probability and rank of ``token_ids[b]`` under row ``b`` of ``logits``, and
    optionally the row's ``top_k`` most likely tokens, its greedy token and its entropy, from
    one read of the logits.

    ``logits``: ``[batch, vocab]`` float32, bfloat16 or float16, rows may be strided (element
    stride 1 along the vocabulary), never modified. ``token_ids``: ``[batch]`` or
    ``[batch, 1]`` int32/int64 on the same device (e.g. ``sampled`` after replay); never
    modified. ``temperature``: None (T = 1), a float for every row, or a float32 ``[batch]`` tensor;
    the results are then those of ``logits / T`` (vLLM's processed logprobs). A row whose ``T``
    is not finite and ``> 0`` (``T <= 0``, NaN, infinite; never an error, on any device) is
    scored as a row of NaN logits: NaN logprob, top-k logprobs and entropy, rank 0 (-1 for an
    id out of range), top-k ids -1, argmax 0. ``top_k``: 0 to
    ``min(64, vocab)``. ``argmax``: a bool; True adds each row's greedy token (below).
    ``entropy``: a bool; True adds each row's entropy (below).

    Returns :class:`LogprobRank` ``(logprobs, ranks)`` when ``top_k == 0``, else
    :class:`LogprobRankTopK` ``(logprobs, ranks, topk_logprobs, topk_ids)``; with
    ``argmax=True``, :class:`LogprobRankArgmax` ``(logprobs, ranks, argmax)`` or
    :class:`LogprobRankTopKArgmax` ``(logprobs, ranks, topk_logprobs, topk_ids, argmax)``;
    with ``entropy=True`` the same fields followed by ``entropy``: :class:`LogprobRankEntropy`,
    :class:`LogprobRankTopKEntropy`, :class:`LogprobRankArgmaxEntropy`,
    :class:`LogprobRankTopKArgmaxEntropy`:

    - ``logprobs`` float32 ``[batch]``: natural log of the softmax probability (float32);
    - ``ranks`` ``[batch]``: the number of vocabulary entries greater than or equal to the
      token's own (vLLM's definition: a unique argmax has rank 1; ties count against it);
    - ``topk_logprobs`` float32 and ``topk_ids`` ``[batch, top_k]``: sorted descending, ties
      broken by the lower id; NaN entries are never selected (id -1, logprob NaN where a row
      has fewer than ``top_k`` others);
    - ``argmax`` ``[batch]``: the row's greedy token, the lowest id among its largest non-NaN
      entries of ``logits / T`` (``torch.argmax``'s choice for a row without NaN; 0 for a row
      of only NaN);
    - ``entropy`` float32 ``[batch]``: ``-sum(p * log(p))`` of the row's ``p = softmax(logits /
      T)`` in nats (what ``torch.distributions.Categorical(logits=...).entropy()`` gives, to
      float32 rounding, from the same read), NaN for the rows whose logprob is NaN for want of
      a normaliser (below).

    Greedy rows: with ``argmax=True`` a row whose token id is negative (-1: "not sampled
    yet") is scored as its greedy token: its logprob and rank are those of ``argmax[b]``, with
    the same bits as a call that passes that id. (Without ``argmax`` a negative id is out of
    range, below.) A greedy decode step is then one pass over the logits::

        sampled.fill_(-1)                                  # every row greedy ...
        state.replay(sampled, idx_mapping)                 # ... except traced rows: their trace token
        token_logprob_rank(logits, sampled, argmax=True, out=(logprobs, ranks, argmax))  # argmax: sampled's dtype
        torch.where(sampled < 0, argmax, sampled, out=sampled)   # the greedy rows take their token

    New tensors (ranks, ids and argmax int64) unless ``out`` gives caller-owned ones in the
    order of the result (float32; ranks, ids and argmax int32 or int64; contiguous; ``argmax``
    then ``entropy`` last), which are written and returned; ``out`` must not overlap the inputs.

    Batch-invariant: the same row gives the same bits in any batch, at any position, for each
    dtype and vocabulary. Special values: a row holding a NaN or ``+inf``, or only ``-inf``
    logits, has NaN logprobs and entropy (ranks are IEEE counts: NaN entries never count); ``-inf`` logits
    are otherwise fine; a token id outside ``[0, vocab)`` gives logprob NaN and rank -1 (no
    error: that check would need a host sync).

    Errors: ``TypeError``/``ValueError`` naming the argument and the value received; a
    rejected call writes nothing.

    Inside ``torch.compile`` the call becomes the registered op of its outputs
    (:func:`~trace_replay_torch.token_logprob_rank_op`; with ``out=``, its results are copied
    into ``out``), so a sampler written with this function compiles into one graph.

    Blocking: ordered on torch's current stream of the logits' device, never synchronises. It
    allocates a workspace with torch (``logprob_rank_workspace_bytes``: 320 bytes per row at
    vocab 151,936, about 16.6 KiB per row with top-k 20; capture-safe through torch's graph
    memory pool) and, for a float temperature, a ``[batch]`` tensor. The first call per device
    and signature (``argmax`` and ``entropy`` are part of it) compiles the kernels: run one eager
    call before capturing a CUDA graph. On CPU tensors it computes in numpy before returning.

    Gradients: when grad mode is on and ``logits`` (or a tensor ``temperature``) requires grad,
    the call goes through the registered op (:func:`token_logprob_rank_op`, a dispatcher call more)
    and the logprobs, top-k logprobs and entropy come back with a ``grad_fn``: their gradient is
    the core's backward kernel (one read of the logits, one write of the gradient,
    batch-invariant). ``out=`` is refused then (such results are new tensors). Without grad the
    call is the direct one above. ``torch.vmap`` and ``torch.func.grad`` work (mapped axes are
    folded into the batch axis).
    """
    if torch.compiler.is_compiling():
        return _compiled_call(logits, token_ids, top_k, temperature, out, argmax, entropy)
    wants_grad = getattr(logits, "requires_grad", False) or (
        temperature is not None and getattr(temperature, "requires_grad", False)
    )
    if (wants_grad and torch.is_grad_enabled()) or (FUNCTORCH_ACTIVE is not None and FUNCTORCH_ACTIVE()):
        if out is not None:
            raise TypeError(
                "out= cannot be used when logits or temperature require grad, or under torch.func "
                "transforms (the results are new tensors): leave out= out, or pass logits.detach()"
            )
        from .ops import token_logprob_rank_op

        return token_logprob_rank_op(
            logits, token_ids, top_k=top_k, temperature=temperature, argmax=argmax, entropy=entropy
        )
    return compute_logprob_rank(
        logits, token_ids, top_k=top_k, temperature=temperature, out=out, argmax=argmax, entropy=entropy
    )


def compute_logprob_rank(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    top_k: int = 0,
    temperature: None | float | torch.Tensor = None,
    out: Sequence[torch.Tensor] | None = None,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobRankResult:
    """:func:`token_logprob_rank` without gradients (the ops' kernels call it: never routed back
    to an op). Same arguments, checks and results."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor (got {type(logits).__name__})")
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor (got {type(token_ids).__name__})")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(logits.shape)})")
    device = logits.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"logits must be on a cpu or cuda device (got {device})")
    batch, vocab = logits.shape
    top_k = check_top_k(top_k, vocab)
    if not isinstance(argmax, bool):
        raise TypeError(f"argmax must be a bool (got {type(argmax).__name__} {argmax!r})")
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool (got {type(entropy).__name__} {entropy!r})")
    if out is None:
        outs = [
            torch.empty(batch, dtype=torch.float32, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
        ]
        if top_k:
            outs += [
                torch.empty(batch, top_k, dtype=torch.float32, device=device),
                torch.empty(batch, top_k, dtype=torch.int64, device=device),
            ]
        else:
            outs += [None, None]
        outs.append(torch.empty(batch, dtype=torch.int64, device=device) if argmax else None)
        outs.append(torch.empty(batch, dtype=torch.float32, device=device) if entropy else None)
    else:
        outs = _caller_outs(out, top_k, argmax, entropy)
    temp = _temperature(temperature, batch, device)
    result = named_result(outs, top_k, argmax, entropy)
    if device.type == "cpu":
        # The numpy backend computes at once (and a CPU tensor's memory is reused freely: no cache).
        core_token_logprob_rank(
            logits.detach(),
            token_ids,
            out_logprobs=outs[0],
            out_ranks=outs[1],
            stream=0,
            temperature=None if temp is None else temp.detach(),
            top_k=top_k,
            out_topk_logprobs=outs[2],
            out_topk_ids=outs[3],
            out_argmax=outs[4],
            out_entropy=outs[5],
        )
        return result
    stream = raw_stream(device.index)
    nbytes = _workspace_bytes(batch, vocab, top_k)
    # Freed when this call returns: torch reuses it only for work queued after ours.
    workspace = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=device)
    _bound((logits, token_ids, outs[0], outs[1], workspace, temp, *outs[2:]), top_k, stream)(stream=stream)
    return result


def _caller_outs(out, top_k: int, argmax: bool, entropy: bool) -> list:
    """``out`` as the six slots the core takes (logprobs, ranks, topk logprobs, topk ids,
    argmax, entropy; None where the call has no such output), or ``TypeError`` naming what it
    expected and what it got. Shapes and dtypes are the core's to check."""
    names = ("logprobs", "ranks") + (("topk_logprobs", "topk_ids") if top_k > 0 else ())
    names += (("argmax",) if argmax else ()) + (("entropy",) if entropy else ())
    if (
        not isinstance(out, (tuple, list))
        or len(out) != len(names)
        or not all(isinstance(t, torch.Tensor) for t in out)
    ):
        got = [type(t).__name__ for t in out] if isinstance(out, (tuple, list)) else type(out).__name__
        flags = f"top_k={top_k}, argmax={argmax}" + (", entropy=True" if entropy else "")
        raise TypeError(f"out must be a ({', '.join(names)}) tuple of torch.Tensor with {flags} (got {got})")
    given = dict(zip(names, out))
    return [given.get(name) for name in ("logprobs", "ranks", "topk_logprobs", "topk_ids", "argmax", "entropy")]


def _compiled_call(logits, token_ids, top_k, temperature, out, argmax: bool, entropy: bool) -> LogprobRankResult:
    """:func:`token_logprob_rank` while ``torch.compile`` traces: the registered op, its
    results copied into ``out`` when given (the graph then writes the caller's tensors)."""
    from .ops import token_logprob_rank_op  # a graph holds the registered op, never the direct path

    result = token_logprob_rank_op(logits, token_ids, top_k=top_k, temperature=temperature, argmax=argmax,
                                   entropy=entropy)  # fmt: skip
    if out is None:
        return result
    outs = _caller_outs(out, top_k, argmax, entropy)
    given = [t for t in outs if t is not None]
    for dst, src in zip(given, result, strict=True):
        dst.copy_(src)
    return type(result)(*given)
