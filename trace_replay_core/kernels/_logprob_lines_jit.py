"""Device helpers of the logprob chunk kernel's paths, on 16-byte lines of a block: constants, the
temperature, the online log-sum-exp of a block, the line tracking of top-k and argmax, and the
loads of rows that are not 16-byte aligned (each line read as the two aligned vectors around it,
its words shifted into place, so that every thread holds the same logits in the same registers as
in an aligned row; a row's last columns a logit per load, so that no load reads past its end)."""

from __future__ import annotations

import triton
import triton.language as tl

NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)  # a chunk of only -inf keeps a finite maximum
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def scaled(x, t, HAS_TEMP: tl.constexpr):
    """``x / t`` where there is a temperature (IEEE division, as ``logits / T`` in torch and
    numpy), else ``x``."""
    if HAS_TEMP:
        return tl.math.div_rn(x, t)
    else:
        return x


@triton.jit
def stream_load(ptr, mask):
    """Load the logits (or words) at ``ptr`` that the chunk kernel reads once, 0 where ``mask`` is
    given and false, marked evict-first in L1 and L2 (the lines are the first to go when the
    caches need room; the top-k read-back still finds its few vectors in L2 often enough)."""
    if mask is None:
        return tl.load(ptr, eviction_policy="evict_first")
    else:
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def online_update(x, m, s):
    """Fold the ``[LINES, VEC]`` block ``x`` into the per-line running max ``m`` and sum ``s``
    (an online log-sum-exp: ``m' = max(m, max(x))``, ``s' = s * exp(m - m') + sum(exp(x - m'))``).
    For 16-byte aligned rows each thread owns whole lines of ``VEC`` contiguous logits (one
    16-byte vector), so the line max and line sum stay inside the thread: no shuffles, no
    barriers (unaligned rows are shifted into the same lines first, ``SHIFT``). A NaN never
    becomes a line maximum (IEEE maxNum), but poisons the sum."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * LOG2E)  # m = m_new = +inf: NaN, as it should
    terms = tl.exp2((x - m_new[:, None]) * LOG2E)  # x = -inf: 0; x = NaN: NaN
    return m_new, s * scale + tl.sum(terms, axis=1)


@triton.jit
def track_lines(y, off, g1, g2, gab, TRACK: tl.constexpr):
    """With ``TRACK`` (top-k), fold the ``[LINES, VEC]`` block ``y`` that starts at column ``off``
    into each line's running maximum ``g1``, the block where it was first reached ``gab`` (its
    starting column) and the maximum over the line's other blocks ``g2``. A line's logits
    ``>= tau`` then lie in its vector at ``gab`` alone when ``g2 < tau`` (top-k reads back that one
    vector). Without ``TRACK``, the inputs are returned as they are."""
    if TRACK:
        bm = tl.max(y, axis=1)
        up = bm > g1
        g2 = tl.where(up, g1, tl.maximum(g2, bm))
        gab = tl.where(up, off, gab)
        g1 = tl.maximum(g1, bm)
    return g1, g2, gab


INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def argmax_lines(y, off, ag, ab):
    """Fold the ``[LINES, VEC]`` block ``y`` that starts at column ``off`` into each line's
    running maximum ``ag`` (never NaN: maxNum) and the block where it was first reached ``ab``.
    Returns ``(up, ag, ab)``, ``up`` telling the lines whose maximum grew in this block."""
    bm = tl.max(y, axis=1)
    up = bm > ag
    return up, tl.maximum(ag, bm), tl.where(up, off, ab)


@triton.jit
def argmax_chunk(row_ptr, cols, end, ag, ab, count, t, greedy, HAS_TEMP: tl.constexpr):
    """At a chunk's end, from the line tracking of :func:`argmax_lines`: the chunk's largest
    non-NaN ``y`` (-inf if none), the lowest column holding it (``INT32_MAX`` if none: every
    logit NaN), and the count the chunk stores. For a greedy row each line's ``count`` holds the
    ties at the line's own maximum, so the chunk's count is the sum over the lines that reach the
    chunk's maximum; else the plain sum. The column is found by reading back, for the lines that
    reach the maximum (usually one), the one 16-byte vector where they first reached it."""
    amax = tl.max(ag, axis=0)
    cand = ag == amax
    idx = ab[:, None] + cols
    v = scaled(tl.load(row_ptr + idx, mask=cand[:, None] & (idx < end), other=float("nan")).to(tl.float32), t, HAS_TEMP)
    acol = tl.min(tl.min(tl.where(v == amax, idx, INT32_MAX), axis=1), axis=0)
    ties = tl.sum(tl.where(cand, count, 0), axis=0)
    return amax, acol, tl.where(greedy, ties, tl.sum(count, axis=0))


@triton.jit
def _split4(v):
    """The four words of each line of ``[LINES, 4]`` words, as four ``[LINES]`` tensors (within
    each thread: a line's words are one 16-byte vector of its registers)."""
    even, odd = tl.split(v.reshape([v.shape[0], 2, 2]))  # words 0 and 2, words 1 and 3
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _pick(q, x0, x1, x2, x3):
    """``(x0, x1, x2, x3)[q]`` for a scalar ``q`` in 0..3."""
    return tl.where(q == 0, x0, tl.where(q == 1, x1, tl.where(q == 2, x2, x3)))


@triton.jit
def shift_words(va, vb, skew):
    """The ``[LINES, 4]`` words of lines that start ``skew`` bytes (even, below 16) into the
    aligned 16-byte vectors ``va``, continued in the next vectors ``vb``: a line's word ``k`` is
    bytes ``skew + 4k .. skew + 4k + 4`` of ``va`` then ``vb`` (little-endian: the logit at the
    lower address is the word's lower half, as in an aligned row)."""
    a0, a1, a2, a3 = _split4(va)
    b0, b1, b2, b3 = _split4(vb)
    q = skew // 4
    e0 = _pick(q, a0, a1, a2, a3).to(tl.uint32, bitcast=True)
    e1 = _pick(q, a1, a2, a3, b0).to(tl.uint32, bitcast=True)
    e2 = _pick(q, a2, a3, b0, b1).to(tl.uint32, bitcast=True)
    e3 = _pick(q, a3, b0, b1, b2).to(tl.uint32, bitcast=True)
    if skew % 4 != 0:  # the line starts in the upper half of a word: funnel each pair by 16 bits
        e4 = _pick(q, b0, b1, b2, b3).to(tl.uint32, bitcast=True)
        e0 = (e0 >> 16) | (e1 << 16)
        e1 = (e1 >> 16) | (e2 << 16)
        e2 = (e2 >> 16) | (e3 << 16)
        e3 = (e3 >> 16) | (e4 << 16)
    w = tl.join(tl.join(e0, e2), tl.join(e1, e3)).reshape([va.shape[0], 4])
    return w.to(tl.int32, bitcast=True)


@triton.jit
def line_values(w, ELEM: tl.constexpr):
    """The logits of ``[LINES, 4]`` 32-bit words (each line one 16-byte vector) of elements of
    type ``ELEM``, as ``[LINES, 16 // itemsize]`` float32 in column order (exact)."""
    if ELEM == tl.float32:
        return w.to(tl.float32, bitcast=True)
    else:
        if ELEM == tl.bfloat16:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.join(lo, hi).reshape([w.shape[0], 8])


@triton.jit
def shifted_block(words, wcols, off_w, mask, skew, row_words, MASKED: tl.constexpr):
    """With ``SHIFT``: the words of the block whose first line starts ``off_w`` words (plus
    ``skew`` bytes) past the aligned ``words``. Where ``MASKED``, ``mask`` (the same along each
    line) selects the lines to read (else all). Every line read must lie whole inside the row;
    its second vector is read only where it lies whole before ``row_words`` (the row's last
    16-byte boundary, in words past ``words``): no load reaches past the row's end. A line that
    needs bytes beyond that boundary does not take this path (the chunk kernel reads the row's
    last columns a logit at a time: its ``full_end``)."""
    lines = tl.arange(0, wcols.shape[0])[:, None] * 4  # each line's first word
    inside = off_w + lines + 8 <= row_words
    if MASKED:
        va = tl.load(words + off_w + wcols, mask=mask, other=0)
        vb = tl.load(words + off_w + wcols + 4, mask=mask & inside, other=0)
    else:
        va = tl.load(words + off_w + wcols)
        vb = tl.load(words + off_w + wcols + 4, mask=inside, other=0)
    return shift_words(va, vb, skew)


@triton.jit
def _exact_word(row_ptr, first, k, end, ITEMSIZE: tl.constexpr):
    """Word ``k`` of each line whose first column is ``first``: its logits loaded one at a time,
    masked at ``end`` (zero bits past it)."""
    if ITEMSIZE == 4:
        c = first + k
        return tl.load(row_ptr + c, mask=c < end, other=0).to(tl.int32, bitcast=True)
    else:
        c = first + 2 * k
        lo = tl.load(row_ptr + c, mask=c < end, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi = tl.load(row_ptr + c + 1, mask=c + 1 < end, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (lo | (hi << 16)).to(tl.int32, bitcast=True)


@triton.jit
def exact_words(row_ptr, off, end, LINES: tl.constexpr, ITEMSIZE: tl.constexpr):
    """With ``SHIFT``: the ``[LINES, 4]`` words of the block at column ``off`` as
    :func:`shifted_block` lays them out (each line's four words in its registers), from one load
    per logit masked at ``end`` (zero bits past it): for the row's last columns, where a vector
    load would read past the row's end."""
    first = off + tl.arange(0, LINES) * (16 // ITEMSIZE)  # each line's first column
    w0 = _exact_word(row_ptr, first, 0, end, ITEMSIZE)
    w1 = _exact_word(row_ptr, first, 1, end, ITEMSIZE)
    w2 = _exact_word(row_ptr, first, 2, end, ITEMSIZE)
    w3 = _exact_word(row_ptr, first, 3, end, ITEMSIZE)
    return tl.join(tl.join(w0, w2), tl.join(w1, w3)).reshape([LINES, 4])
