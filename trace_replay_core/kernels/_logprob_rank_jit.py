"""The ``@triton.jit`` kernels of the logprob-and-rank op (contract and design:
:mod:`.logprob_rank`, which plans and launches them). The chunk kernel computes each chunk's
partial (:mod:`._logprob_chunk_jit`) and, with top-k, each program's best keys
(:mod:`._logprob_topk_jit`); the combine kernel (or, launched in clusters, a row's first program)
merges a row's partials in chunk order within one warp (:func:`merge_row`; with ``ENTROPY`` the
row's entropy too, :mod:`._logprob_online_jit`) and sorts its programs' keys."""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_chunk_jit import INT32_MAX, ahead_blocks, chunk_end_fast, chunk_lines_fast, chunk_safe, scaled
from ._logprob_online_jit import LOG2E, NEG_FLT_MAX, TAME, entropy_of, entropy_sum, fold_lines, online_update
from ._logprob_topk_jit import KEY_PAD, merge_top, program_topk

__all__ = ["logprob_rank_chunk_kernel", "logprob_rank_combine_kernel", "merge_row"]


@triton.jit
def _ptx(ASM: tl.constexpr):
    """Run the PTX statement ``ASM`` (sm_90: ``griddepcontrol`` of programmatic dependent
    launches, ``barrier.cluster`` arrive with release, wait with acquire)."""
    tl.inline_asm_elementwise(ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def resum_safe(row_ptr, cols, start, end, LINES: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    """:func:`chunk_safe`'s sum and (``ENTROPY``, else 0) ``u`` of the chunk ``[start, end)`` (no
    temperature), plainly masked: the merge's rare path for chunks the fused path flagged."""
    m = tl.full([LINES], NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    u = tl.zeros([LINES], tl.float32)
    for off in tl.range(start, end, BLOCK, loop_unroll_factor=1):
        idx = off + cols
        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        m, s, u = online_update(x, m, s, u, ENTROPY)
    _, total, ent = fold_lines(m, s, u, ENTROPY)
    return total, ent


@triton.jit
def _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP: tl.constexpr):
    """Whether the row's id is valid, its scaled logit (NaN if not), T (NaN unless finite and > 0),
    and whether it is negative (with ``ARGMAX``: a greedy row, scored as its argmax)."""
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)
    if HAS_TEMP:  # T not finite and > 0: NaN, so the row reads as a row of NaN logits
        t = tl.load(temp_ptr + row)
        t = tl.where((t > 0.0) & (t < float("inf")), t, float("nan"))
    else:
        t = 1.0
    chosen = scaled(tl.load(row_ptr + tl.where(valid, token, 0)).to(tl.float32), t, HAS_TEMP)
    return valid, tl.where(valid, chosen, float("nan")), t, token < 0


@triton.jit
def merge_row(
    row, row_ptr, base, chosen, code, outs, parts, sizes, BLOCK, RESUM, RESUM_BLOCK, VEC, ARGMAX, CACHE, ENTROPY
):
    """Merge row ``row``'s partials (at ``base``) in chunk order within one warp, store its logprob,
    rank, greedy token and entropy, return its log-sum-exp. ``code``: 0 invalid id, 1 valid, 2
    greedy row; ``outs``: logprob, rank, argmax, entropy; ``parts``: max, sum, count, greedy
    maximum, its column, ``u``; ``sizes``: vocabulary, chunks, logits per chunk; ``CACHE``:
    ``.cg`` in a cluster (from L2)."""
    logprob_ptr, rank_ptr, argmax_ptr, entropy_ptr = outs
    part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr, part_u_ptr = parts
    vocab, n_chunks, chunk_span = sizes
    j = tl.arange(0, BLOCK)  # every partial loaded at once (the plan keeps n_chunks <= BLOCK)
    inside = j < n_chunks
    m = tl.load(part_m_ptr + base + j, mask=inside, other=float("-inf"), cache_modifier=CACHE)
    s = tl.load(part_s_ptr + base + j, mask=inside, other=0.0, cache_modifier=CACHE)
    c = tl.load(part_c_ptr + base + j, mask=inside, other=0, cache_modifier=CACHE)
    if ARGMAX:
        am = tl.load(part_am_ptr + base + j, mask=inside, other=float("-inf"), cache_modifier=CACHE)
        a = tl.load(part_a_ptr + base + j, mask=inside, other=INT32_MAX, cache_modifier=CACHE)
    if ENTROPY:
        u = tl.load(part_u_ptr + base + j, mask=inside, other=0.0, cache_modifier=CACHE)
    valid = code == 1
    big = tl.max(m, axis=0)
    if RESUM:
        if tl.sum((s < 0).to(tl.int32), axis=0) > 0:
            # A flagged chunk within 128 of the row's maximum is summed again; further below it
            # adds s * 2**(< -184) = 0 as it is.
            LINES: tl.constexpr = RESUM_BLOCK // VEC
            cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
            for k in range(0, n_chunks):
                if (tl.load(part_s_ptr + base + k, cache_modifier=CACHE) < 0) & (
                    tl.load(part_m_ptr + base + k, cache_modifier=CACHE) >= big - 128.0
                ):
                    start = k * chunk_span
                    end = tl.minimum(start + chunk_span, vocab)
                    s_k, u_k = resum_safe(row_ptr, cols, start, end, LINES, RESUM_BLOCK, ENTROPY)
                    tl.store(part_s_ptr + base + k, s_k)
                    if ENTROPY:
                        tl.store(part_u_ptr + base + k, u_k)
            tl.debug_barrier()  # the re-summed partials are read by every thread below
            s = tl.load(part_s_ptr + base + j, mask=inside, other=0.0, cache_modifier=CACHE)
            if ENTROPY:
                u = tl.load(part_u_ptr + base + j, mask=inside, other=0.0, cache_modifier=CACHE)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    total = tl.sum(s * tl.exp2((m - big_safe) * LOG2E), axis=0)
    count = tl.sum(c, axis=0)
    lse = big + tl.log(total)  # total == 0 only for a row of -inf: lse = -inf
    if ENTROPY:  # a row of -inf: 0 / 0, NaN
        ent = entropy_sum(u, s, m - big_safe, tl.exp2((m - big_safe) * LOG2E))
        tl.store(entropy_ptr + row, entropy_of(total, ent))
    if ARGMAX:  # the greedy maximum, its lowest column (exact in any order), its ties; all NaN: 0
        amax = tl.max(am, axis=0)
        sel = inside & (am == amax)
        acol = tl.min(tl.where(sel, a, INT32_MAX), axis=0)
        ties = tl.sum(tl.where(sel, c, 0), axis=0)
        acol = tl.where(acol == INT32_MAX, 0, acol)
        tl.store(argmax_ptr + row, acol.to(argmax_ptr.dtype.element_ty))
        greedy = code == 2
        chosen = tl.where(greedy, amax, chosen)
        count = tl.where(greedy, ties, count)
        valid = valid | greedy
    tl.store(logprob_ptr + row, tl.where(valid, chosen - lse, float("nan")))
    tl.store(rank_ptr + row, tl.where(valid, count, -1).to(rank_ptr.dtype.element_ty))
    return lse


@triton.jit
def _program_keys(part_k_ptr, base, p0, tt, kk, n_progs, group, K_PAD: tl.constexpr, KEY_TILES: tl.constexpr):
    """The best ``K_PAD`` keys of a row's programs ``p0 .. p0 + KEY_TILES``, sorted."""
    p = p0 + tt
    slots = base + p * group
    keys = tl.load(part_k_ptr + slots[:, None] * K_PAD + kk[None, :], mask=(p < n_progs)[:, None], other=KEY_PAD)
    return tl.topk(tl.reshape(keys, [KEY_TILES * K_PAD]), K_PAD)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "chunk_blocks", "n_chunks", "group", "top_k"],
    do_not_specialize_on_alignment=(
        "logits_ptr ids_ptr temp_ptr part_m_ptr part_s_ptr part_c_ptr tok_y_ptr tok_ok_ptr "
        "part_k_ptr cand_ptr pairs_ptr part_am_ptr part_a_ptr logprob_ptr rank_ptr argmax_ptr part_u_ptr entropy_ptr"
    ).split(),
)
def logprob_rank_chunk_kernel(
    logits_ptr,  # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,  # [batch] int32/int64 token per row
    temp_ptr,  # [batch] float32 temperature (read when HAS_TEMP)
    part_m_ptr,  # [batch * n_chunks] float32 out: chunk maximum (a chunk of -inf: -FLT_MAX; WORDS: -inf)
    part_s_ptr,  # [batch * n_chunks] float32 out: sum of exp(y - max) (WORDS: -1 for a flagged chunk)
    part_c_ptr,  # [batch * n_chunks] int32 out: count of y >= y[token]
    tok_y_ptr,  # [batch] float32 out: the token's scaled logit (NaN for an invalid id)
    tok_ok_ptr,  # [batch] int32 out: whether the id is in [0, vocab)
    part_k_ptr,  # [batch * n_chunks, TOPK] int64 out: a program's best keys at its first chunk (TOPK > 0)
    cand_ptr,  # [batch * n_chunks, CAP] int64 scratch: candidate keys (TOPK > 0)
    pairs_ptr,  # [batch * n_chunks, CAP_P] int32 scratch: first columns of candidate vectors (TOPK > 0)
    part_am_ptr,  # [batch * n_chunks] float32 out: the chunk's largest non-NaN logit (ARGMAX)
    part_a_ptr,  # [batch * n_chunks] int32 out: its lowest column, INT32_MAX if none (ARGMAX)
    logprob_ptr,  # [batch] float32 out (CLUSTER)
    rank_ptr,  # [batch] int32/int64 out (CLUSTER)
    argmax_ptr,  # [batch] int32/int64 out (CLUSTER and ARGMAX)
    part_u_ptr,  # [batch * n_chunks] float32 out: sum of exp(y - max) * (y - max) (ENTROPY; else None)
    entropy_ptr,  # [batch] float32 out (CLUSTER and ENTROPY; else None)
    vocab,
    row_stride,  # elements between rows
    chunk_blocks,  # blocks of BLOCK logits per chunk
    n_chunks,  # chunks per row
    group,  # consecutive chunks per program (grid axis 1 = cdiv(n_chunks, group))
    top_k,
    BLOCK: tl.constexpr,  # logits per loop step
    VEC: tl.constexpr,  # logits per 16-byte vector (8 for 2-byte dtypes, 4 for float32)
    HAS_TEMP: tl.constexpr,
    WORDS: tl.constexpr,  # bfloat16, no temperature: chunk_lines_fast and chunk_end_fast
    SHIFT: tl.constexpr,  # rows not 16-byte aligned: each line's words shifted into place
    PACKED_COUNT: tl.constexpr,  # with WORDS: packed compares (inline PTX; not in Triton's interpreter)
    GDC: tl.constexpr,  # sm_90+: the combine kernel may launch early (inline PTX; not in the interpreter)
    TOPK: tl.constexpr,  # k_pad (0: no top-k)
    SEL: tl.constexpr,  # TOPK: group maxima for the threshold (see _logprob_topk_jit)
    ARGMAX: tl.constexpr,  # each chunk's greedy maximum and column; negative ids are greedy rows
    UNROLL: tl.constexpr,  # not WORDS: the block loop's unroll factor
    CLUSTER: tl.constexpr,  # a row's programs form one cluster (sm_90+), whose first merges the row (no TOPK)
    MERGE_BLOCK: tl.constexpr,
    RESUM_BLOCK: tl.constexpr,  # CLUSTER: as the combine kernel's BLOCK, RESUM_BLOCK
    ENTROPY: tl.constexpr,  # each chunk's u (see _logprob_online_jit); CLUSTER: the row's entropy
):
    """Grid ``(batch, cdiv(n_chunks, group))``: program ``(row, p)`` stores the partials of the
    row's chunks ``p * group ..`` at ``row * n_chunks + chunk``, and with ``TOPK`` its best keys at
    its first chunk's slot; the program of chunk 0 also stores the row's token."""
    if GDC:
        _ptx("griddepcontrol.launch_dependents; // $0")
        _ptx("griddepcontrol.wait; // $0")  # the writes of the kernel before it are visible
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * group
    last = tl.minimum(first + group, n_chunks)
    row_ptr = logits_ptr + row * row_stride
    if not SHIFT:
        row_ptr = tl.multiple_of(row_ptr, 16)
    LINES: tl.constexpr = BLOCK // VEC
    TRACK: tl.constexpr = TOPK > 0  # each line's top-k tracking
    span = chunk_blocks * BLOCK
    stop = tl.minimum(last * span, vocab)  # the end of the program's columns
    ITEMSIZE: tl.constexpr = 16 // VEC
    if SHIFT:  # the row's start rounded down to 16 bytes, and how far below the row it lies
        skew = (row_ptr.to(tl.int64) % 16).to(tl.int32)
        words = tl.multiple_of((row_ptr - skew // ITEMSIZE).to(tl.pointer_type(tl.int32)), 16)
        # The row's last 16-byte boundary in words past ``words``, and the columns before it.
        row_words = (skew + ITEMSIZE * vocab) // 16 * 4
        safe_cols = tl.maximum(4 * row_words - skew, 0) // ITEMSIZE
    else:
        skew = 0
        words = row_ptr.to(tl.pointer_type(tl.int32))
        row_words = 0
    wcols = tl.arange(0, LINES)[:, None] * 4 + tl.arange(0, 4)[None, :]  # each line's four words
    lay = (row_ptr, words, wcols, skew, row_words)
    if WORDS:  # the first two blocks in flight during the token's two dependent loads
        w0, w1 = ahead_blocks(words, wcols, first * span, span, stop, skew, row_words, BLOCK, SHIFT)
    valid_tok, chosen, t, greedy = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    if first == 0:  # the row's token, for the combine kernel
        tl.store(tok_y_ptr + row, chosen)
        if ARGMAX:  # 0: invalid id, 1: valid, 2: greedy row
            tl.store(tok_ok_ptr + row, tl.where(greedy, 2, valid_tok.to(tl.int32)))
        else:
            tl.store(tok_ok_ptr + row, valid_tok.to(tl.int32))
    cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    if WORDS:
        bits = chosen.to(tl.uint32, bitcast=True) >> 16  # the token's bfloat16 bits
        chosen_w = tl.full([LINES, VEC // 2], 0, tl.uint32) + (bits | (bits << 16))
        tok = (chosen, chosen_w, greedy)
    g1 = tl.full([LINES], float("-inf"), tl.float32)  # top-k line tracking over the program
    g2 = tl.full([LINES], float("-inf"), tl.float32)
    gab = tl.zeros([LINES], tl.int32) + first * span
    for chunk in range(first, last):  # each chunk by the same instructions, whatever ``group``
        start = chunk * span
        n_here = tl.minimum(span, vocab - start)
        full_end = start + (n_here // BLOCK) * BLOCK
        if SHIFT:  # whole blocks up to the row's last 16-byte boundary; after it a logit per load
            full_end = start + (tl.maximum(tl.minimum(full_end, safe_cols) - start, 0) // BLOCK) * BLOCK
        end = start + n_here
        bounds, track = (start, full_end, end), (g1, g2, gab)
        if WORDS:
            res = chunk_lines_fast(
                lay, (w0, w1), cols, bounds, tok, track, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, SHIFT, ENTROPY
            )
            line_m, line_s, line_c, line_b, g1, g2, gab, line_u = res
            # The next chunk's first blocks are issued before this chunk's reductions (with
            # ARGMAX after its read-back, which would otherwise hold them in registers).
            if not ARGMAX:
                w0, w1 = ahead_blocks(words, wcols, start + span, span, stop, skew, row_words, BLOCK, SHIFT)
            big, total, count, amax, acol, ent = chunk_end_fast(
                row_ptr, cols, end, line_m, line_s, line_c, line_b, greedy, line_u, ARGMAX, ENTROPY
            )
            if ARGMAX:
                w0, w1 = ahead_blocks(words, wcols, start + span, span, stop, skew, row_words, BLOCK, SHIFT)
            # A finite maximum beyond +-TAME: the sum is flagged (-1) for the merge to redo.
            total = tl.where((tl.abs(big) > TAME) & (tl.abs(big) < float("inf")), -1.0, total)
        elif ARGMAX and greedy:  # a greedy row takes its own compiled block loop
            res = chunk_safe(
                lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, True, True, SHIFT, UNROLL, ENTROPY
            )
            big, total, count, g1, g2, gab, amax, acol, ent = res
        else:
            res = chunk_safe(
                lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, ARGMAX, False, SHIFT, UNROLL,
                ENTROPY,
            )  # fmt: skip
            big, total, count, g1, g2, gab, amax, acol, ent = res
        part = row * n_chunks + chunk
        tl.store(part_m_ptr + part, big)
        tl.store(part_s_ptr + part, total)
        tl.store(part_c_ptr + part, count)
        if ARGMAX:
            tl.store(part_am_ptr + part, amax)
            tl.store(part_a_ptr + part, acol)
        if ENTROPY:
            tl.store(part_u_ptr + part, ent)
    if CLUSTER:  # each program arrives once its partials are stored; the first waits, then merges
        _ptx("barrier.cluster.arrive.release; // $0")
        if tl.program_id(1) == 0:
            _ptx("barrier.cluster.wait.acquire; // $0")
            if ARGMAX:
                code = tl.where(greedy, 2, valid_tok.to(tl.int32))
            else:
                code = valid_tok.to(tl.int32)
            outs = (logprob_ptr, rank_ptr, argmax_ptr, entropy_ptr)
            parts = (part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr, part_u_ptr)
            sizes = (vocab, n_chunks, span)
            base = row * n_chunks
            merge_row(
                row,
                row_ptr,
                base,
                chosen,
                code,
                outs,
                parts,
                sizes,
                MERGE_BLOCK,
                WORDS,
                RESUM_BLOCK,
                VEC,
                ARGMAX,
                ".cg",
                ENTROPY,
            )
    if TOPK > 0:  # the program's best keys (an exact set), at its first chunk's slot
        slot = row * n_chunks + first
        CAP_P: tl.constexpr = 4 * TOPK  # as program_topk's
        CAP: tl.constexpr = 2 * TOPK
        lo, hi = first * span, tl.minimum(last * span, vocab)
        dst = (pairs_ptr + slot * CAP_P, cand_ptr + slot * CAP, part_k_ptr + slot * TOPK)
        program_topk(row_ptr, lo, hi, (g1, g2, gab), t, top_k, dst, LINES, VEC, BLOCK, SEL, TOPK, HAS_TEMP)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_chunks", "top_k", "chunk_span", "group"],
    do_not_specialize_on_alignment=(
        "logits_ptr logprob_ptr rank_ptr topk_lp_ptr topk_id_ptr part_m_ptr part_s_ptr "
        "part_c_ptr part_k_ptr tok_y_ptr tok_ok_ptr argmax_ptr part_am_ptr part_a_ptr part_u_ptr entropy_ptr"
    ).split(),
)
def logprob_rank_combine_kernel(
    logits_ptr,  # as in the chunk kernel (read only to re-sum flagged chunks, RESUM)
    logprob_ptr,  # [batch] float32 out
    rank_ptr,  # [batch] int32/int64 out
    topk_lp_ptr,  # [batch, top_k] float32 out (K_PAD > 0)
    topk_id_ptr,  # [batch, top_k] int32/int64 out (K_PAD > 0)
    part_m_ptr,
    part_s_ptr,
    part_c_ptr,
    part_k_ptr,
    tok_y_ptr,
    tok_ok_ptr,  # the token's scaled logit and validity, written by the chunk kernel
    argmax_ptr,  # [batch] int32/int64 out: the row's greedy token (ARGMAX)
    part_am_ptr,
    part_a_ptr,  # each chunk's greedy maximum and its column (ARGMAX)
    part_u_ptr,  # each chunk's u (ENTROPY; else None)
    entropy_ptr,  # [batch] float32 out: the row's entropy (ENTROPY; else None)
    vocab,
    row_stride,
    n_chunks,
    top_k,
    chunk_span,  # logits per chunk (read where RESUM)
    group,  # the chunk kernel's chunks per program (K_PAD > 0: where a row's programs' keys are)
    BLOCK: tl.constexpr,  # a power of two >= n_chunks: one tile holds a row's partials
    K_PAD: tl.constexpr,
    KEY_TILES: tl.constexpr,  # programs' key sets merged per step
    RESUM: tl.constexpr,  # the chunk kernel ran the fused path: partials with sum -1 are re-summed
    RESUM_BLOCK: tl.constexpr,
    VEC: tl.constexpr,  # the re-sum's block and 16-byte vector
    GDC: tl.constexpr,  # wait for the chunk kernel (launched as its programmatic dependent)
    ARGMAX: tl.constexpr,  # write the greedy token; score greedy rows (validity code 2) as it
    ENTROPY: tl.constexpr,  # write the row's entropy
):
    """Grid ``(batch,)``: merge each row's partials (:func:`merge_row`; ``BLOCK`` >= ``n_chunks``,
    ``RESUM``: the fused path's flagged chunks re-summed from ``logits``) and, with ``K_PAD``, its
    programs' keys (``KEY_TILES`` programs per merge step) into ``topk_lp``, ``topk_id``."""
    if GDC:  # a chained kernel waits for this grid to end before it reads anything
        _ptx("griddepcontrol.launch_dependents; // $0")
        _ptx("griddepcontrol.wait; // $0")
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    base = row * n_chunks
    outs = (logprob_ptr, rank_ptr, argmax_ptr, entropy_ptr)
    parts = (part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr, part_u_ptr)
    chosen, code = tl.load(tok_y_ptr + row), tl.load(tok_ok_ptr + row)
    sizes = (vocab, n_chunks, chunk_span)
    lse = merge_row(
        row, row_ptr, base, chosen, code, outs, parts, sizes, BLOCK, RESUM, RESUM_BLOCK, VEC, ARGMAX, "", ENTROPY
    )
    if K_PAD > 0:  # the programs' keys at chunks 0, group, 2 * group, ..., KEY_TILES at a time
        kk = tl.arange(0, K_PAD)
        tt = tl.arange(0, KEY_TILES)
        n_progs = (n_chunks + group - 1) // group
        best = _program_keys(part_k_ptr, base, 0, tt, kk, n_progs, group, K_PAD, KEY_TILES)
        for p0 in range(KEY_TILES, n_progs, KEY_TILES):
            best = merge_top(best, _program_keys(part_k_ptr, base, p0, tt, kk, n_progs, group, K_PAD, KEY_TILES), K_PAD)
        pad = best == KEY_PAD
        o = (best >> 32).to(tl.int32)
        y = (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        col = ~(best.to(tl.int32))  # the padding key decodes to -1
        out = row * top_k + kk
        keep = kk < top_k
        tl.store(topk_lp_ptr + out, tl.where(pad, float("nan"), y - lse), mask=keep)
        tl.store(topk_id_ptr + out, col.to(topk_id_ptr.dtype.element_ty), mask=keep)
