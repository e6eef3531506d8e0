"""The fused path of the logprob chunk kernel for bfloat16 rows without a temperature
(``WORDS``): whole blocks read as 32-bit words of two logits, one fused multiply-add per
exponent, the rank counted with one packed compare per word. Rows that are not 16-byte aligned
(``SHIFT``: an odd vocabulary such as GPT-2's 50,257, or a padded stride) read the two aligned
16-byte vectors that hold each line and shift the line's words into place, so every line holds
the same logits in the same registers as in an aligned row: the same instructions follow, and
the same bits. The contract and the handling of logits beyond ``+-2**20`` are described in
:mod:`.logprob_rank`."""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_common_jit import LOG2E, argmax_chunk, argmax_lines, stream_load, track_lines

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
    the next chunk's at the end of a chunk's blocks, so that loads stay in flight across them
    (3.76 instead of 4.05 us at batch 1 on an H200). ``skew``, ``row_words`` and ``SHIFT`` as in
    :func:`chunk_lines_fast`."""
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
    # block), the unrolled loop that Triton 3.6 compiled ran one iteration on the H200 and read
    # the next row (tests/test_gpu_logprob_rank.py at vocabulary 32,000, 09:56 UTC).
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
