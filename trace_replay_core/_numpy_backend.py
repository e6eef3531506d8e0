"""The numpy backend: the numpy twin of every op, and the trace table in host memory.

Used when a table is created with ``device="cpu"`` (a machine without a GPU, or arrays that
live in host memory) and by :func:`~trace_replay_core.token_logprob_rank` for host arrays.
Every call completes before it returns: there is no stream to order against (the ``stream``
a caller passes is validated and otherwise unused). The semantics are the kernels', op by op:

- :func:`replay_numpy` is :mod:`.kernels.replay`;
- :meth:`NumpyTable.commit` is :mod:`.kernels.scatter` applied to what is staged;
- the logprob-and-rank twin is :mod:`.kernels.logprob_rank`'s.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ._dlpack import ArrayView, without_capsules
from ._staging import copy_trace

__all__ = ["NumpyTable", "numpy_of", "replay_numpy", "temperature_or_nan"]


def numpy_of(view: ArrayView) -> np.ndarray:
    """A numpy array over a contiguous CPU view's memory (no copy; writes go to the producer)."""
    if view.size == 0:
        return np.empty(view.shape, dtype=view.dtype)
    nbytes = view.size * view.itemsize
    buf = (ctypes.c_char * nbytes).from_address(view.ptr)
    # A ctypes array is a buffer; numpy's stubs do not say so. A memoryview around it would cost
    # a microsecond per array on every replay of the CPU backend.
    return np.frombuffer(buf, dtype=view.dtype).reshape(view.shape)  # type: ignore[call-overload]


def replay_numpy(
    out: np.ndarray,
    slot: np.ndarray,
    table: np.ndarray,
    trace_len: np.ndarray,
    total: np.ndarray | None,
    prompt: np.ndarray | None,
    step: np.ndarray | None,
) -> None:
    """The replay kernel in numpy: write the trace token of each active row into ``out`` (1-D,
    in place). ``slot``: per-row slots; the step per slot from ``total - prompt``, or per row
    from ``step`` (the other two ``None``), as in :mod:`.kernels.replay`."""
    slot = slot.astype(np.int64)
    active = (slot >= 0) & (slot < table.shape[0])
    s = np.where(active, slot, 0)
    n = trace_len[s].astype(np.int64)
    if step is not None:
        at = step.astype(np.int64)
    else:
        assert total is not None and prompt is not None  # check_replay gives both without a step
        at = total[s].astype(np.int64) - prompt[s].astype(np.int64)
    active &= (n > 0) & (at >= 0) & (at < n)
    rows = np.nonzero(active)[0]
    out[rows] = table[s[rows], at[rows]].astype(out.dtype)


class NumpyTable:
    """The table of the numpy backend: ``[max_slots, max_trace_len]`` int32 and the trace
    lengths, in host memory it owns. Not thread-safe on its own: :class:`~._table.TraceTable`
    serialises staging and commits with its lock."""

    def __init__(self, max_slots: int, max_trace_len: int):
        self.table = np.zeros((max_slots, max_trace_len), dtype=np.int32)
        self.trace_len = np.zeros(max_slots, dtype=np.int32)
        self._staged: dict[int, np.ndarray | None] = {}

    # staging -------------------------------------------------------------------------------
    def stage(self, slot: int, tokens: np.ndarray, vocab_size: int | None) -> None:
        """Copy ``tokens`` (a :func:`~._validate.trace_array` result) and check its ids in one
        pass; the copy becomes the staged trace of ``slot`` only if they pass (else this raises)."""
        staged = np.empty(tokens.shape[0], dtype=np.uint32)
        copy_trace(tokens, staged, vocab_size=vocab_size)
        self._staged[slot] = staged.view(np.int32)

    def stage_many(self, slots: list[int], traces, vocab_size: int | None) -> None:
        """``stage`` for each pair in order, recorded only once every trace has passed; a 2-D
        block is copied and checked in one pass."""
        if isinstance(traces, np.ndarray):
            block = np.empty(traces.shape, dtype=np.uint32)
            copy_trace(traces, block, vocab_size=vocab_size, name="traces")
            rows = block.view(np.int32)
            staged: list[np.ndarray] = [rows[i] for i in range(rows.shape[0])]
        else:
            staged = []
            for i, tokens in enumerate(traces):
                out = np.empty(tokens.shape[0], dtype=np.uint32)
                copy_trace(tokens, out, vocab_size=vocab_size, name=f"traces[{i}]")
                staged.append(out.view(np.int32))
        self._staged.update(zip(slots, staged))

    def clear(self, slot: int) -> None:
        self._staged[slot] = None

    def pending(self) -> int:
        return len(self._staged)

    def commit(self, stream: int) -> None:
        for slot, tokens in self._staged.items():
            if tokens is None:
                self.trace_len[slot] = 0
            else:
                self.table[slot, : tokens.shape[0]] = tokens
                self.trace_len[slot] = tokens.shape[0]
        self._staged.clear()

    # replay --------------------------------------------------------------------------------
    def bind(
        self,
        sampled: ArrayView,
        idx: ArrayView,
        total: ArrayView | None,
        prompt: ArrayView | None,
        step: ArrayView | None,
    ):
        # Pointers only (views without capsules): a released bound replay lets the arrays go.
        sampled, idx, total, prompt, step = without_capsules((sampled, idx, total, prompt, step))

        def launch(stream: int) -> None:
            self.replay(sampled, idx, total, prompt, step, stream)

        return launch

    def replay(
        self,
        sampled: ArrayView,
        idx: ArrayView,
        total: ArrayView | None,
        prompt: ArrayView | None,
        step: ArrayView | None,
        stream: int,
    ) -> None:
        replay_numpy(
            numpy_of(sampled).reshape(-1),
            numpy_of(idx),
            self.table,
            self.trace_len,
            None if total is None else numpy_of(total),
            None if prompt is None else numpy_of(prompt),
            None if step is None else numpy_of(step),
        )

    # inspection ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        return None

    def device_views(self):
        def view(a):
            return ArrayView(
                a.ctypes.data, a.shape, tuple(x // a.itemsize for x in a.strides), "int32", "cpu", 0, keepalive=a
            )

        return view(self.table), view(self.trace_len)

    def snapshot(self):
        return self.table.copy(), self.trace_len.copy()

    def close(self) -> None:
        self._staged.clear()


# -- logprob and rank ----------------------------------------------------------------------------
# The numpy twin of kernels/logprob_rank.py: the same contract, float32 arithmetic, row by row
# (every row's result depends on that row alone, whatever the batch).

_LOGPROB_ROWS_ELEMENTS = 1 << 22  # logits converted to float32 per chunk of rows (16 MiB)
_KEY_PAD = np.int64(-(2**63))


def _strided_numpy(v: ArrayView, writable: bool = False) -> np.ndarray:
    """A numpy view over a CPU view's memory, strides kept (bfloat16 as uint16 bits), read-only
    unless ``writable``."""
    np_dtype = np.uint16 if v.dtype == "bfloat16" else np.dtype(v.dtype)
    if v.size == 0:
        return np.empty(v.shape, dtype=np_dtype)
    nbytes = (sum((n - 1) * s for n, s in zip(v.shape, v.strides)) + 1) * v.itemsize
    base = np.frombuffer(memoryview((ctypes.c_char * nbytes).from_address(v.ptr)).cast("B"), dtype=np_dtype)
    return np.lib.stride_tricks.as_strided(
        base, shape=v.shape, strides=[s * v.itemsize for s in v.strides], writeable=writable
    )


def _logits_float32(block: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32)


def temperature_or_nan(t: np.ndarray) -> np.ndarray:
    """float32 ``t`` with every value that is not finite and > 0 replaced by NaN: such a row reads
    as a row of NaN logits (the kernels do the same)."""
    t = np.asarray(t, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(t) & (t > 0), t, np.float32(np.nan)).astype(np.float32)


def topk_keys(y: np.ndarray) -> np.ndarray:
    """The kernel's 64-bit top-k keys of float32 ``y [rows, vocab]``: value descending, then
    column ascending; NaN gets the smallest key; -0.0 is keyed as +0.0."""
    b = np.where(y == 0, np.float32(0), y).view(np.int32)
    o = b ^ ((b >> 31) & np.int32(0x7FFFFFFF))
    low = (~np.arange(y.shape[1], dtype=np.int32)).view(np.uint32).astype(np.int64)
    return np.where(np.isnan(y), _KEY_PAD, (o.astype(np.int64) << 32) | low)


def topk_decode(keys: np.ndarray):
    """(float32 values, int64 columns) of keys; the padding key gives column -1."""
    o = (keys >> 32).astype(np.int32)
    values = (o ^ ((o >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)
    return values, (~keys.astype(np.int32)).astype(np.int64)


def logprob_rank_numpy(
    logits: ArrayView,
    ids: ArrayView,
    temperature: ArrayView | None,
    out_lp: ArrayView,
    out_rank: ArrayView,
    topk_lp: ArrayView | None,
    topk_ids: ArrayView | None,
    top_k: int,
    out_argmax: ArrayView | None = None,
    out_entropy: ArrayView | None = None,
) -> None:
    """``token_logprob_rank`` on host arrays (already validated), computed before it returns."""
    x_all = _strided_numpy(logits)
    ids_all = numpy_of(ids).reshape(-1)
    t_all = temperature_or_nan(numpy_of(temperature)) if temperature is not None else None
    lp_all, rank_all = numpy_of(out_lp), numpy_of(out_rank)
    tlp_all = numpy_of(topk_lp) if top_k and topk_lp is not None else None
    tid_all = numpy_of(topk_ids) if top_k and topk_ids is not None else None
    am_all = numpy_of(out_argmax) if out_argmax is not None else None
    ent_all = numpy_of(out_entropy) if out_entropy is not None else None
    batch, vocab = logits.shape
    rows = max(1, _LOGPROB_ROWS_ELEMENTS // vocab)
    for r0 in range(0, batch, rows):
        r1 = min(batch, r0 + rows)
        y = _logits_float32(x_all[r0:r1], logits.dtype)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if t_all is not None:
                y = y / t_all[r0:r1, None]
            tok = ids_all[r0:r1].astype(np.int64)
            m = np.max(y, axis=1, initial=-np.inf, where=~np.isnan(y))  # NaN skipped: it poisons the sum
            if am_all is not None:  # the lowest id of the largest non-NaN y (all NaN: 0)
                greedy = np.argmax(y == m[:, None], axis=1)
                am_all[r0:r1] = greedy
                tok = np.where(tok < 0, greedy, tok)  # negative ids are scored as the greedy token
            valid = (tok >= 0) & (tok < vocab)
            chosen = np.where(valid, y[np.arange(r1 - r0), np.where(valid, tok, 0)], np.float32(np.nan))
            m_safe = np.where(m == -np.inf, np.float32(0), m).astype(np.float32)
            d = y - m_safe[:, None]
            e = np.exp(d)
            total = e.sum(axis=1)  # NaN or +inf in the row: NaN
            lse = (m + np.log(total)).astype(np.float32)  # all -inf: -inf (NaN logprob)
            if ent_all is not None:  # log(S) - U / S; a term whose exp is 0 adds 0; all -inf: 0 / 0
                u = np.where(e == 0, np.float32(0), e * d).sum(axis=1)
                ent_all[r0:r1] = np.log(total) - u / total
            lp_all[r0:r1] = np.where(valid, chosen - lse, np.float32(np.nan))
            rank_all[r0:r1] = np.where(valid, (y >= chosen[:, None]).sum(axis=1), -1)
            if top_k and tlp_all is not None and tid_all is not None:
                keys = topk_keys(y)
                best = np.sort(np.partition(keys, vocab - top_k, axis=1)[:, vocab - top_k :], axis=1)[:, ::-1]
                values, cols = topk_decode(best)
                tlp_all[r0:r1] = np.where(cols < 0, np.float32(np.nan), values - lse[:, None])
                tid_all[r0:r1] = cols


# -- the logprob op's backward -------------------------------------------------------------------
# The numpy twin of kernels/logprob_backward.py: the same contract (lse recovered from the
# forward's outputs, the same rows reduced again, zeros and NaN), float32 arithmetic, row by row.


def _store_as(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to ``dtype`` (to nearest even), as the bits the array holds
    (bfloat16 as uint16)."""
    if dtype != "bfloat16":
        return values.astype(dtype)
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def logprob_backward_numpy(
    logits: ArrayView, ids: ArrayView, argmax, temperature, logprobs: ArrayView, grad_lp, topk_ids, topk_lp, grad_topk,
    entropy, grad_entropy, out_grad: ArrayView, out_grad_t,
) -> None:  # fmt: skip
    """``token_logprob_rank_backward`` on host arrays (already validated; absent ones None),
    computed before it returns."""
    x_all = _strided_numpy(logits)
    g_out = _strided_numpy(out_grad, writable=True)
    batch, vocab = logits.shape
    rows = max(1, _LOGPROB_ROWS_ELEMENTS // vocab)

    def part(v, r0, r1):
        return None if v is None else numpy_of(v)[r0:r1]

    for r0 in range(0, batch, rows):
        r1 = min(batch, r0 + rows)
        n, at = r1 - r0, np.arange(r1 - r0)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            t = temperature_or_nan(part(temperature, r0, r1)) if temperature is not None else np.ones(n, np.float32)
            y = _logits_float32(x_all[r0:r1], logits.dtype) / t[:, None]
            tok = part(ids, r0, r1).reshape(-1).astype(np.int64)
            if argmax is not None:
                tok = np.where(tok < 0, part(argmax, r0, r1).astype(np.int64), tok)
            valid = (tok >= 0) & (tok < vocab)
            lse = np.where(valid, y[at, np.where(valid, tok, 0)] - part(logprobs, r0, r1), np.float32(np.nan))
            ids_q = np.where(valid, tok, -1)[:, None]
            g_q = np.zeros((n, 1), np.float32)
            if grad_lp is not None:
                g_q[:, 0] = np.where(valid, part(grad_lp, r0, r1), np.float32(0))
            if topk_ids is not None:
                tk = part(topk_ids, r0, r1).astype(np.int64)
                lse0 = y[at, np.maximum(tk[:, 0], 0)] - part(topk_lp, r0, r1)[:, 0]
                lse = np.where((tk[:, 0] >= 0) & np.isfinite(lse0), lse0, lse)
                gk = part(grad_topk, r0, r1) if grad_topk is not None else np.zeros(tk.shape, np.float32)
                ids_q = np.concatenate([ids_q, tk], axis=1)
                g_q = np.concatenate([g_q, np.where(tk >= 0, gk, np.float32(0))], axis=1)
            need = valid & (grad_lp is not None) | (grad_topk is not None) | (grad_entropy is not None) | np.isnan(t)
            redo = np.flatnonzero(need & ~np.isnan(t) & ~np.isfinite(lse))
            if redo.size:  # no finite source: reduce the row again (NaN for NaN or +inf, -inf for all -inf)
                yr = y[redo]
                m = np.max(yr, axis=1)
                m_safe = np.where(m == -np.inf, np.float32(0), m)
                lse[redo] = m + np.log(np.exp(yr - m_safe[:, None]).sum(axis=1))
            lp_all = y - lse[:, None].astype(np.float32)
            p = np.exp(lp_all)
            g_all = g_q.sum(axis=1, dtype=np.float32)
            dy = -p * g_all[:, None]
            if grad_entropy is not None:
                h, g_h = part(entropy, r0, r1), part(grad_entropy, r0, r1)
                dy -= np.where(p == 0, np.float32(0), g_h[:, None] * p * (lp_all + h[:, None]))  # -inf: adds 0
            dy = np.where(need[:, None], dy, np.float32(0)).astype(np.float32)
            acc = np.where(dy != 0, dy * lp_all, np.float32(0)).sum(axis=1, dtype=np.float32)
            here = (ids_q >= 0) & need[:, None] & (g_q != 0)
            rr, cc = np.nonzero(here)
            np.add.at(dy, (rr, ids_q[rr, cc]), g_q[rr, cc])
            acc += np.where(here, g_q * lp_all[at[:, None], np.maximum(ids_q, 0)], np.float32(0)).sum(axis=1)
            g_out[r0:r1, :vocab] = _store_as(dy / t[:, None], logits.dtype)
            if out_grad_t is not None:
                numpy_of(out_grad_t)[r0:r1] = -acc / t
