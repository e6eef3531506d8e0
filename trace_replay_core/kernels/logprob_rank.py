"""The logprob-and-rank kernels: log-softmax value and rank of one token per row, one read of the logits.

For row ``b`` with token ``t = token_ids[b]`` and logits ``x = logits[b, :vocab]`` (converted to
float32 on load; exact for bfloat16 and float16):

- ``logprob[b] = x[t] - log(sum(exp(x)))``, in float32;
- ``rank[b] = count(x >= x[t])`` (vLLM's definition: a unique argmax has rank 1, ties count
  against the token; IEEE comparisons, so NaN entries never count).

Each program reads its stretch of one row exactly once, a block of ``BLOCK`` logits per step
seen as ``[BLOCK // VEC, VEC]`` (one 16-byte vector per line, each line owned by one thread).
Per line it keeps a running maximum ``m`` and a running sum ``s`` of ``exp(x - m)`` (an online
log-sum-exp: per block, ``m' = max(m, max(x))``, ``s' = s * exp(m - m') + sum(exp(x - m'))``),
all inside the thread, so the loop has no shuffles and no barriers; and per logit a count of
``x >= x[t]``. The token's own logit is one extra scalar load per program. Lines are combined
once, at the end.

Special values fall out of the arithmetic, and the host documents them as the contract:

- a NaN or ``+inf`` anywhere in the row makes the sum NaN, so the logprob is NaN;
- ``-inf`` entries add nothing; a row of only ``-inf`` has an empty sum: ``lse = -inf`` and the
  logprob ``-inf - (-inf)`` is NaN;
- a token id outside ``[0, vocab)`` gives logprob NaN and rank -1 (a device-side check cannot
  raise without a host synchronisation).

Two launch shapes (``logprob.py`` chooses):

- ``SPLIT=False``: grid ``(batch, 1)``; each program owns a whole row and writes the results.
- ``SPLIT=True``: grid ``(batch, n_split)``; program ``(b, j)`` owns blocks
  ``[j * chunk_blocks, (j + 1) * chunk_blocks)`` of row ``b`` and writes a partial
  ``(max, sum, count)`` to a caller-provided workspace; :func:`logprob_rank_combine_kernel`
  (grid ``(batch,)``) then merges the ``n_split`` partials of each row. Used when the batch is
  too small to fill the GPU with one program per row.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "logprob_rank_kernel",
    "logprob_rank_combine_kernel",
    "LOGPROB_BLOCK",
    "LOGPROB_NUM_WARPS",
    "COMBINE_SPLIT_BLOCK",
    "COMBINE_NUM_WARPS",
]

# Logits of one row per loop iteration: 8 per thread with 16 warps, i.e. one 16-byte load per
# thread for 2-byte logits and two for float32; the loop is unrolled twice, so two blocks are in
# flight per program. Chosen by bench/logprob_tuning.py on the H200 (2026-11-30, vocab 151,936,
# device time): against the former 4096 x 8 warps, batch 256 went 26.9 -> 25.8 us (bf16) and
# 41.6 -> 39.8 us (float32), batch 64 13.3 -> 12.9 / 16.7 -> 16.5 us, batch 1024 79.2 -> 81.3 /
# 154.3 -> 145.2 us; larger blocks (8192, 16384) and 4 warps were slower at batch 256.
LOGPROB_BLOCK = 4096
LOGPROB_NUM_WARPS = 16
# The combine kernel reduces at most this many partials per row (the most splits planned).
COMBINE_SPLIT_BLOCK = 256
COMBINE_NUM_WARPS = 4

# A finite "minus infinity" for the running maximum: x - m stays a number for x = -inf
# (-inf - (-FLT_MAX) = -inf, exp -> 0), so -inf entries and masked-off logits add exactly nothing,
# and a line that has seen only -inf keeps s = 0.
_NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _online_update(x, m, s):
    """Fold the ``[LINES, VEC]`` block ``x`` into the per-line running max ``m`` and sum ``s``.

    Each thread owns whole lines of ``VEC`` contiguous logits (one 16-byte vector), so the
    line max and line sum below stay inside the thread: no shuffles, no barriers.
    """
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * _LOG2E)                 # m = m_new = +inf: NaN, as it should
    terms = tl.exp2((x - m_new[:, None]) * _LOG2E)        # x = -inf: 0; x = NaN: NaN
    return m_new, s * scale + tl.sum(terms, axis=1)


@triton.jit
def _merge(m, s):
    """Return (max, sum of exp(. - max)) over all lines (or partials) ``m``/``s``.

    A line whose max is +inf gives exp(inf - inf) = NaN: a row holding +inf has NaN logprob.
    """
    big = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2((m - big) * _LOG2E), axis=0)
    return big, total


@triton.jit
def _chosen_logit(row_ptr, ids_ptr, row, vocab):
    """Load the row's token id and its logit; (valid, logit) with logit NaN for an invalid id."""
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)
    chosen = tl.load(row_ptr + tl.where(valid, token, 0)).to(tl.float32)
    chosen = tl.where(valid, chosen, float("nan"))
    return valid, chosen


@triton.jit
def _store_result(logprob_ptr, rank_ptr, row, valid, chosen, big, total, count):
    lse = big + tl.log(total)                   # total == 0 only for an all -inf row: lse = -inf
    logprob = tl.where(valid, chosen - lse, float("nan"))
    rank = tl.where(valid, count, -1)
    tl.store(logprob_ptr + row, logprob)
    tl.store(rank_ptr + row, rank.to(rank_ptr.dtype.element_ty))


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "chunk_blocks", "n_split"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "logprob_ptr", "rank_ptr", "part_f_ptr",
                                    "part_i_ptr"],
)
def logprob_rank_kernel(
    logits_ptr,         # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,            # [batch] int32/int64 token per row
    logprob_ptr,        # [batch] float32 out (unused when SPLIT)
    rank_ptr,           # [batch] int32/int64 out (unused when SPLIT)
    part_f_ptr,         # SPLIT: [batch * n_split, 2] float32 partial (max, sum) out
    part_i_ptr,         # SPLIT: [batch * n_split] int32 partial count out
    vocab,
    row_stride,         # elements between rows
    chunk_blocks,       # BLOCKs of a row per program
    n_split,            # programs per row (grid axis 1)
    BLOCK: tl.constexpr,    # logits per loop iteration
    VEC: tl.constexpr,      # logits per 16-byte vector (8 for 2-byte dtypes, 4 for float32)
    SPLIT: tl.constexpr,
    ALIGNED: tl.constexpr,  # logits_ptr and row_stride * itemsize are multiples of 16 bytes
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    if ALIGNED:
        row_ptr = tl.multiple_of(row_ptr, 16)
    valid, chosen = _chosen_logit(row_ptr, ids_ptr, row, vocab)

    start = split * (chunk_blocks * BLOCK)
    n_here = tl.minimum(chunk_blocks * BLOCK, vocab - start)
    full_end = start + (n_here // BLOCK) * BLOCK
    end = start + n_here
    LINES: tl.constexpr = BLOCK // VEC
    cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m = tl.full([LINES], _NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES, VEC], tl.int32)
    # Whole blocks: unmasked (16-byte vector loads when ALIGNED).
    for off in tl.range(start, full_end, BLOCK, loop_unroll_factor=2):
        x = tl.load(row_ptr + off + cols).to(tl.float32)
        count += (x >= chosen).to(tl.int32)
        m, s = _online_update(x, m, s)
    # The partial last block (all masked off when there is none).
    idx = full_end + cols
    inside = idx < end
    x = tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32)
    count += ((x >= chosen) & inside).to(tl.int32)
    m, s = _online_update(x, m, s)

    big, total = _merge(m, s)
    n_ge = tl.sum(tl.sum(count, axis=1), axis=0)
    if SPLIT:
        part = row.to(tl.int64) * n_split + split
        tl.store(part_f_ptr + 2 * part, big)
        tl.store(part_f_ptr + 2 * part + 1, total)
        tl.store(part_i_ptr + part, n_ge)
    else:
        _store_result(logprob_ptr, rank_ptr, row, valid, chosen, big, total, n_ge)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_split"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "logprob_ptr", "rank_ptr", "part_f_ptr",
                                    "part_i_ptr"],
)
def logprob_rank_combine_kernel(
    logits_ptr,         # as in logprob_rank_kernel (only the token's own logit is read)
    ids_ptr,
    logprob_ptr,        # [batch] float32 out
    rank_ptr,           # [batch] int32/int64 out
    part_f_ptr,         # [batch * n_split, 2] float32 partial (max, sum)
    part_i_ptr,         # [batch * n_split] int32 partial count
    vocab,
    row_stride,
    n_split,
    SPLIT_BLOCK: tl.constexpr,  # >= n_split, a power of two
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    valid, chosen = _chosen_logit(row_ptr, ids_ptr, row, vocab)
    j = tl.arange(0, SPLIT_BLOCK)
    inside = j < n_split
    part = row.to(tl.int64) * n_split + j
    m = tl.load(part_f_ptr + 2 * part, mask=inside, other=_NEG_FLT_MAX)
    s = tl.load(part_f_ptr + 2 * part + 1, mask=inside, other=0.0)
    count = tl.load(part_i_ptr + part, mask=inside, other=0)
    big, total = _merge(m, s)
    _store_result(logprob_ptr, rank_ptr, row, valid, chosen, big, total, tl.sum(count, axis=0))
