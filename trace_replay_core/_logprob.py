"""``token_logprob_rank``: logprob and rank of one token per row, computed in one read of the logits.

After replay, a decode loop wants the log-probability and the rank of the token that now
stands in ``sampled``, from the unmodified logits. Done naively (a float32 log-softmax over
the vocabulary, a gather, then a count of larger logits) that reads and writes the
``[batch, vocab]`` logits several times; here each logit is read once.

Example (CPU backend; on a GPU pass device arrays and a stream handle)::

    import numpy as np
    from trace_replay_core import token_logprob_rank

    logits = np.array([[2.0, 1.0, 2.0, -np.inf]], dtype=np.float32)
    token_ids = np.array([0], dtype=np.int64)
    logprobs = np.empty(1, dtype=np.float32)
    ranks = np.empty(1, dtype=np.int64)
    token_logprob_rank(logits, token_ids, out_logprobs=logprobs, out_ranks=ranks, stream=0)
    assert ranks.tolist() == [2]            # the tie with column 2 counts against the token
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from ._numpy_backend import numpy_of
from ._dlpack import CPU, ArrayView, as_view, check_view
from ._streams import stream_handle

__all__ = [
    "token_logprob_rank",
    "bind_logprob_rank",
    "BoundLogprobRank",
    "logprob_rank_workspace_bytes",
    "plan_logprob_rank",
    "LogprobRankPlan",
    "LOGITS_DTYPES",
    "TOKEN_ID_DTYPES",
    "RANK_DTYPES",
    "MAX_VOCAB",
    "SPLIT_TARGET_PROGRAMS",
]

LOGITS_DTYPES = ("float32", "bfloat16", "float16")
TOKEN_ID_DTYPES = ("int32", "int64")
RANK_DTYPES = ("int32", "int64")
MAX_VOCAB = 2**30
# A batch smaller than this is split so that about this many programs run (two per SM on a
# 132-SM H200); a larger batch gets one program per row and needs no workspace. Measured on the
# H200 (2026-11-30, bench/logprob_rank.py, device time with the host cost hidden), 512 instead:
# batch 256 went from 27.4 to 28.3 us (bf16) and from 42.7 to 50.9 us (float32), the second
# launch and the partials costing more than the extra programs gain.
SPLIT_TARGET_PROGRAMS = 256
_PARTIAL_BYTES = 12           # per (row, split): float32 max, float32 sum, int32 count
_INT32_MAX = 2**31 - 1


class LogprobRankPlan(NamedTuple):
    """How one call is launched: ``n_split`` programs per row, each over ``chunk_blocks``
    blocks of ``block`` logits, read as vectors of ``vec`` logits (16 bytes); ``aligned`` when
    rows start on 16-byte boundaries."""
    n_split: int
    chunk_blocks: int
    block: int
    vec: int
    aligned: bool


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_logprob_rank(batch: int, vocab: int, *, split: bool, block: Optional[int] = None,
                      logits_ptr: int = 0, row_stride: int = 0, itemsize: int = 4) -> LogprobRankPlan:
    """The launch plan for ``[batch, vocab]`` logits (host-only, pure).

    ``split`` allows several programs per row (needs a workspace). Rows are split only when
    ``batch < SPLIT_TARGET_PROGRAMS``, into at most ``SPLIT_TARGET_PROGRAMS // batch`` (rounded
    up) pieces of whole blocks; every piece holds at least one logit.
    """
    if block is None:
        from .kernels.logprob_rank import LOGPROB_BLOCK
        block = LOGPROB_BLOCK
    nblocks = max(1, _cdiv(vocab, block))
    want = min(_cdiv(SPLIT_TARGET_PROGRAMS, max(batch, 1)), nblocks) if split else 1
    chunk_blocks = _cdiv(nblocks, want)
    n_split = _cdiv(nblocks, chunk_blocks)
    aligned = logits_ptr % 16 == 0 and (batch <= 1 or (row_stride * itemsize) % 16 == 0)
    return LogprobRankPlan(n_split, chunk_blocks, block, 16 // itemsize, aligned)


def logprob_rank_workspace_bytes(batch: int, vocab: int) -> int:
    """Bytes of device workspace with which a ``[batch, vocab]`` call splits its rows; 0 when
    it would not split (``batch >= SPLIT_TARGET_PROGRAMS``, or a row of one block). Host-only.

    The result is at most ``12 * (2 * SPLIT_TARGET_PROGRAMS)`` bytes (6 KiB).
    """
    p = plan_logprob_rank(batch, vocab, split=True)
    return 0 if p.n_split == 1 else batch * p.n_split * _PARTIAL_BYTES


# -- validation --------------------------------------------------------------------------------

def _span(v: ArrayView) -> Tuple[int, int]:
    """Byte range [lo, hi) touched by a view with non-negative strides."""
    if v.size == 0:
        return (v.ptr, v.ptr)
    last = sum((n - 1) * s for n, s in zip(v.shape, v.strides))
    return (v.ptr, v.ptr + (last + 1) * v.itemsize)


def _check_disjoint(named) -> None:
    spans = [(name, _span(v)) for name, v in named if v.size]
    for i, (a, (alo, ahi)) in enumerate(spans):
        for b, (blo, bhi) in spans[i + 1:]:
            if alo < bhi and blo < ahi:
                raise ValueError(f"{a} and {b} overlap in memory ({a} at 0x{alo:x}..0x{ahi:x}, {b} at "
                                 f"0x{blo:x}..0x{bhi:x}); the outputs must not alias the inputs or each other")


def _check_logits(v: ArrayView) -> ArrayView:
    check_view(v, name="logits", dtypes=LOGITS_DTYPES, ndim=2, contiguous=False)
    batch, vocab = v.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"logits must have between 1 and {MAX_VOCAB} columns (the vocabulary) "
                         f"(got shape {list(v.shape)})")
    row_stride, col_stride = v.strides
    if batch and vocab > 1 and col_stride != 1:
        raise ValueError(f"logits must be contiguous along the vocabulary (element stride 1 in dimension 1; "
                         f"got shape {list(v.shape)} with element strides {list(v.strides)})")
    if batch > 1 and not 0 <= row_stride <= _INT32_MAX:
        raise ValueError(f"logits must have a row stride between 0 and {_INT32_MAX} elements "
                         f"(got shape {list(v.shape)} with element strides {list(v.strides)})")
    return v


def _check_token_ids(v: ArrayView, batch: int, device: str) -> ArrayView:
    if not (v.ndim == 1 or (v.ndim == 2 and v.shape[1] == 1)):
        raise ValueError(f"token_ids must be 1-D [batch] or [batch, 1], one token per row "
                         f"(got shape {list(v.shape)})")
    return check_view(v, name="token_ids", dtypes=TOKEN_ID_DTYPES, device=device, length=batch)


def _check_workspace(v: ArrayView, device: str, need: int) -> ArrayView:
    # Any element type: only the bytes count.
    check_view(v, name="workspace", dtypes=(v.dtype,), device=device, ndim=1, writable=True)
    nbytes = v.size * v.itemsize
    if nbytes < need:
        raise ValueError(f"workspace must hold at least {need} bytes for this call (see "
                         f"logprob_rank_workspace_bytes; got {nbytes} bytes, {v.describe()})")
    if v.ptr % 16:
        raise ValueError(f"workspace must be aligned to 16 bytes (got address 0x{v.ptr:x})")
    return v


# -- CPU backend -------------------------------------------------------------------------------

_CPU_ROWS_ELEMENTS = 1 << 22   # logits converted to float32 per chunk of rows (16 MiB)


def _numpy_strided(v: ArrayView) -> np.ndarray:
    """A read-only numpy view over a CPU view's memory, strides kept (bfloat16 as uint16 bits)."""
    np_dtype = np.uint16 if v.dtype == "bfloat16" else np.dtype(v.dtype)
    if v.size == 0:
        return np.empty(v.shape, dtype=np_dtype)
    _, hi = _span(v)
    buf = (ctypes.c_char * (hi - v.ptr)).from_address(v.ptr)
    base = np.frombuffer(buf, dtype=np_dtype)
    out = np.lib.stride_tricks.as_strided(base, shape=v.shape, strides=[s * v.itemsize for s in v.strides],
                                          writeable=False)
    return out


def _as_float32(block: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32)


def _cpu_logprob_rank(logits: ArrayView, ids: ArrayView, out_lp: ArrayView, out_rank: ArrayView) -> None:
    """The numpy backend: same contract as the kernel, computed in float32 by row chunks."""
    x_all = _numpy_strided(logits)
    ids_all = numpy_of(ids).reshape(-1)
    lp_all = numpy_of(out_lp)
    rank_all = numpy_of(out_rank)
    batch, vocab = logits.shape
    rows = max(1, _CPU_ROWS_ELEMENTS // vocab)
    for r0 in range(0, batch, rows):
        r1 = min(batch, r0 + rows)
        x = _as_float32(x_all[r0:r1], logits.dtype)
        tok = ids_all[r0:r1].astype(np.int64)
        valid = (tok >= 0) & (tok < vocab)
        chosen = x[np.arange(r1 - r0), np.where(valid, tok, 0)]
        chosen = np.where(valid, chosen, np.float32(np.nan))
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            m = x.max(axis=1)                              # NaN in the row: m is NaN
            total = np.exp(x - m[:, None]).sum(axis=1)     # +inf in the row: inf - inf = NaN
            lse = m + np.log(total)                        # all -inf: m = -inf, NaN (as the kernel)
            logprob = chosen - lse
            rank = (x >= chosen[:, None]).sum(axis=1)
        lp_all[r0:r1] = np.where(valid, logprob, np.float32(np.nan))
        rank_all[r0:r1] = np.where(valid, rank, -1)


# -- GPU backend -------------------------------------------------------------------------------

def _launch_specs(logits: ArrayView, ids: ArrayView, out_lp: ArrayView, out_rank: ArrayView,
                  workspace: Optional[ArrayView], plan: LogprobRankPlan):
    """The kernel launches of one call, in order, as plain data:
    ``(jit kernel, grid, pointers, ints, constexprs, num_warps, pointer dtypes)``.

    Pointers are byte addresses (``ArrayView.ptr``). With a split, the workspace holds
    ``batch * n_split`` float32 pairs (max, sum) followed by as many int32 counts.
    """
    from .kernels.logprob_rank import (COMBINE_NUM_WARPS, COMBINE_SPLIT_BLOCK, LOGPROB_NUM_WARPS,
                                       logprob_rank_combine_kernel, logprob_rank_kernel)
    batch, vocab = logits.shape
    row_stride = logits.strides[0] if batch > 1 else 0
    split = plan.n_split > 1
    dtypes = (logits.dtype, ids.dtype, "float32", out_rank.dtype, "float32", "int32")
    if split:
        part_f = workspace.ptr
        part_i = workspace.ptr + batch * plan.n_split * 8
    else:
        part_f, part_i = out_lp.ptr, out_rank.ptr          # not dereferenced
    pointers = (logits.ptr, ids.ptr, out_lp.ptr, out_rank.ptr, part_f, part_i)
    specs = [(logprob_rank_kernel, (batch, plan.n_split, 1), pointers,
              (vocab, row_stride, plan.chunk_blocks, plan.n_split),
              {"BLOCK": plan.block, "VEC": plan.vec, "SPLIT": split, "ALIGNED": plan.aligned},
              LOGPROB_NUM_WARPS, dtypes)]
    if split:
        specs.append((logprob_rank_combine_kernel, (batch, 1, 1), pointers, (vocab, row_stride, plan.n_split),
                      {"SPLIT_BLOCK": COMBINE_SPLIT_BLOCK}, COMBINE_NUM_WARPS, dtypes))
    return specs


def _gpu_logprob_rank(logits: ArrayView, ids: ArrayView, out_lp: ArrayView, out_rank: ArrayView,
                      workspace: Optional[ArrayView], plan: LogprobRankPlan, stream: int) -> None:
    from . import _cuda
    from .kernels._compiled import compiled
    device_id = logits.device_id
    with _cuda.on_device(device_id):  # the caller's current context is restored afterwards
        for kernel, grid, pointers, ints, constexprs, num_warps, dtypes in _launch_specs(
                logits, ids, out_lp, out_rank, workspace, plan):
            compiled(kernel, device_id, dtypes, len(ints), constexprs, num_warps).launch(
                grid, stream, *pointers, *ints)


# -- public ------------------------------------------------------------------------------------

def token_logprob_rank(logits: Any, token_ids: Any, *, out_logprobs: Any, out_ranks: Any, stream: Any,
                       workspace: Any = None) -> None:
    """Write the log-probability and rank of ``token_ids[b]`` under row ``b`` of ``logits``.

    For each row ``b`` with token ``t = token_ids[b]``:

    - ``out_logprobs[b] = logits[b, t] - logsumexp(logits[b, :])`` (natural log, float32,
      accumulated in float32 from the logits converted exactly to float32);
    - ``out_ranks[b]`` = the number of vocabulary entries whose logit is greater than or equal
      to the token's own (vLLM's definition): a unique argmax has rank 1, and ties count
      against the token (two entries tied for the maximum both have rank 2).

    Special values (the same on the GPU and the CPU backend):

    - ``-inf`` logits are valid: they add nothing to the sum; a token whose logit is ``-inf``
      has logprob ``-inf`` and a rank counting every non-NaN entry.
    - A row holding a NaN or a ``+inf`` logit, or only ``-inf`` logits, has no finite
      normaliser: its logprob is NaN. Its rank is still the IEEE count (NaN entries never
      count; a token whose own logit is NaN has rank 0).
    - A token id outside ``[0, vocab)`` gives logprob NaN and rank -1. No error is raised:
      checking on the device and raising would need a host synchronisation.

    Parameters
    ----------
    logits:
        ``[batch, vocab]`` float32, bfloat16 or float16 (DLPack object or :class:`ArrayView`;
        read-only is fine), ``1 <= vocab <= 2**30``. Rows may be strided (any row stride,
        element stride 1 along the vocabulary).
    token_ids:
        ``[batch]`` or ``[batch, 1]`` int32/int64, contiguous, same device.
    out_logprobs, out_ranks:
        Caller-owned outputs, ``[batch]``, contiguous, writable, same device:
        ``out_logprobs`` float32 and ``out_ranks`` int32 or int64. Every row is written. They
        must not overlap the inputs or each other.
    stream:
        Keyword-only, required: an int CUDA stream handle or an object with
        ``__cuda_stream__``. The inputs are consumed over DLPack on this stream and the kernels
        are queued on it. For arrays in host memory the computation runs at once in numpy and
        the stream is only validated.
    workspace:
        Optional caller-owned device scratch, 1-D, contiguous, writable, 16-byte aligned, of
        at least :func:`logprob_rank_workspace_bytes` ``(batch, vocab)`` bytes (at most 6 KiB).
        With it, a small batch (``batch < SPLIT_TARGET_PROGRAMS``) spreads each row over
        several programs and merges their partial results with a second, tiny kernel; without
        it (or when that size is 0) each row is one program. Its contents are scratch; it must
        not be used by another call that may run at the same time (another stream). Ignored on
        the CPU backend.

    Blocking and ownership: on a GPU the call is stream-ordered: it queues one kernel (two when
    splitting) on ``stream`` and returns without synchronising; it allocates nothing, so it may
    be captured in a CUDA graph once the kernels are compiled (the first call for a device and
    dtype combination compiles them, host-blocking: make it before capturing). The arrays
    must stay alive until the queued work has run. On the CPU backend the call computes
    before it returns. A rejected call (any exception from validation) writes nothing.
    """
    checked = _validated(logits, token_ids, out_logprobs, out_ranks, stream, workspace)
    if checked is None:
        return
    lv, iv, lpv, rkv, wsv, plan, handle = checked
    if plan is None:
        _cpu_logprob_rank(lv, iv, lpv, rkv)
    else:
        _gpu_logprob_rank(lv, iv, lpv, rkv, wsv, plan, handle)


class BoundLogprobRank:
    """A :func:`token_logprob_rank` call whose arrays were validated and fixed by
    :func:`bind_logprob_rank`.

    ``bound(stream=s)`` queues the call on stream ``s`` and returns: one kernel launch (two when
    rows are split), no validation, no DLPack, stream-ordered, never blocking; capturable in a
    CUDA graph. On the CPU backend it computes in numpy before returning. ``views`` holds the
    validated arrays (their DLPack capsules keep the memory alive while the object lives).
    """

    __slots__ = ("_launches", "views")

    def __init__(self, launches, views):
        self._launches = launches
        self.views = views

    def release(self) -> None:
        """Drop the views and their DLPack capsules: the arrays may then be freed, and the
        caller must keep them alive while it uses this bound call (a cache keyed by address
        does). Host-only."""
        for v in self.views:
            v.keepalive = None
        self.views = ()

    def __call__(self, *, stream: Any) -> None:
        handle = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
        for launch in self._launches:
            launch(handle)


def bind_logprob_rank(logits: Any, token_ids: Any, *, out_logprobs: Any, out_ranks: Any, stream: Any,
                      workspace: Any = None) -> BoundLogprobRank:
    """Validate the arrays of a :func:`token_logprob_rank` call once and return a
    :class:`BoundLogprobRank` that repeats exactly that call.

    For loops that reuse the same buffers every step (or a cache keyed by buffer layout, as the
    torch adapter keeps): each call of the result only queues the kernels, about a tenth of
    the host time of an unbound call. Arguments and errors as :func:`token_logprob_rank`;
    ``stream`` is used for the DLPack handshake here, each call of the result names its own.
    Host-blocking only when it compiles the kernels (the first time for a device and dtype
    combination).
    """
    checked = _validated(logits, token_ids, out_logprobs, out_ranks, stream, workspace)
    if checked is None:
        return BoundLogprobRank((), ())
    lv, iv, lpv, rkv, wsv, plan, _ = checked
    views = (lv, iv, lpv, rkv) + ((wsv,) if wsv is not None else ())
    if plan is None:
        return BoundLogprobRank((lambda _stream: _cpu_logprob_rank(lv, iv, lpv, rkv),), views)
    from . import _cuda
    from .kernels._compiled import compiled
    launches = []
    with _cuda.on_device(lv.device_id):
        for kernel, grid, pointers, ints, constexprs, num_warps, dtypes in _launch_specs(
                lv, iv, lpv, rkv, wsv, plan):
            launches.append(compiled(kernel, lv.device_id, dtypes, len(ints), constexprs, num_warps).bind(
                grid, *pointers, *ints))
    return BoundLogprobRank(tuple(launches), views)


def _validated(logits, token_ids, out_logprobs, out_ranks, stream, workspace):
    """Every check of a call: ``None`` when there is nothing to compute (empty batch), else
    ``(logits, ids, out_logprobs, out_ranks, workspace, plan, stream)`` views, ``plan`` None on
    the CPU backend."""
    handle = stream_handle(stream)
    lv = _check_logits(as_view(logits, name="logits", stream=handle))
    device = lv.device
    batch, vocab = lv.shape
    iv = _check_token_ids(as_view(token_ids, name="token_ids", stream=handle), batch, device)
    lpv = as_view(out_logprobs, name="out_logprobs", stream=handle)
    check_view(lpv, name="out_logprobs", dtypes=("float32",), device=device, ndim=1, length=batch, writable=True)
    rkv = as_view(out_ranks, name="out_ranks", stream=handle)
    check_view(rkv, name="out_ranks", dtypes=RANK_DTYPES, device=device, ndim=1, length=batch, writable=True)
    _check_disjoint([("out_logprobs", lpv), ("out_ranks", rkv), ("logits", lv), ("token_ids", iv)])
    if device == CPU:
        if workspace is not None:
            _check_workspace(as_view(workspace, name="workspace", stream=handle), device, 0)
        return (lv, iv, lpv, rkv, None, None, handle) if batch else None
    if lv.device_type != "cuda":
        raise ValueError(f"logits must be in host memory or on a CUDA device (got {lv.device})")
    wsv = None
    if workspace is not None:
        need = logprob_rank_workspace_bytes(batch, vocab)
        wsv = _check_workspace(as_view(workspace, name="workspace", stream=handle), device, need)
        _check_disjoint([("workspace", wsv), ("out_logprobs", lpv), ("out_ranks", rkv), ("logits", lv),
                         ("token_ids", iv)])
    if batch == 0:
        return None
    plan = plan_logprob_rank(batch, vocab, split=wsv is not None, logits_ptr=lv.ptr,
                             row_stride=lv.strides[0], itemsize=lv.itemsize)
    return lv, iv, lpv, rkv, (wsv if plan.n_split > 1 else None), plan, handle
