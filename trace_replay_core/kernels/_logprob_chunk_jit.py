"""A chunk's partial for the logprob chunk kernel (:mod:`._logprob_rank_jit`), from ``[LINES, VEC]``
blocks: a 16-byte line per thread with its own running values, folded at the chunk's end. The
element path (:func:`chunk_safe`) is exact for any finite logits; the fused path
(:func:`chunk_lines_fast`, bfloat16 without a temperature) spends one multiply-add per exponent
against line maxima clamped to ``+-TAME`` (a chunk beyond is flagged for the merge to redo) and one
packed compare per word of two logits. Rows not 16-byte aligned read each line from the two aligned
vectors around it: an aligned row's bits, no load past the row. Entropy: ``u``, the sum of
``exp(y - m) * (y - m)``, moves to a new maximum ``m'`` as ``u' = c * (u + (m - m') * s)``, ``s``
as ``s' = c * s`` (``c = exp(m - m')``); a row's entropy is ``log(S) - U / S``, two terms >= 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)  # the element path's start: a chunk of -inf stays finite
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
TAME = tl.constexpr(2.0**20)  # the fused path clamps line maxima to +-TAME; a chunk beyond it is flagged
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def scaled(x, t, HAS_TEMP: tl.constexpr):
    """``x / t`` with a temperature (IEEE division, as ``logits / T`` in torch and numpy)."""
    return tl.math.div_rn(x, t) if HAS_TEMP else x


@triton.jit
def _fma_pairs(acc, t, d):
    t0, t1 = tl.split(t)
    d0, d1 = tl.split(d)
    return tl.fma(t1, d1, tl.fma(t0, d0, acc))


@triton.jit
def entropy_fold(u, s, shift, c, d, terms, SAFE: tl.constexpr):
    """Each line's ``c * (u + shift * s) + sum(terms * max(d, -FLT_MAX))`` (``SAFE``: 0 where ``c = 0``)."""
    if SAFE:
        kept = tl.where(c == 0, 0.0, c * (u + shift * s))
    else:
        kept = c * (u + shift * s)
    d = tl.maximum(d, NEG_FLT_MAX)
    te, to = tl.split(terms.reshape([terms.shape[0], terms.shape[1] // 2, 2]))  # even, odd columns
    de, do = tl.split(d.reshape([d.shape[0], d.shape[1] // 2, 2]))
    if terms.shape[1] == 8:
        tee, teo = tl.split(te.reshape([te.shape[0], 2, 2]))
        dee, deo = tl.split(de.reshape([de.shape[0], 2, 2]))
        toe, too = tl.split(to.reshape([to.shape[0], 2, 2]))
        doe, doo = tl.split(do.reshape([do.shape[0], 2, 2]))
        kept = _fma_pairs(_fma_pairs(kept, tee, dee), teo, deo)
        return _fma_pairs(_fma_pairs(kept, toe, doe), too, doo)
    else:
        return _fma_pairs(_fma_pairs(kept, te, de), to, do)


@triton.jit
def entropy_sum(u, s, shift, f):
    """``sum(f * (u + shift * s))`` over lines or chunks, ``f = exp(shift)`` (a zero ``f`` adds 0)."""
    return tl.sum(tl.where(f == 0, 0.0, f * (u + shift * s)), axis=0)


@triton.jit
def online_update(x, m, s, u, ENTROPY: tl.constexpr):
    """Fold the block ``x`` into each line's max ``m``, sum ``s`` and ``u`` (a NaN poisons the sum)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * LOG2E)  # m = m_new = +inf: NaN, as it should
    d = x - m_new[:, None]
    terms = tl.exp2(d * LOG2E)  # x = -inf: 0; x = NaN: NaN
    if ENTROPY:
        u = entropy_fold(u, s, m - m_new, scale, d, terms, True)
    return m_new, s * scale + tl.sum(terms, axis=1), u


@triton.jit
def fold_lines(m, s, u, ENTROPY: tl.constexpr):
    big = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2((m - big) * LOG2E), axis=0)
    if ENTROPY:
        ent = entropy_sum(u, s, m - big, tl.exp2((m - big) * LOG2E))
    else:
        ent = 0.0
    return big, total, ent


@triton.jit
def _mc(m):
    """A fused line's offset ``m * log2(e)``, ``m`` clamped to ``+-TAME`` (so no term overflows)."""
    return tl.minimum(tl.maximum(m, -TAME), TAME) * LOG2E


@triton.jit
def online_fast(y, m, s, u, ENTROPY: tl.constexpr):
    """:func:`online_update` with one multiply-add per exponent ``a``: ``u`` sums ``2**a * a`` (log2 units)."""
    m_new = tl.maximum(m, tl.max(y, axis=1))
    mc = _mc(m_new)
    a = tl.fma(y, LOG2E, -mc[:, None])
    t = tl.exp2(a)
    terms = tl.sum(t, axis=1)
    if ENTROPY:
        u = entropy_fold(u, s, _mc(m) - mc, tl.exp2(_mc(m) - mc), a, t, False)
    return m_new, s * tl.exp2(_mc(m) - mc) + terms, u


@triton.jit
def fold_fast(m, s, u, ENTROPY: tl.constexpr):
    """The fused path's chunk maximum, sum and ``u``, each line's rescaled by ``2**(_mc(m) - big * log2(e))``."""
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    total = tl.sum(s * tl.exp2(tl.fma(-big_safe, LOG2E, _mc(m))), axis=0)
    if ENTROPY:
        e = tl.fma(-big_safe, LOG2E, _mc(m))
        ent = entropy_sum(u, s, e, tl.exp2(e)) * LN2
    else:
        ent = 0.0
    return big, total, ent


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
    """Whether each line's maximum grew, its running maximum ``ag`` (never NaN) and block ``ab``."""
    bm = tl.max(y, axis=1)
    up = bm > ag
    return up, tl.maximum(ag, bm), tl.where(up, off, ab)


@triton.jit
def argmax_chunk(row_ptr, cols, end, ag, ab, count, t, greedy, HAS_TEMP: tl.constexpr):
    """A chunk's greedy maximum, its lowest column (read back) and count (a greedy row: its ties)."""
    amax = tl.max(ag, axis=0)
    cand = ag == amax
    idx = ab[:, None] + cols
    v = scaled(tl.load(row_ptr + idx, mask=cand[:, None] & (idx < end), other=float("nan")).to(tl.float32), t, HAS_TEMP)
    acol = tl.min(tl.min(tl.where(v == amax, idx, INT32_MAX), axis=1), axis=0)
    ties = tl.sum(tl.where(cand, count, 0), axis=0)
    return amax, acol, tl.where(greedy, ties, tl.sum(count, axis=0))


@triton.jit
def _pick(q, x0, x1, x2, x3):
    return tl.where(q == 0, x0, tl.where(q == 1, x1, tl.where(q == 2, x2, x3)))


@triton.jit
def shifted_block(words, wcols, off_w, mask, skew, row_words, MASKED: tl.constexpr):
    """The words of lines ``off_w`` words plus ``skew`` bytes past ``words`` (the row ends at ``row_words``)."""
    lines = tl.arange(0, wcols.shape[0])[:, None] * 4  # each line's first word
    inside = off_w + lines + 8 <= row_words
    if MASKED:
        va = tl.load(words + off_w + wcols, mask=mask, other=0)
        vb = tl.load(words + off_w + wcols + 4, mask=mask & inside, other=0)
    else:
        va = tl.load(words + off_w + wcols)
        vb = tl.load(words + off_w + wcols + 4, mask=inside, other=0)
    even, odd = tl.split(va.reshape([va.shape[0], 2, 2]))  # words 0 and 2, words 1 and 3
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    even, odd = tl.split(vb.reshape([vb.shape[0], 2, 2]))
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
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
def _tail_block(row_ptr, idx, off, end, inside, SHIFT: tl.constexpr):
    """The logits at ``idx``, -inf past ``end``, a load per logit (``SHIFT``: as :func:`shifted_block`)."""
    if SHIFT:
        ITEMSIZE: tl.constexpr = 16 // idx.shape[1]
        first = off + tl.arange(0, idx.shape[0]) * idx.shape[1]  # each line's first column
        w0 = _exact_word(row_ptr, first, 0, end, ITEMSIZE)
        w1 = _exact_word(row_ptr, first, 1, end, ITEMSIZE)
        w2 = _exact_word(row_ptr, first, 2, end, ITEMSIZE)
        w3 = _exact_word(row_ptr, first, 3, end, ITEMSIZE)
        w = tl.join(tl.join(w0, w2), tl.join(w1, w3)).reshape([idx.shape[0], 4])
        return tl.where(inside, line_values(w, row_ptr.dtype.element_ty), float("-inf"))
    else:
        return tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32)


@triton.jit
def _ge_masks(w, chosen_w):
    """Per word of two bfloat16 logits, ``0xFFFF`` in each half ``>=`` the token's (NaN: 0)."""
    return tl.inline_asm_elementwise(
        "set.ge.u32.bf16x2 $0, $1, $2;", "=r,r,r", [w, chosen_w], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def ahead_blocks(words, wcols, start, span, end, skew, row_words, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """The chunk's first two whole blocks (else zeros), loaded early; logits are read evict-first."""
    words_in = tl.minimum(span, end - start) // BLOCK * (BLOCK // 2)  # words in the chunk's whole blocks
    words += start // 2
    row_words -= start // 2
    W: tl.constexpr = BLOCK // 2
    if SHIFT:
        w0 = shifted_block(words, wcols, 0, wcols < words_in, skew, row_words, True)
        w1 = shifted_block(words, wcols, W, wcols + W < words_in, skew, row_words, True)
    else:
        w0 = tl.load(words + wcols, wcols < words_in, 0, eviction_policy="evict_first")
        w1 = tl.load(words + wcols + W, wcols + W < words_in, 0, eviction_policy="evict_first")
    return w0, w1


@triton.jit
def _fast_block(w, off, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY):
    g1, g2, gab, m, s, count, masks, ab, u = st
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
    return g1, g2, gab, m, s, count, masks, ab, u


@triton.jit
def _tail_fast(row_ptr, cols, off, end, tok, st, TRACK, ARGMAX, SHIFT, ENTROPY):
    g1, g2, gab, m, s, count, masks, ab, u = st
    chosen, _, greedy = tok
    idx = off + cols
    inside = idx < end
    y = _tail_block(row_ptr, idx, off, end, inside, SHIFT)
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    if ARGMAX:
        up, _, ab = argmax_lines(y, off, m, ab)
        m, s, u = online_fast(y, m, s, u, ENTROPY)
        ref = tl.where(greedy, m, chosen)[:, None]
        count = tl.where(greedy & up, 0, count) + tl.sum(((y >= ref) & inside).to(tl.int32), axis=1)
    else:
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
        m, s, u = online_fast(y, m, s, u, ENTROPY)
    return g1, g2, gab, m, s, count, masks, ab, u


@triton.jit
def chunk_lines_fast(lay, ahead, cols, bounds, tok, track, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, SHIFT, ENTROPY):
    """The fused path's line states; ``ahead``: the chunk's first two whole blocks."""
    row_ptr, words, wcols, skew, row_words = lay
    start, full_end, end = bounds
    w0, w1 = ahead
    g1, g2, gab = track
    m = tl.full([LINES], float("-inf"), tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES], tl.int32)
    masks = tl.zeros([LINES], tl.uint32)
    ab = tl.zeros([LINES], tl.int32) + start  # ARGMAX: the block of each line's maximum
    u = tl.zeros([LINES], tl.float32)  # ENTROPY
    st = (g1, g2, gab, m, s, count, masks, ab, u)  # in the order the kernel's loops carry them
    n_full = (full_end - start) // BLOCK
    if n_full >= 1:
        st = _fast_block(w0, start, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY)
    if n_full >= 2:
        st = _fast_block(w1, start + BLOCK, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY)
    # The lower bound is clamped: a chunk of one whole block must not run an unrolled iteration.
    for off in tl.range(tl.minimum(start + 2 * BLOCK, full_end), full_end, BLOCK, loop_unroll_factor=2):
        if SHIFT:
            w = shifted_block(words, wcols, off // 2, None, skew, row_words, False)
        else:
            w = tl.load(words + off // 2 + wcols, eviction_policy="evict_first")
        st = _fast_block(w, off, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, ENTROPY)
    g1, g2, gab, m, s, count, masks, ab, u = st
    if PACKED_COUNT:  # 0xFFFEFFFF inverts 0xFFFF mod 2**32 (each half counts < 2**16: the plan checks)
        packed = masks * 0xFFFEFFFF
        count += ((packed & 0xFFFF) + (packed >> 16)).to(tl.int32)
    st = (g1, g2, gab, m, s, count, masks, ab, u)
    if SHIFT:  # the partial last block, a logit per load (SHIFT: up to two blocks)
        for off in tl.range(full_end, end, BLOCK, loop_unroll_factor=1):
            st = _tail_fast(row_ptr, cols, off, end, tok, st, TRACK, ARGMAX, True, ENTROPY)
    elif full_end < end:
        st = _tail_fast(row_ptr, cols, full_end, end, tok, st, TRACK, ARGMAX, False, ENTROPY)
    return st


@triton.jit
def _tail_safe(row_ptr, cols, off, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, SHIFT, ENTROPY):
    g1, g2, gab, m, s, count, ag, ab, u = st
    idx = off + cols
    inside = idx < end
    y = scaled(_tail_block(row_ptr, idx, off, end, inside, SHIFT), t, HAS_TEMP)
    if ARGMAX:
        up, ag, ab = argmax_lines(y, off, ag, ab)
    if GREEDY:
        count = tl.where(up, 0, count) + tl.sum(((y >= ag[:, None]) & inside).to(tl.int32), axis=1)
    else:
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    m, s, u = online_update(y, m, s, u, ENTROPY)
    return g1, g2, gab, m, s, count, ag, ab, u


@triton.jit
def chunk_safe(
    lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, ARGMAX, GREEDY, SHIFT, UNROLL, ENTROPY
):
    """The element path's chunk partial (a ``GREEDY`` row counts the ties at its maximum)."""
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
            y = tl.load(row_ptr + off + cols, eviction_policy="evict_first").to(tl.float32)
        y = scaled(y, t, HAS_TEMP)
        g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
        m, s, u = online_update(y, m, s, u, ENTROPY)
        if ARGMAX:
            up, ag, ab = argmax_lines(y, off, ag, ab)
        if GREEDY:  # the ties at the line's maximum, restarted when it grows
            count = tl.where(up, 0, count) + tl.sum((y >= ag[:, None]).to(tl.int32), axis=1)
        else:
            count += tl.sum((y >= chosen).to(tl.int32), axis=1)
    st = (g1, g2, gab, m, s, count, ag, ab, u)
    if SHIFT:  # the partial last block, a logit per load (SHIFT: up to two blocks)
        for off in tl.range(full_end, end, BLOCK, loop_unroll_factor=1):
            st = _tail_safe(row_ptr, cols, off, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, True, ENTROPY)
    elif full_end < end:
        st = _tail_safe(row_ptr, cols, full_end, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, False, ENTROPY)
    g1, g2, gab, m, s, count, ag, ab, u = st
    big, total, ent = fold_lines(m, s, u, ENTROPY)
    if ARGMAX:
        amax, acol, n = argmax_chunk(row_ptr, cols, end, ag, ab, count, t, GREEDY, HAS_TEMP)
    else:
        amax, acol, n = 0.0, 0, tl.sum(count, axis=0)
    return big, total, n, g1, g2, gab, amax, acol, ent
