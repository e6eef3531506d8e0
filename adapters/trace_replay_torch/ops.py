"""Replay and logprob/rank as torch custom ops (``torch.ops.trace_replay.*``), for ``torch.compile``.

A sampler that samples, replays and scores compiles into one graph (``fullgraph=True``) and stays
capturable in a CUDA graph (``torch.cuda.graph`` around the compiled function, or
``mode="reduce-overhead"``). Written with the state's methods and
:func:`~trace_replay_torch.token_logprob_rank` it compiles as it is (while Dynamo traces, they
become these ops); the ``_op`` functions here call the ops directly, in any mode::

    import torch
    from trace_replay_torch import replay_op, token_logprob_rank_op

    @torch.compile(fullgraph=True)
    def sample(state, logits, idx_mapping):
        sampled = torch.argmax(logits, dim=-1)            # [batch] int64
        replay_op(state, sampled, idx_mapping)            # in place: traced rows take their trace
        logprobs, ranks = token_logprob_rank_op(logits, sampled)
        return sampled, logprobs, ranks

The ops (schemas as registered; ``[...]``: present in the ops of that name part)::

    trace_replay::replay(Tensor(a!) sampled, Tensor idx_mapping, Tensor total_len,
                         Tensor prompt_len, int state) -> ()
    trace_replay::replay_at_step(Tensor(a!) sampled, Tensor idx_mapping, Tensor step,
                                 int state) -> ()
    trace_replay::token_logprob_rank[_topk][_argmax][_entropy](Tensor logits, Tensor token_ids,
        [int top_k,] Tensor? temperature=None)
        -> (logprobs, ranks, [topk_logprobs, topk_ids,] [argmax,] [entropy])   (each a Tensor)

Each logprob op has a ``_nograd`` twin (``trace_replay::token_logprob_rank_nograd`` ...): the same
schema, kernels and bits without an autograd formula (torch's C++ fallthrough), which the wrappers
call when no gradient is wanted, so that a step pays no Python autograd layer.

The ``_entropy`` ops add each row's entropy (last; ``token_logprob_rank(..., entropy=True)``).
The ``_argmax`` ops add each row's greedy token (before the entropy) and score rows whose id is
negative as it (``token_logprob_rank(..., argmax=True)``), so a compiled greedy sampler reads the
logits once::

    @torch.compile(fullgraph=True)
    def greedy(state, logits, idx_mapping):
        sampled = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
        replay_op(state, sampled, idx_mapping)            # traced rows take their trace
        logprobs, ranks, argmax = token_logprob_rank_op(logits, sampled, argmax=True)
        return torch.where(sampled < 0, argmax, sampled), logprobs, ranks

How an op reaches its table: a ``TraceReplayState`` is not a tensor, so the replay ops name it by
``state.op_id``, an int issued at construction by :mod:`.registry` (unique in the process, never
reused); the kernels behind them look the state up there at call time. Everything a replay reads
that the loop changes (``sampled``, ``idx_mapping``, the per-slot ``total_len``/``prompt_len`` or
the per-row ``step``) is a tensor argument, so the compiler orders the op after the writes that
produce them; the only state read behind the compiler's back is the trace table, which changes
only at ``apply_staged_writes`` (host-side, between steps, never inside a graph). The wrappers
pass the state's bound lengths as those tensor arguments. A compiled function guards on the state
it was traced with (its id, whether it is open, its bound lengths): another state, a rebinding or
a close retraces it.

Lifetime: after ``state.close()`` the wrappers raise ``RuntimeError("this TraceReplayState is
closed")``, and so does a compiled function that holds the state (``fullgraph=True`` or not):
the op refuses the closed id when the graph runs (the message then names the id). A CUDA graph
(``torch.cuda.graph`` or ``reduce-overhead``) captured with a replay holds the table's device
address and never runs the Python kernel again: replaying such a graph after ``close`` reads freed
memory, so close a state only after its graphs are gone. Thread-safety: as the state's methods
(lookups in the registry take no lock; ids are issued under one).

In place: the replay ops bump ``sampled``'s version counter, as torch's in-place ops do (their
kernels run the state's methods, which do it), so autograd refuses a backward through a tensor it
saved before the replay. ``torch.vmap`` over a replay op is refused, naming what to do instead
(fold the mapped axis into the batch); the logprob ops fold it themselves.

Blocking: as the eager methods: ordered on torch's current stream, no host sync. Cost: an op call
goes through torch's dispatcher (a few microseconds per call, ``bench/launch.py``); called eagerly,
:meth:`TraceReplayState.replay` and :func:`token_logprob_rank` skip it (the direct path).
The first call of each tensor layout binds (validates once), as in eager mode: run the compiled
function once before capturing it.
"""

from __future__ import annotations

import torch

from trace_replay_core import check_top_k

from . import registry
from .logprob import _temperature, compute_logprob_rank  # the ops' kernels: never routed back to an op
from .logprob_grad import differentiable, register_logprob_grads
from .logprob_results import LogprobRankResult, result_type
from .state import TraceReplayState, _not_a_tensor

__all__ = ["replay_op", "replay_at_step_op", "token_logprob_rank_op"]

_LIB = torch.library.Library("trace_replay", "DEF")  # kept alive: dropping it deregisters the ops
_LIB.define("replay(Tensor(a!) sampled, Tensor idx_mapping, Tensor total_len, Tensor prompt_len, int state) -> ()")
_LIB.define("replay_at_step(Tensor(a!) sampled, Tensor idx_mapping, Tensor step, int state) -> ()")
_LIB.define("token_logprob_rank(Tensor logits, Tensor token_ids, Tensor? temperature=None) -> (Tensor, Tensor)")
_LIB.define(
    "token_logprob_rank_topk(Tensor logits, Tensor token_ids, int top_k, Tensor? temperature=None) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "token_logprob_rank_argmax(Tensor logits, Tensor token_ids, Tensor? temperature=None) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "token_logprob_rank_topk_argmax(Tensor logits, Tensor token_ids, int top_k, Tensor? temperature=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "token_logprob_rank_entropy(Tensor logits, Tensor token_ids, Tensor? temperature=None) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "token_logprob_rank_topk_entropy(Tensor logits, Tensor token_ids, int top_k, Tensor? temperature=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "token_logprob_rank_argmax_entropy(Tensor logits, Tensor token_ids, Tensor? temperature=None) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "token_logprob_rank_topk_argmax_entropy(Tensor logits, Tensor token_ids, int top_k, Tensor? temperature=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LOGPROB_OPS = (
    "token_logprob_rank",
    "token_logprob_rank_topk",
    "token_logprob_rank_argmax",
    "token_logprob_rank_topk_argmax",
    "token_logprob_rank_entropy",
    "token_logprob_rank_topk_entropy",
    "token_logprob_rank_argmax_entropy",
    "token_logprob_rank_topk_argmax_entropy",
)


# kernels: real tensors on the CPU or a CUDA device ----------------------------------------------
def _replay_kernel(sampled, idx_mapping, total_len, prompt_len, state):
    st = registry.lookup(state)
    lengths = st._lengths
    if lengths is not None and total_len is lengths[0] and prompt_len is lengths[1]:
        st.replay(sampled, idx_mapping)  # the bound lengths: the state's one-key hot path
    else:
        st.replay(sampled, idx_mapping, total_len, prompt_len)


def _replay_at_step_kernel(sampled, idx_mapping, step, state):
    registry.lookup(state).replay_at_step(sampled, idx_mapping, step)


def _logprob_kernel(name: str):
    """The kernel of logprob op ``name`` (``token_logprob_rank[_topk][_argmax][_entropy]``): the
    eager function's no-gradient path, its results as a tuple."""
    argmax, entropy = "_argmax" in name, "_entropy" in name
    if "_topk" not in name:

        def kernel(logits, token_ids, temperature=None):
            return tuple(
                compute_logprob_rank(logits, token_ids, temperature=temperature, argmax=argmax, entropy=entropy)
            )

        return kernel

    def topk_kernel(logits, token_ids, top_k, temperature=None):
        return tuple(
            compute_logprob_rank(
                logits, token_ids, top_k=top_k, temperature=temperature, argmax=argmax, entropy=entropy
            )
        )

    return topk_kernel


_LOGPROB_KERNELS = tuple(_logprob_kernel(name) for name in _LOGPROB_OPS)
for _key in ("CPU", "CUDA"):
    _LIB.impl("replay", _replay_kernel, _key)
    _LIB.impl("replay_at_step", _replay_at_step_kernel, _key)
    for _name, _kernel in zip(_LOGPROB_OPS, _LOGPROB_KERNELS):
        _LIB.impl(_name, _kernel, _key)
for _name in ("replay", "replay_at_step"):
    # Not differentiable: integer tokens in and out. A fallthrough says so: outputs never require grad.
    # The write to sampled is not hidden from autograd all the same: the kernels run the state's
    # methods, which bump sampled's version counter after it, as torch's in-place ops do.
    _LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")

_VMAP = (
    "trace_replay_torch's {op} (state.{op}, {op}_op) does not support torch.vmap: it already replays a "
    "whole batch. Call it on the batched tensors instead (fold the mapped axis into the batch axis: "
    "{names} as [n * batch]), without vmap"
)


def _refuse_vmap(op: str, names: str):
    def rule(info, in_dims, *args):
        raise ValueError(_VMAP.format(op=op, names=names))

    return rule


torch.library.register_vmap("trace_replay::replay", _refuse_vmap("replay", "sampled and idx_mapping"), lib=_LIB)
torch.library.register_vmap(
    "trace_replay::replay_at_step", _refuse_vmap("replay_at_step", "sampled, idx_mapping and step"), lib=_LIB
)


# fake kernels: shapes and dtypes only (FakeTensor, meta), for tracing ---------------------------
@torch.library.register_fake("trace_replay::replay", lib=_LIB)
def _replay_fake(sampled, idx_mapping, total_len, prompt_len, state):
    return None


@torch.library.register_fake("trace_replay::replay_at_step", lib=_LIB)
def _replay_at_step_fake(sampled, idx_mapping, step, state):
    return None


def _check_logits(logits) -> int:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(logits.shape)})")
    return logits.shape[0]


def _logprob_fake(name: str):
    """The fake kernel of logprob op ``name``: its outputs' shapes and dtypes (float32 logprobs,
    top-k logprobs and entropy; int64 ranks, top-k ids and argmax)."""
    topk, argmax, entropy = "_topk" in name, "_argmax" in name, "_entropy" in name

    def fake(logits, token_ids, *args):
        batch = _check_logits(logits)
        f32, i64 = torch.float32, torch.int64
        outs = [logits.new_empty(batch, dtype=f32), logits.new_empty(batch, dtype=i64)]
        if topk:  # args[0] is top_k
            outs += [logits.new_empty(batch, args[0], dtype=f32), logits.new_empty(batch, args[0], dtype=i64)]
        outs += [logits.new_empty(batch, dtype=i64)] if argmax else []
        outs += [logits.new_empty(batch, dtype=f32)] if entropy else []
        return tuple(outs)

    return fake


_LOGPROB_FAKES = tuple(_logprob_fake(name) for name in _LOGPROB_OPS)
for _name, _fake in zip(_LOGPROB_OPS, _LOGPROB_FAKES):
    torch.library.register_fake(f"trace_replay::{_name}", _fake, lib=_LIB)


# no-gradient twins: each logprob op again as ``<name>_nograd``, same schema, kernels, fake and vmap
# rule, with torch's C++ fallthrough for autograd: what the wrappers call when no gradient is
# wanted. The differentiable op's autograd kernel is Python and runs on every call through the
# dispatcher, gradient or not (about 10 us of the op's 42 at batch 256 on an H200 host).
def _define_nograd_twins() -> None:
    for name, kernel, fake in zip(_LOGPROB_OPS, _LOGPROB_KERNELS, _LOGPROB_FAKES):
        schema = str(getattr(torch.ops.trace_replay, name).default._schema).split("::", 1)[1]
        _LIB.define(schema.replace(f"{name}(", f"{name}_nograd(", 1))
        for key in ("CPU", "CUDA"):
            _LIB.impl(f"{name}_nograd", kernel, key)
        _LIB.impl(f"{name}_nograd", torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(f"trace_replay::{name}_nograd", fake, lib=_LIB)


_define_nograd_twins()


# wrappers: the public functions ----------------------------------------------------------------
def _check_tensors(**arrays) -> None:
    error = _not_a_tensor(**arrays)
    if error is not None:
        raise error


def _check_state(state) -> None:
    if not isinstance(state, TraceReplayState):
        raise TypeError(f"state must be a trace_replay_torch.TraceReplayState (got {type(state).__name__})")


def replay_op(
    state: TraceReplayState,
    sampled: torch.Tensor,
    idx_mapping: torch.Tensor,
    total_len: torch.Tensor | None = None,
    prompt_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """:meth:`TraceReplayState.replay` through the registered op ``trace_replay::replay``, the op
    the method becomes inside ``torch.compile`` (no graph break); capturable in CUDA graphs.

    Same arguments and result: overwrites traced rows of ``sampled`` in place (``[batch]`` or
    ``[batch, 1]`` int32/int64) and returns it; ``total_len``/``prompt_len`` default to the
    state's bound ones. Stream-ordered on the current stream, no host sync. Called eagerly it
    works too, at the dispatcher's cost.
    """
    _check_state(state)
    if total_len is None and prompt_len is None:
        total_len, prompt_len = state._bound_lengths()
    else:
        state._check_open_unless_tracing()
        if total_len is None or prompt_len is None:
            raise ValueError("give both total_len and prompt_len, or neither (to use the bound ones)")
    _check_tensors(sampled=sampled, idx_mapping=idx_mapping, total_len=total_len, prompt_len=prompt_len)
    torch.ops.trace_replay.replay(sampled, idx_mapping, total_len, prompt_len, state.op_id)
    return sampled


def replay_at_step_op(
    state: TraceReplayState, sampled: torch.Tensor, idx_mapping: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """:meth:`TraceReplayState.replay_at_step` through the registered op
    ``trace_replay::replay_at_step`` (``step``: ``[batch]`` int32/int64 outputs already produced
    per row). In place on ``sampled``, which it returns; stream-ordered, no host sync."""
    _check_state(state)
    state._check_open_unless_tracing()
    _check_tensors(sampled=sampled, idx_mapping=idx_mapping, step=step)
    torch.ops.trace_replay.replay_at_step(sampled, idx_mapping, step, state.op_id)
    return sampled


def token_logprob_rank_op(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    top_k: int = 0,
    temperature: None | float | torch.Tensor = None,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobRankResult:
    """:func:`trace_replay_torch.token_logprob_rank` through the registered ops
    ``trace_replay::token_logprob_rank`` (``top_k == 0``), ``trace_replay::token_logprob_rank_topk``
    and their ``_argmax`` (``argmax=True``) and ``_entropy`` (``entropy=True``) forms, the ops the
    function becomes inside ``torch.compile``.

    Same arguments (``out=`` aside) and results: :class:`LogprobRank` ``(logprobs, ranks)``,
    :class:`LogprobRankTopK` with ``top_k > 0``, :class:`LogprobRankArgmax` /
    :class:`LogprobRankTopKArgmax` with ``argmax=True`` (each row's greedy token; a row whose id
    is negative is scored as it), and with ``entropy=True`` the same followed by each row's
    entropy (:class:`LogprobRankEntropy` ...); new tensors (float32 logprobs and entropies, int64
    ranks, ids and argmax). A float ``temperature`` becomes a ``[batch]`` float32 tensor here, as in
    the eager function. ``logits`` is read, never modified. Differentiable: the logprobs, top-k
    logprobs and entropy carry gradients to ``logits`` and a tensor ``temperature`` (the core's
    backward kernel, :mod:`.logprob_grad`); ``torch.vmap`` folds mapped axes into the batch.
    Stream-ordered on the current stream, no host sync.
    """
    _check_tensors(logits=logits, token_ids=token_ids)
    if not isinstance(argmax, bool):
        raise TypeError(f"argmax must be a bool (got {type(argmax).__name__} {argmax!r})")
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool (got {type(entropy).__name__} {entropy!r})")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(logits.shape)})")
    top_k = check_top_k(top_k, logits.shape[1])  # here, once, whichever op runs (a fake kernel fails on -1)
    temp = _temperature(temperature, logits.shape[0], logits.device)
    ops, x = torch.ops.trace_replay, logits
    name = "token_logprob_rank" + ("_topk" if top_k else "") + ("_argmax" if argmax else "")
    name += "_entropy" if entropy else ""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, temp)):
        op = differentiable(name).apply
    else:
        op = getattr(ops, name + "_nograd")
    outs = op(x, token_ids, top_k, temp) if top_k else op(x, token_ids, temp)
    return result_type(top_k, argmax, entropy)(*outs)


register_logprob_grads(_LOGPROB_OPS)
