"""``token_logprob_rank``: logprob, rank, optional top-k, greedy token and entropy per row, one read of the logits.

After replay, a decode loop wants the log-probability and the rank of the token that now
stands in ``sampled``, from the unmodified logits (or from ``logits / T``, vLLM's processed
logprobs), and often the ``top_k`` most likely tokens too. Done naively that reads and writes the
``[batch, vocab]`` logits several times; here each logit is read once, and a row gives the same
bits whatever else is in the batch.

Example (CPU backend; on a GPU pass device arrays, a workspace and a stream handle)::

    import numpy as np
    from trace_replay_core import token_logprob_rank

    logits = np.array([[2.0, 1.0, 2.0, -np.inf]], dtype=np.float32)
    token_ids = np.array([0], dtype=np.int64)
    logprobs, ranks = np.empty(1, np.float32), np.empty(1, np.int64)
    top_lp, top_ids = np.empty((1, 2), np.float32), np.empty((1, 2), np.int64)
    token_logprob_rank(logits, token_ids, out_logprobs=logprobs, out_ranks=ranks, stream=0,
                       top_k=2, out_topk_logprobs=top_lp, out_topk_ids=top_ids)
    assert ranks.tolist() == [2]            # the tie with column 2 counts against the token
    assert top_ids.tolist() == [[0, 2]]     # ties: the lower id first
"""

from __future__ import annotations

from typing import Any

from ._dlpack import ArrayView, without_capsules
from ._dtypes import LOGITS_DTYPES, RANK_DTYPES, TOKEN_DTYPES
from ._logprob_checks import (
    LOGPROB_MAX_VOCAB,
    LOGPROB_TOPK_MAX,
    check_top_k,
    logprob_rank_workspace_bytes,
    validated_logprob_call,
)
from ._numpy_backend import logprob_rank_numpy
from ._streams import stream_handle

__all__ = [
    "token_logprob_rank",
    "bind_logprob_rank",
    "BoundLogprobRank",
    "logprob_rank_workspace_bytes",
    "check_top_k",
    "LOGITS_DTYPES",
    "TOKEN_DTYPES",
    "RANK_DTYPES",
    "MAX_VOCAB",
    "TOPK_MAX",
]

MAX_VOCAB = LOGPROB_MAX_VOCAB
TOPK_MAX = LOGPROB_TOPK_MAX


def token_logprob_rank(
    logits: Any,
    token_ids: Any,
    *,
    out_logprobs: Any,
    out_ranks: Any,
    stream: Any,
    workspace: Any = None,
    temperature: Any = None,
    top_k: int = 0,
    out_topk_logprobs: Any = None,
    out_topk_ids: Any = None,
    out_argmax: Any = None,
    out_entropy: Any = None,
) -> None:
    """Write the log-probability and rank of ``token_ids[b]`` under row ``b`` of ``logits``
    (and, with ``top_k``, the row's ``top_k`` most likely tokens; with ``out_argmax``, the row's
    greedy token; with ``out_entropy``, the entropy of the row's distribution).

    For each row ``b`` with token ``t = token_ids[b]`` and ``y = logits[b, :] / T`` (``T =
    temperature[b]``, 1 without a temperature; float32, the logits converted exactly):

    - ``out_logprobs[b] = y[t] - logsumexp(y)`` (natural log, float32);
    - ``out_ranks[b]`` = the number of vocabulary entries with ``y >= y[t]`` (vLLM's definition):
      a unique argmax has rank 1, and ties count against the token;
    - with ``top_k > 0``: ``out_topk_ids[b]`` the ids of the ``top_k`` largest ``y``, sorted
      descending, ties broken by the lower id, and ``out_topk_logprobs[b]`` their logprobs;
    - with ``out_argmax``: ``out_argmax[b]`` = the row's greedy token, the lowest id among the
      largest non-NaN ``y`` (0 when every entry is NaN), from the same read. A row whose token
      id is negative (``-1``: "not sampled yet") is then scored as its greedy token: its logprob
      and rank are those of ``out_argmax[b]``, with the same bits as a call that passes that id.
      So a greedy decode step is one pass over the logits: fill ``token_ids`` with -1, replay
      (traced rows get their trace token), call this, and take ``out_argmax`` where the id is
      negative. Without ``out_argmax`` a negative id is out of range (below).
    - with ``out_entropy``: ``out_entropy[b] = -sum(p * log(p))`` over the row's ``p =
      softmax(y)`` (Shannon entropy in nats, float32; 0 for a row with one finite entry, ``log
      vocab`` for a uniform row), whatever the token, from the same read. It is computed as
      ``log(S) - U / S`` with ``S = sum(exp(y - max))`` and ``U = sum(exp(y - max) * (y -
      max))``, both accumulated next to the log-sum-exp: two terms >= 0, so nothing cancels
      (tested to ``1e-5`` relative plus ``1e-6`` against a float64 reference; the absolute part
      is ``log(S)``'s rounding, which does not shrink with the entropy).

    Batch-invariant: a row's results have the same bits whatever the batch size, the row's
    position, padding rows or the other rows, for each logits dtype and vocabulary: the
    reduction order depends on the vocabulary alone (rows are cut into fixed chunks, each summed
    in one order fixed by the compiled kernel, the chunks merged in order; no atomics). The
    compiled kernel depends on the dtypes, the vocabulary, ``top_k > 0``, whether a temperature
    is given and whether rows start on 16-byte boundaries, never on the batch; rows that do not
    (a padded stride, an array starting off a 16-byte boundary, 50,257 float32 logits per row)
    read each 16-byte line as the two aligned vectors around it and shift it into place, so
    every layout gives the bits of the same rows stored contiguously. A call with
    ``top_k`` gives the same logprob and rank bits as one without. ``out_entropy`` is
    batch-invariant in the same way (reduced in the same chunks, merged in the same order). The
    CPU backend is batch-invariant too (numpy, row by row), but its bits differ from the GPU's.

    Special values (the same on the GPU and the CPU backend):

    - ``-inf`` logits are valid: they add nothing to the sum; a token whose logit is ``-inf``
      has logprob ``-inf`` and a rank counting every non-NaN entry.
    - A row holding a NaN or a ``+inf``, or only ``-inf`` logits, has no finite normaliser: its
      logprob is NaN (and so are its top-k logprobs and its entropy). Its rank is still the IEEE
      count (NaN entries never count; a token whose own logit is NaN has rank 0).
    - Top-k never selects a NaN entry: a row with fewer than ``top_k`` non-NaN entries gets id
      -1 (logprob NaN) in the remaining places.
    - A token id outside ``[0, vocab)`` gives logprob NaN and rank -1. No error is raised:
      checking on the device and raising would need a host synchronisation.

    Parameters
    ----------
    logits:
        ``[batch, vocab]`` float32, bfloat16 or float16 (DLPack object or :class:`ArrayView`;
        read-only is fine), ``1 <= vocab <= 2**30``. Rows may be strided (row stride up to
        ``2**31 - 1`` elements, element stride 1 along the vocabulary).
    token_ids:
        ``[batch]`` or ``[batch, 1]`` int32/int64, contiguous, same device.
    out_logprobs, out_ranks:
        Caller-owned outputs, ``[batch]``, contiguous, writable, same device: ``out_logprobs``
        float32 and ``out_ranks`` int32 or int64. Every row is written. They must not overlap
        the inputs or each other.
    stream:
        Keyword-only, required: an int CUDA stream handle or an object with
        ``__cuda_stream__``. The inputs are consumed over DLPack on this stream and the kernels
        are queued on it. For arrays in host memory the computation runs at once in numpy and
        the stream is only validated.
    workspace:
        Device scratch the caller owns, required on a GPU: 1-D, contiguous, writable, 16-byte
        aligned, at least :func:`logprob_rank_workspace_bytes` ``(batch, vocab, top_k)`` bytes.
        Its contents are scratch; it must not be used by a call that may run at the same time
        (another stream). Ignored on the CPU backend (may be omitted there).
    temperature:
        Optional ``[batch]`` float32, contiguous, same device: per-row ``T``; the token's own
        logit is scaled the same way. Never read on the host and never an error (checking a
        device array would need a host synchronisation): a row whose ``T`` is not finite and
        ``> 0`` (``T <= 0``, NaN, infinite) is scored as a row of NaN logits, on the GPU and
        the CPU backend alike: logprob, top-k logprobs and entropy NaN, rank 0 (0 for a valid
        id, -1 for an id out of range, as always), top-k ids -1, argmax 0.
    top_k:
        ``0 <= top_k <= min(64, vocab)``.
    out_topk_logprobs, out_topk_ids:
        With ``top_k > 0``, caller-owned ``[batch, top_k]`` outputs, contiguous, writable:
        float32 and int32/int64.
    out_argmax:
        Optional caller-owned ``[batch]`` output, contiguous, writable, int32 or int64. Every
        row is written. The kernels that fill it are compiled apart from the ones without it,
        so a call without ``out_argmax`` pays nothing for it. With it, the call takes about
        1.15x the time of one without (bfloat16, vocab 151,936).
    out_entropy:
        Optional caller-owned ``[batch]`` output, contiguous, writable, float32. Every row is
        written. As with ``out_argmax``, the kernels that fill it are compiled apart, so a call
        without it pays nothing for it (``bench/logprob_rank.py`` times the two side by side).

    Blocking and ownership: on a GPU the call is stream-ordered: it queues two kernels on
    ``stream`` (one on sm_90 and later without top-k when the rows fit on the device at once,
    a few dozen rows of 151,936 logits; the same bits either way) and returns without
    synchronising; it allocates nothing, so it may be captured in a CUDA graph once the
    kernels are compiled (the first call for a device and signature compiles them,
    host-blocking: make it before capturing). The arrays must stay alive until the queued work
    has run. On the CPU backend the call computes before it returns. A rejected call (any
    exception from validation) writes nothing; on a GPU a CUDA driver call that fails (the
    launch, the first call's kernel load) raises :class:`~trace_replay_core.CudaError`.
    """
    checked = validated_logprob_call(
        logits,
        token_ids,
        out_logprobs,
        out_ranks,
        stream,
        workspace,
        temperature,
        top_k,
        out_topk_logprobs,
        out_topk_ids,
        out_argmax,
        out_entropy,
    )
    if checked is None:
        return
    views, args, dtypes, handle = checked
    if args is None:
        logprob_rank_numpy(*views)
    else:
        from . import _cuda
        from .kernels.logprob_rank import launch_logprob_rank

        device_id = views[0].device_id
        with _cuda.on_device(device_id):  # the caller's current context is restored afterwards
            launch_logprob_rank(args, dtypes, device_id, handle)


class BoundLogprobRank:
    """A :func:`token_logprob_rank` call whose arrays were validated and fixed by
    :func:`bind_logprob_rank`.

    ``bound(stream=s)`` queues the call on stream ``s`` and returns: one or two kernel launches, no
    validation, no DLPack, stream-ordered, never blocking; capturable in a CUDA graph (a failing
    launch raises :class:`~trace_replay_core.CudaError`). On the
    CPU backend it computes in numpy before returning. ``views`` holds the validated arrays
    (their DLPack capsules keep the memory alive while the object lives).
    """

    __slots__ = ("_launch", "views")

    def __init__(self, launch, views):
        self._launch = launch
        self.views = views

    def release(self) -> None:
        """Drop this object's views and with them its hold on the arrays' DLPack capsules: the
        arrays may then be freed, and the caller must keep them alive while it uses this bound
        call (a cache keyed by address does). The views themselves are not changed (one may be
        the caller's own :class:`ArrayView`). Host-only."""
        self.views = ()

    def __call__(self, *, stream: Any) -> None:
        handle = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
        if self._launch is not None:
            self._launch(handle)


def bind_logprob_rank(
    logits: Any,
    token_ids: Any,
    *,
    out_logprobs: Any,
    out_ranks: Any,
    stream: Any,
    workspace: Any = None,
    temperature: Any = None,
    top_k: int = 0,
    out_topk_logprobs: Any = None,
    out_topk_ids: Any = None,
    out_argmax: Any = None,
    out_entropy: Any = None,
) -> BoundLogprobRank:
    """Validate the arrays of a :func:`token_logprob_rank` call once and return a
    :class:`BoundLogprobRank` that repeats exactly that call.

    For loops that reuse the same buffers every step (or a cache keyed by buffer layout, as the
    torch adapter keeps): each call of the result only queues the kernels, about a tenth of the
    host time of an unbound call. Arguments and errors as :func:`token_logprob_rank`, and an input
    whose producer exported a copy over DLPack is refused (the bound call keeps its pointer);
    ``stream`` is used for the DLPack handshake here, each call of the result names its own.
    Host-blocking only when it compiles the kernels (the first time for a device and signature).
    On sm_90 and later the kernels of a bound call are queued as programmatic dependent launches:
    the first may be scheduled while the kernel before it on the stream ends, and waits on the
    device for that kernel's writes before it reads anything; stream order is kept as for any
    launch.
    """
    checked = validated_logprob_call(
        logits,
        token_ids,
        out_logprobs,
        out_ranks,
        stream,
        workspace,
        temperature,
        top_k,
        out_topk_logprobs,
        out_topk_ids,
        out_argmax,
        out_entropy,
        bound=True,
    )
    if checked is None:
        return BoundLogprobRank(None, ())
    views, args, dtypes, _ = checked
    kept = tuple(v for v in views if isinstance(v, ArrayView))
    if args is None:
        cpu = without_capsules(views)  # the launch keeps pointers: release() lets the arrays go
        return BoundLogprobRank(lambda _stream: logprob_rank_numpy(*cpu), kept)
    from . import _cuda
    from .kernels.logprob_rank import bind_logprob_rank_launch

    device_id = views[0].device_id
    with _cuda.on_device(device_id):
        launch = bind_logprob_rank_launch(args, dtypes, device_id)
    return BoundLogprobRank(launch, kept)
