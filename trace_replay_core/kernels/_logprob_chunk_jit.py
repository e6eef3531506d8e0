"""A chunk's partial in the logprob chunk kernel, by its two paths.

The element path (every dtype, and bfloat16 with a temperature): a block of ``[LINES, VEC]``
logits per step, exponentials as ``exp2((y - m) * log2(e))``, exact for any finite logits. The
fused path (bfloat16 without a temperature, ``WORDS``): whole blocks read as 32-bit words of two
logits, one fused multiply-add per exponent, the rank by one packed compare per word. Rows that
are not 16-byte aligned (``SHIFT``) are shifted into place first (:mod:`._logprob_lines_jit`):
the same instructions follow, the same bits. The contract and the handling of logits beyond
``+-2**20`` are described in :mod:`.logprob_rank`."""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_lines_jit import (
    LOG2E,
    NEG_FLT_MAX,
    argmax_chunk,
    argmax_lines,
    exact_words,
    line_values,
    online_update,
    scaled,
    shifted_block,
    stream_load,
    track_lines,
)

TAME = tl.constexpr(2.0**20)  # line maxima clamped to +-TAME; a chunk beyond it is flagged


@triton.jit
def _mc(m):
    """The offset of a line's exponents: ``m * log2(e)`` with ``m`` clamped to ``[-2**20, 2**20]``,
    so that its rounding error (at most ``2**20 * log2(e) * 2**-24`` < 0.1) keeps every exponent
    ``y * log2(e) - mc`` of the line's logits ``y <= m`` below 0.1: no term overflows. A line
    below ``-2**20`` only loses terms to underflow that are ``< 2**-150`` next to a chunk maximum
    above ``-2**20``; a chunk whose maximum is beyond ``+-2**20`` is flagged (see the chunk kernel)."""
    return tl.minimum(tl.maximum(m, -TAME), TAME) * LOG2E


@triton.jit
def _online_fast(y, m, s):
    """``online_update`` with one fused multiply-add per exponent: ``s`` sums
    ``2**(y * log2(e) - mc)`` with ``mc = _mc(m')`` (rescaled by ``2**(mc_old - mc)`` when the line
    maximum grows). The chunk's end multiplies each line's sum by ``2**(mc - big * log2(e))``
    (one rounding), which undoes ``mc``'s own rounding error: the result is that of
    ``online_update`` to within the rounding of the exponents."""
    m_new = tl.maximum(m, tl.max(y, axis=1))
    mc = _mc(m_new)
    terms = tl.sum(tl.exp2(tl.fma(y, LOG2E, -mc[:, None])), axis=1)
    return m_new, s * tl.exp2(_mc(m) - mc) + terms


@triton.jit
def _ge_masks(w, chosen_w):
    """Per 32-bit word of two bfloat16 logits: ``0xFFFF`` in each half whose logit is ``>=`` the
    chosen one (``chosen_w`` holds it in both halves; NaN compares false), else 0. One packed
    compare per two logits (PTX ``set.ge.u32.bf16x2``, sm_90)."""
    return tl.inline_asm_elementwise(
        "set.ge.u32.bf16x2 $0, $1, $2;", "=r,r,r", [w, chosen_w], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def _whole_block(words, wcols, at, words_in, skew, row_words, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """The words of the block ``at`` blocks into a chunk (zeros unless it lies whole among the
    chunk's first ``words_in`` words)."""
    if SHIFT:
        return shifted_block(
            words, wcols, at * (BLOCK // 2), wcols + at * (BLOCK // 2) < words_in, skew, row_words, True
        )
    else:
        return stream_load(words + wcols + at * (BLOCK // 2), wcols + at * (BLOCK // 2) < words_in)


@triton.jit
def ahead_blocks(
    words,
    wcols,
    start,
    span,
    end,
    skew,
    row_words,
    BLOCK: tl.constexpr,
    SHIFT: tl.constexpr,
):
    """The words of the first two whole blocks of the chunk of ``span`` logits at ``start``
    (zeros for a block that does not lie whole before ``end``), loaded ahead of the chunk's block
    loop: the chunk kernel issues a program's first before the token's two dependent loads, and
    the next chunk's at the end of a chunk's blocks, so that loads stay in flight across them.
    ``skew``, ``row_words`` and ``SHIFT`` as in :func:`chunk_lines_fast`."""
    words_in = tl.minimum(span, end - start) // BLOCK * (BLOCK // 2)  # words in the chunk's whole blocks
    chunk_words = words + start // 2
    row_words -= start // 2
    w0 = _whole_block(chunk_words, wcols, 0, words_in, skew, row_words, BLOCK, SHIFT)
    w1 = _whole_block(chunk_words, wcols, 1, words_in, skew, row_words, BLOCK, SHIFT)
    return w0, w1


@triton.jit
def _fast_block(w, off, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX):
    """Fold the whole block of words ``w`` at column ``off`` into the line states of
    :func:`chunk_lines_fast` (maximum, sum, count or packed count masks, block of the maximum) and the
    line tracking of ``track_lines``; ``st`` the states, returned updated; ``tok``: the token's
    logit, its bits in both halves of a word, whether the row is greedy."""
    m, s, count, masks, ab, g1, g2, gab = st
    chosen, chosen_w, greedy = tok
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    y = tl.join(lo, hi).reshape([LINES, BLOCK // LINES])
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    if ARGMAX:  # the line maximum is m itself (from -inf, as argmax_lines wants)
        up, _, ab = argmax_lines(y, off, m, ab)
    m, s = _online_fast(y, m, s)
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
    return m, s, count, masks, ab, g1, g2, gab


@triton.jit
def _tail_fast(row_ptr, cols, off, end, chosen, greedy, st, TRACK, ARGMAX, SHIFT):
    """Fold the block at column ``off`` into the line states of :func:`chunk_lines_fast`, a logit
    per load, masked at ``end`` (a row's partial last block; with ``SHIFT`` any block past
    ``full_end``, as words laid out as the whole blocks' by :func:`exact_words`); ``st`` the
    states, returned updated."""
    m, s, count, ab, g1, g2, gab = st
    idx = off + cols
    inside = idx < end
    if SHIFT:
        y = tl.where(inside, line_values(exact_words(row_ptr, off, end, cols.shape[0], 2), tl.bfloat16), float("-inf"))
    else:
        y = tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32)
    g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
    if ARGMAX:
        up, _, ab = argmax_lines(y, off, m, ab)
        m, s = _online_fast(y, m, s)
        ref = tl.where(greedy, m, chosen)[:, None]
        count = tl.where(greedy & up, 0, count) + tl.sum(((y >= ref) & inside).to(tl.int32), axis=1)
    else:
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
        m, s = _online_fast(y, m, s)
    return m, s, count, ab, g1, g2, gab


@triton.jit
def chunk_lines_fast(lay, ahead, cols, bounds, tok, track, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, SHIFT):
    """The chunk kernel's ``chunk_safe`` for bfloat16 rows without a temperature, up to
    its per-line states (:func:`chunk_end_fast` reduces them): whole blocks read as 32-bit words
    (two logits each, widened by a shift and a mask), exponentials by :func:`_online_fast`, the
    count by packed compares where ``PACKED_COUNT`` (else per logit). ``w0`` and ``w1`` are the
    chunk's first two whole blocks (:func:`ahead_blocks`); every chunk folds them in by the
    same steps before its block loop, wherever they were loaded. With ``SHIFT`` (rows not 16-byte
    aligned) ``words`` is the row's start rounded down to 16 bytes, ``skew`` bytes before it, and
    ``row_words`` the row's last 16-byte boundary in words past ``words`` (``full_end`` stops
    where a line would need a vector beyond it; the rest, at most two blocks, is read a logit per
    load by :func:`_tail_fast`). Returns each line's maximum
    (from -inf), sum and count, the block of its maximum (``ARGMAX``) and the line tracking of
    ``track_lines``; a ``greedy`` row counts against its line maximum instead of the token.
    ``lay``: ``row_ptr``, ``words``, ``wcols``, ``skew``, ``row_words``; ``ahead``: ``(w0, w1)``; ``tok``:
    the token's logit, its bits in both halves of a word, whether the row is greedy; ``track``:
    the line tracking."""
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
    n_full = (full_end - start) // BLOCK
    if n_full >= 1:
        st = (m, s, count, masks, ab, g1, g2, gab)
        m, s, count, masks, ab, g1, g2, gab = _fast_block(w0, start, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX)
    if n_full >= 2:
        st = (m, s, count, masks, ab, g1, g2, gab)
        m, s, count, masks, ab, g1, g2, gab = _fast_block(
            w1, start + BLOCK, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX
        )
    # The lower bound is clamped to the end: with a start past the end (a chunk of one whole
    # block), an unrolled loop once ran one iteration and read the next row (a GPU test at
    # vocabulary 32,000 caught it).
    for off in tl.range(tl.minimum(start + 2 * BLOCK, full_end), full_end, BLOCK, loop_unroll_factor=2):
        if SHIFT:
            w = shifted_block(words, wcols, off // 2, None, skew, row_words, False)
        else:
            w = stream_load(words + off // 2 + wcols, None)
        st = (m, s, count, masks, ab, g1, g2, gab)
        m, s, count, masks, ab, g1, g2, gab = _fast_block(w, off, st, tok, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX)
    if PACKED_COUNT:
        # masks = 0xFFFF * (n_lo + 65536 * n_hi) mod 2**32, and 0xFFFEFFFF is 0xFFFF's inverse
        # mod 2**32: the product is n_lo + 65536 * n_hi (each half counts at most
        # 4 * chunk_blocks < 2**16 logits: the host checks the plan).
        packed = masks * 0xFFFEFFFF
        count += ((packed & 0xFFFF) + (packed >> 16)).to(tl.int32)
    if SHIFT:  # the row's last columns may reach into a second block (see the chunk kernel's full_end)
        for off in tl.range(full_end, end, BLOCK, loop_unroll_factor=1):
            st = (m, s, count, ab, g1, g2, gab)
            m, s, count, ab, g1, g2, gab = _tail_fast(row_ptr, cols, off, end, chosen, greedy, st, TRACK, ARGMAX, True)
    elif full_end < end:
        st = (m, s, count, ab, g1, g2, gab)
        m, s, count, ab, g1, g2, gab = _tail_fast(
            row_ptr, cols, full_end, end, chosen, greedy, st, TRACK, ARGMAX, False
        )
    return m, s, count, ab, g1, g2, gab


@triton.jit
def chunk_end_fast(row_ptr, cols, end, m, s, count, ab, greedy, ARGMAX: tl.constexpr):
    """A chunk's ``(max, sum, count)`` from the line states of :func:`chunk_lines_fast` and, with
    ``ARGMAX``, its greedy maximum and column (``chunk_safe``'s, from the line maxima ``m``). The
    maximum of a chunk of only -inf is -inf here (``chunk_safe``: -FLT_MAX); the combine kernel
    treats both alike."""
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    # 2**(mc - big * log2(e)) in one rounding; a line whose max is +inf (or NaN sums) gives NaN.
    total = tl.sum(s * tl.exp2(tl.fma(-big_safe, LOG2E, _mc(m))), axis=0)
    if ARGMAX:
        amax, acol, n = argmax_chunk(row_ptr, cols, end, m, ab, count, 1.0, greedy, False)
    else:
        amax, acol, n = 0.0, 0, tl.sum(count, axis=0)
    return big, total, n, amax, acol


@triton.jit
def _tail_safe(row_ptr, cols, off, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, SHIFT):
    """Fold the block at column ``off`` into :func:`chunk_safe`'s line states, a logit per load,
    masked at ``end`` (with ``SHIFT`` as words laid out as the whole blocks', ``exact_words``):
    the values of the whole-block path, the same steps. ``st``: the states, returned updated."""
    m, s, count, ag, ab, g1, g2, gab = st
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
    m, s = online_update(y, m, s)
    return m, s, count, ag, ab, g1, g2, gab


@triton.jit
def chunk_safe(lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, ARGMAX, GREEDY, SHIFT, UNROLL):
    """One chunk's partial ``(max, sum of exp(y - max), count of y >= chosen)`` and the line
    tracking of ``track_lines``, element loads, exponentials as ``exp2((y - m) * log2(e))``: exact
    for any finite logits. With ``ARGMAX`` also the chunk's greedy maximum and its lowest column
    (:func:`argmax_chunk`), and for a ``GREEDY`` row the count of the ties at that maximum.
    Whole blocks load evict-first (``stream_load``). With ``SHIFT`` (rows not
    16-byte aligned) each line is read as the two aligned 16-byte vectors around it and its words
    shifted into place (``shifted_block``; ``lay`` holds ``row_ptr``, ``words``, ``wcols``, ``skew``,
    ``row_words`` as in the fused path; ``track`` the line tracking), so every line holds the
    same logits in the same registers as in an aligned row
    and the same instructions follow: the same bits in every layout. ``UNROLL``: the block loop's
    unroll factor (speed only: every block is folded in by the same steps, in column order)."""
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
    # Whole blocks: unmasked (16-byte vector loads when the rows are aligned).
    for off in tl.range(start, full_end, BLOCK, loop_unroll_factor=UNROLL):
        if SHIFT:
            y = line_values(shifted_block(words, wcols, off // PER_WORD, None, skew, row_words, False), ELEM)
        else:
            y = stream_load(row_ptr + off + cols, None).to(tl.float32)
        y = scaled(y, t, HAS_TEMP)
        g1, g2, gab = track_lines(y, off, g1, g2, gab, TRACK)
        m, s = online_update(y, m, s)
        if ARGMAX:
            up, ag, ab = argmax_lines(y, off, ag, ab)
        if GREEDY:  # the ties at the line's maximum, restarted when it grows
            count = tl.where(up, 0, count) + tl.sum((y >= ag[:, None]).to(tl.int32), axis=1)
        else:
            count += tl.sum((y >= chosen).to(tl.int32), axis=1)
    # The partial last block, where there is one (only in a row's last chunk), a logit per load;
    # with SHIFT also a whole block that holds the row's last 16-byte vector (full_end stops
    # before it), so up to two. A fully masked block of -inf would leave finite m, s and count as
    # they are, so it is skipped.
    if SHIFT:
        for off in tl.range(full_end, end, BLOCK, loop_unroll_factor=1):
            st = (m, s, count, ag, ab, g1, g2, gab)
            m, s, count, ag, ab, g1, g2, gab = _tail_safe(
                row_ptr, cols, off, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, True
            )
    elif full_end < end:
        st = (m, s, count, ag, ab, g1, g2, gab)
        m, s, count, ag, ab, g1, g2, gab = _tail_safe(
            row_ptr, cols, full_end, end, chosen, t, st, HAS_TEMP, TRACK, ARGMAX, GREEDY, False
        )
    big = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2((m - big) * LOG2E), axis=0)  # a line whose max is +inf: NaN
    if ARGMAX:
        amax, acol, n = argmax_chunk(row_ptr, cols, end, ag, ab, count, t, GREEDY, HAS_TEMP)
    else:
        amax, acol, n = 0.0, 0, tl.sum(count, axis=0)
    return big, total, n, g1, g2, gab, amax, acol


@triton.jit
def resum_safe(row_ptr, cols, start, end, LINES: tl.constexpr, BLOCK: tl.constexpr):
    """The sum of :func:`chunk_safe` for the chunk ``[start, end)`` of a row (no temperature),
    in one plain masked loop: the combine kernel's rare path for chunks that the fused path
    flagged."""
    m = tl.full([LINES], NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    for off in tl.range(start, end, BLOCK, loop_unroll_factor=1):
        idx = off + cols
        m, s = online_update(tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32), m, s)
    return tl.sum(s * tl.exp2((m - tl.max(m, axis=0)) * LOG2E), axis=0)
