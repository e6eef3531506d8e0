"""A chunk's partial in the logprob chunk kernel (:mod:`._logprob_rank_jit`): max, sum of
``exp(y - max)``, count of ``y >= y[token]``, with ``ARGMAX`` greedy maximum and lowest column, with
``ENTROPY`` the sum of ``exp(y - max) * (y - max)``, from ``[LINES, VEC]`` blocks of 16-byte lines,
a line per thread with its own running values (no shuffles per block; the reductions:
:mod:`._logprob_online_jit`). The element path (:func:`chunk_safe`; every dtype, bfloat16 with a
temperature): ``exp2((y - m) * log2(e))``, exact for any finite logits. The fused path
(:func:`chunk_lines_fast`; bfloat16 without a temperature): words of two logits, one fused
multiply-add per exponent (line maxima clamped to ``+-TAME``; a chunk beyond it is flagged for the
merge to sum again), one packed ``bf16x2`` compare per word for the rank. Rows not 16-byte aligned
(``SHIFT``) read each line as the two aligned vectors around it, shifted into place, and their last
columns a logit per load: an aligned row's registers, instructions and bits, no load past the row."""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_online_jit import NEG_FLT_MAX, fold_fast, fold_lines, online_fast, online_update

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def scaled(x, t, HAS_TEMP: tl.constexpr):
    """``x / t`` with a temperature (IEEE division, as ``logits / T`` in torch and numpy)."""
    return tl.math.div_rn(x, t) if HAS_TEMP else x


@triton.jit
def stream_load(ptr, mask):
    """Logits (or words) read once: evict-first in L1 and L2 (0 where ``mask`` is false)."""
    if mask is None:
        return tl.load(ptr, eviction_policy="evict_first")
    else:
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def track_lines(y, off, g1, g2, gab, TRACK: tl.constexpr):
    """With ``TRACK`` (top-k): each line's maximum ``g1``, its block ``gab``, other blocks' ``g2``."""
    if TRACK:
        bm = tl.max(y, axis=1)
        up = bm > g1
        g2 = tl.where(up, g1, tl.maximum(g2, bm))
        gab = tl.where(up, off, gab)
        g1 = tl.maximum(g1, bm)
    return g1, g2, gab


@triton.jit
def argmax_lines(y, off, ag, ab):
    """Each line's running maximum ``ag`` (never NaN), the block ``ab`` where first reached, ``up``."""
    bm = tl.max(y, axis=1)
    up = bm > ag
    return up, tl.maximum(ag, bm), tl.where(up, off, ab)


@triton.jit
def argmax_chunk(row_ptr, cols, end, ag, ab, count, t, greedy, HAS_TEMP: tl.constexpr):
    """A chunk's greedy maximum, its lowest column (read back from the vector where each line at it
    first reached it; ``INT32_MAX`` if all NaN) and its count (a greedy row: the ties at it)."""
    amax = tl.max(ag, axis=0)
    cand = ag == amax
    idx = ab[:, None] + cols
    v = scaled(tl.load(row_ptr + idx, mask=cand[:, None] & (idx < end), other=float("nan")).to(tl.float32), t, HAS_TEMP)
    acol = tl.min(tl.min(tl.where(v == amax, idx, INT32_MAX), axis=1), axis=0)
    ties = tl.sum(tl.where(cand, count, 0), axis=0)
    return amax, acol, tl.where(greedy, ties, tl.sum(count, axis=0))


@triton.jit
def _split4(v):
    """The four words of each line of ``[LINES, 4]`` words, as four ``[LINES]`` tensors."""
    even, odd = tl.split(v.reshape([v.shape[0], 2, 2]))  # words 0 and 2, words 1 and 3
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _pick(q, x0, x1, x2, x3):
    return tl.where(q == 0, x0, tl.where(q == 1, x1, tl.where(q == 2, x2, x3)))


@triton.jit
def shift_words(va, vb, skew):
    """The ``[LINES, 4]`` words of lines that start ``skew`` bytes (even, < 16) into the aligned
    vectors ``va`` and continue in ``vb`` (little-endian, as in an aligned row)."""
    a0, a1, a2, a3 = _split4(va)
    b0, b1, b2, b3 = _split4(vb)
    q = skew // 4
    e0 = _pick(q, a0, a1, a2, a3).to(tl.uint32, bitcast=True)
    e1 = _pick(q, a1, a2, a3, b0).to(tl.uint32, bitcast=True)
    e2 = _pick(q, a2, a3, b0, b1).to(tl.uint32, bitcast=True)
    e3 = _pick(q, a3, b0, b1, b2).to(tl.uint32, bitcast=True)
    if skew % 4 != 0:  # the line starts in a word's upper half: funnel each pair by 16 bits
        e4 = _pick(q, b0, b1, b2, b3).to(tl.uint32, bitcast=True)
        e0 = (e0 >> 16) | (e1 << 16)
        e1 = (e1 >> 16) | (e2 << 16)
        e2 = (e2 >> 16) | (e3 << 16)
        e3 = (e3 >> 16) | (e4 << 16)
    w = tl.join(tl.join(e0, e2), tl.join(e1, e3)).reshape([va.shape[0], 4])
    return w.to(tl.int32, bitcast=True)


@triton.jit
def line_values(w, ELEM: tl.constexpr):
    """The logits of ``[LINES, 4]`` words of ``ELEM`` elements as float32, in column order."""
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
    """The shifted words of the block whose first line starts ``off_w`` words (plus ``skew`` bytes)
    past ``words``; lines where ``mask`` (if ``MASKED``). A second vector is read only where it
    lies whole before ``row_words``, the row's last 16-byte boundary: no load past the row."""
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
    """The block at column ``off`` laid out as :func:`shifted_block` lays it out, from one load
    per logit masked at ``end`` (zero bits past it): a row's last columns."""
    first = off + tl.arange(0, LINES) * (16 // ITEMSIZE)  # each line's first column
    w0 = _exact_word(row_ptr, first, 0, end, ITEMSIZE)
    w1 = _exact_word(row_ptr, first, 1, end, ITEMSIZE)
    w2 = _exact_word(row_ptr, first, 2, end, ITEMSIZE)
    w3 = _exact_word(row_ptr, first, 3, end, ITEMSIZE)
    return tl.join(tl.join(w0, w2), tl.join(w1, w3)).reshape([LINES, 4])


@triton.jit
def _ge_masks(w, chosen_w):
    """Per word of two bfloat16 logits, ``0xFFFF`` in each half ``>=`` the token's (NaN: 0)."""
    return tl.inline_asm_elementwise(
        "set.ge.u32.bf16x2 $0, $1, $2;", "=r,r,r", [w, chosen_w], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def _whole_block(words, wcols, at, words_in, skew, row_words, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """The words of block ``at`` of a chunk (zeros unless whole among its first ``words_in``)."""
    if SHIFT:
        return shifted_block(
            words, wcols, at * (BLOCK // 2), wcols + at * (BLOCK // 2) < words_in, skew, row_words, True
        )
    else:
        return stream_load(words + wcols + at * (BLOCK // 2), wcols + at * (BLOCK // 2) < words_in)


@triton.jit
def ahead_blocks(words, wcols, start, span, end, skew, row_words, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """The first two whole blocks of the chunk at ``start``, loaded ahead of its block loop (before
    the token's dependent loads, or before the previous chunk's reductions)."""
    words_in = tl.minimum(span, end - start) // BLOCK * (BLOCK // 2)  # words in the chunk's whole blocks
    chunk_words = words + start // 2
    row_words -= start // 2
    w0 = _whole_block(chunk_words, wcols, 0, words_in, skew, row_words, BLOCK, SHIFT)
    w1 = _whole_block(chunk_words, wcols, 1, words_in, skew, row_words, BLOCK, SHIFT)
    return w0, w1


@triton.jit
def _fast_block(w, off, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY):
    """Fold the whole block of words ``w`` at column ``off`` into the fused path's line states."""
    m, s, count, masks, ab, g1, g2, gab, u = st
    chosen, chosen_w, greedy = tok
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    y = tl.join(lo, hi).reshape([LINES, BLOCK // LINES])
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    if ARGMAX:  # the line maximum is m itself (from -inf, as argmax_lines wants)
        up, _, ab = argmax_lines(y, off, m, ab)
    m, s, u = online_fast(y, m, s, u, ENTROPY)
    if ARGMAX:  # a greedy row counts the ties at its line's maximum, restarted when it grows
        restart = greedy & up
        if PACKED_COUNT:
            bits = m.to(tl.uint32, bitcast=True) >> 16  # the line maximum's bfloat16 bits
            ref_w = tl.where(greedy, (bits | (bits << 16))[:, None], chosen_w)
            masks = tl.where(restart, tl.zeros_like(masks), masks) + tl.sum(_ge_masks(w, ref_w), axis=1)
        else:
            ref = tl.where(greedy, m, chosen)[:, None]
            count = tl.where(restart, 0, count) + tl.sum((lo >= ref).to(tl.int32) + (hi >= ref).to(tl.int32), axis=1)
    elif PACKED_COUNT:
        masks += tl.sum(_ge_masks(w, chosen_w), axis=1)  # wraps: decoded in chunk_lines_fast
    else:
        count += tl.sum((lo >= chosen).to(tl.int32) + (hi >= chosen).to(tl.int32), axis=1)
    return m, s, count, masks, ab, g1, g2, gab, u


@triton.jit
def _tail_fast(row_ptr, cols, off, end, chosen, greedy, st, TRACK, ARGMAX, SHIFT, ENTROPY):
    """Fold the block at ``off`` into the fused path's line states, a logit per load."""
    m, s, count, ab, g1, g2, gab, u = st
    idx = off + cols
    inside = idx < end
    if SHIFT:
        y = tl.where(inside, line_values(exact_words(row_ptr, off, end, cols.shape[0], 2), tl.bfloat16), float("-inf"))
    else:
        y = tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32)
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    if ARGMAX:
        up, _, ab = argmax_lines(y, off, m, ab)
        m, s, u = online_fast(y, m, s, u, ENTROPY)
        ref = tl.where(greedy, m, chosen)[:, None]
        count = tl.where(greedy & up, 0, count) + tl.sum(((y >= ref) & inside).to(tl.int32), axis=1)
    else:
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
        m, s, u = online_fast(y, m, s, u, ENTROPY)
    return m, s, count, ab, g1, g2, gab, u


@triton.jit
def chunk_lines_fast(lay, ahead, cols, bounds, tok, track, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, SHIFT, ENTROPY):
    """The fused path up to its line states: each line's maximum, sum, count, the block of its
    maximum (``ARGMAX``), the top-k tracking and ``u`` (``ENTROPY``); ``ahead``: the chunk's first
    two whole blocks."""
    row_ptr, words, wcols, skew, row_words = lay
    start, full_end, end = bounds
    w0, w1 = ahead
    chosen, chosen_w, greedy = tok
    g1, g2, gab = track
    m = tl.full([LINES], float("-inf"), tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES], tl.int32)
    masks = tl.zeros([LINES], tl.uint32)
    ab = tl.zeros([LINES], tl.int32) + start  # ARGMAX: the block of each line's maximum
    u = tl.zeros([LINES], tl.float32)  # ENTROPY
    n_full = (full_end - start) // BLOCK
    if n_full >= 1:
        st = (m, s, count, masks, ab, g1, g2, gab, u)
        m, s, count, masks, ab, g1, g2, gab, u = _fast_block(
            w0, start, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY
        )
    if n_full >= 2:
        st = (m, s, count, masks, ab, g1, g2, gab, u)
        m, s, count, masks, ab, g1, g2, gab, u = _fast_block(
            w1, start + BLOCK, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY
        )
    # The lower bound is clamped: a chunk of one whole block must not run an unrolled iteration.
    for off in tl.range(tl.minimum(start + 2 * BLOCK, full_end), full_end, BLOCK, loop_unroll_factor=2):
        if SHIFT:
            w = shifted_block(words, wcols, off // 2, None, skew, row_words, False)
        else:
            w = stream_load(words + off // 2 + wcols, None)
        st = (m, s, count, masks, ab, g1, g2, gab, u)
        m, s, count, masks, ab, g1, g2, gab, u = _fast_block(
            w, off, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY
        )
    if PACKED_COUNT:  # 0xFFFEFFFF inverts 0xFFFF mod 2**32 (each half counts < 2**16: the plan checks)
        packed = masks * 0xFFFEFFFF
        count += ((packed & 0xFFFF) + (packed >> 16)).to(tl.int32)
    if SHIFT:  # the row's last columns may reach into a second block (see the chunk kernel's full_end)
        for off in tl.range(full_end, end, BLOCK, loop_unroll_factor=1):
            st = (m, s, count, ab, g1, g2, gab, u)
            m, s, count, ab, g1, g2, gab, u = _tail_fast(
                row_ptr, cols, off, end, chosen, greedy, st, TRACK, ARGMAX, True, ENTROPY
            )
    elif full_end < end:
        st = (m, s, count, ab, g1, g2, gab, u)
        m, s, count, ab, g1, g2, gab, u = _tail_fast(
            row_ptr, cols, full_end, end, chosen, greedy, st, TRACK, ARGMAX, False, ENTROPY
        )
    return m, s, count, ab, g1, g2, gab, u


@triton.jit
def chunk_end_fast(row_ptr, cols, end, m, s, count, ab, greedy, u, ARGMAX: tl.constexpr, ENTROPY: tl.constexpr):
    """The fused path's chunk partial from its line states (:func:`fold_fast`)."""
    big, total, ent = fold_fast(m, s, u, ENTROPY)
    if ARGMAX:
        amax, acol, n = argmax_chunk(row_ptr, cols, end, m, ab, count, 1.0, greedy, False)
    else:
        amax, acol, n = 0.0, 0, tl.sum(count, axis=0)
    return big, total, n, amax, acol, ent


@triton.jit
def _tail_safe(row_ptr, cols, off, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, SHIFT, ENTROPY):
    """Fold the block at ``off`` into :func:`chunk_safe`'s line states, a logit per load."""
    m, s, count, ag, ab, g1, g2, gab, u = st
    idx = off + cols
    inside = idx < end
    if SHIFT:
        ELEM: tl.constexpr = row_ptr.dtype.element_ty
        y = tl.where(
            inside, line_values(exact_words(row_ptr, off, end, cols.shape[0], 16 // cols.shape[1]), ELEM), float("-inf")
        )
    else:
        y = tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32)
    y = scaled(y, t, HAS_TEMP)
    if ARGMAX:
        up, ag, ab = argmax_lines(y, off, ag, ab)
    if GREEDY:
        count = tl.where(up, 0, count) + tl.sum(((y >= ag[:, None]) & inside).to(tl.int32), axis=1)
    else:
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    m, s, u = online_update(y, m, s, u, ENTROPY)
    return m, s, count, ag, ab, g1, g2, gab, u


@triton.jit
def chunk_safe(
    lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, ARGMAX, GREEDY, SHIFT, UNROLL, ENTROPY
):
    """The element path: a chunk's partial ``(max, sum, count)``, the top-k tracking, with
    ``ARGMAX`` its greedy maximum and column (a ``GREEDY`` row counts the ties at it), with
    ``ENTROPY`` its ``u`` (:func:`fold_lines`; else 0)."""
    row_ptr, words, wcols, skew, row_words = lay
    start, full_end, end = bounds
    g1, g2, gab = track
    ELEM: tl.constexpr = row_ptr.dtype.element_ty
    PER_WORD: tl.constexpr = BLOCK // LINES // 4  # logits per 32-bit word (lines of 16 bytes)
    m = tl.full([LINES], NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES], tl.int32)
    ag = tl.full([LINES], float("-inf"), tl.float32)  # ARGMAX: the line maximum, from -inf
    ab = tl.zeros([LINES], tl.int32) + start
    u = tl.zeros([LINES], tl.float32)  # ENTROPY
    for off in tl.range(start, full_end, BLOCK, loop_unroll_factor=UNROLL):
        if SHIFT:
            y = line_values(shifted_block(words, wcols, off // PER_WORD, None, skew, row_words, False), ELEM)
        else:
            y = stream_load(row_ptr + off + cols, None).to(tl.float32)
        y = scaled(y, t, HAS_TEMP)
        g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
        m, s, u = online_update(y, m, s, u, ENTROPY)
        if ARGMAX:
            up, ag, ab = argmax_lines(y, off, ag, ab)
        if GREEDY:  # the ties at the line's maximum, restarted when it grows
            count = tl.where(up, 0, count) + tl.sum((y >= ag[:, None]).to(tl.int32), axis=1)
        else:
            count += tl.sum((y >= chosen).to(tl.int32), axis=1)
    # The partial last block (with SHIFT up to two blocks); a block of only -inf changes nothing.
    if SHIFT:
        for off in tl.range(full_end, end, BLOCK, loop_unroll_factor=1):
            st = (m, s, count, ag, ab, g1, g2, gab, u)
            m, s, count, ag, ab, g1, g2, gab, u = _tail_safe(
                row_ptr, cols, off, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, True, ENTROPY
            )
    elif full_end < end:
        st = (m, s, count, ag, ab, g1, g2, gab, u)
        m, s, count, ag, ab, g1, g2, gab, u = _tail_safe(
            row_ptr, cols, full_end, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, False, ENTROPY
        )
    big, total, ent = fold_lines(m, s, u, ENTROPY)
    if ARGMAX:
        amax, acol, n = argmax_chunk(row_ptr, cols, end, ag, ab, count, t, GREEDY, HAS_TEMP)
    else:
        amax, acol, n = 0.0, 0, tl.sum(count, axis=0)
    return big, total, n, g1, g2, gab, amax, acol, ent
