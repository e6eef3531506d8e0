"""The logprob op's ``@triton.jit`` kernels (contract and design: :mod:`.logprob_rank`). The chunk
kernel stores each chunk's partial (:mod:`._logprob_chunk_jit`) and, with top-k, each program's
best keys (:func:`program_topk`); the combine kernel (or, in clusters, a row's first program)
merges a row's partials in chunk order within one warp (:func:`merge_row`) and its programs' keys.
Top-k: a key orders (value descending, id ascending) as one 64-bit integer, so the selected set
does not depend on the order candidates are found in. A program's threshold ``tau`` bounds its best
``top_k`` from below: only the vectors whose lines reach it are read back (step 2), else its logits
are rescanned with the ties at ``tau`` cut (step 3), else merged ``PIECE`` at a time (step 4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_chunk_jit import (
    INT32_MAX,
    LOG2E,
    NEG_FLT_MAX,
    TAME,
    ahead_blocks,
    argmax_chunk,
    chunk_lines_fast,
    chunk_safe,
    entropy_sum,
    fold_fast,
    fold_lines,
    online_update,
    scaled,
)

__all__ = ["logprob_rank_chunk_kernel", "logprob_rank_combine_kernel", "merge_row"]

KEY_PAD = tl.constexpr(-(2**63))  # the smallest key: padding, NaN, masked lanes
PAIRS = tl.constexpr(32)  # candidate vectors read back per step
RESCAN = tl.constexpr(512)  # logits per step of the rescan (step 3)
PIECE = tl.constexpr(256)  # logits per merge of the piecewise fallback (step 4)


@triton.jit
def keys_of(y, cols, ok):
    """Keys of (value descending, column ascending); NaN, masked: ``KEY_PAD``; -0.0 keyed as +0.0."""
    y = tl.where(y == 0.0, 0.0, y)
    b = y.to(tl.int32, bitcast=True)
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    low = (~cols).to(tl.uint32, bitcast=True).to(tl.int64)  # 2**32 - 1 - column
    key = (o.to(tl.int64) << 32) | low
    return tl.where(ok & (y == y), key, KEY_PAD)


@triton.jit
def merge_top(a, b, K_PAD: tl.constexpr):
    both = tl.reshape(tl.join(a, b), [2 * K_PAD])
    return tl.topk(both, K_PAD)


@triton.jit
def _compact_capped(sel, vals, dst, n, CAP: tl.constexpr):
    """Write ``vals`` where ``sel`` holds to ``dst[n..CAP)`` in order; returns how many were selected."""
    s = tl.reshape(sel, [sel.numel]).to(tl.int32)
    pos = n + tl.cumsum(s, axis=0) - 1
    tl.store(dst + pos, tl.reshape(vals, [sel.numel]), mask=(s != 0) & (pos < CAP))
    return tl.sum(s, axis=0)


@triton.jit
def program_topk(row_ptr, slot, lo, hi, track, t, top_k, ptrs, LINES, VEC, BLOCK, SEL, K_PAD, HAS_TEMP):
    """Store the best ``K_PAD`` keys of columns ``[lo, hi)`` (unsorted where at most ``K_PAD`` pass)."""
    g1, g2, gab = track
    CAP_P: tl.constexpr = 4 * K_PAD  # candidate vectors, then candidate logits, kept per program
    CAP: tl.constexpr = 2 * K_PAD
    pairs_dst, cand_dst, out = ptrs[0] + slot * CAP_P, ptrs[1] + slot * CAP, ptrs[2] + slot * K_PAD
    # Step 1: tau from groups of lines g, g + SEL, ... (one thread's); -inf if -FLT_MAX or too few groups.
    if SEL >= K_PAD:
        g = tl.max(tl.reshape(g1, [LINES // SEL, SEL]), axis=0)
        top = tl.topk(g, K_PAD)  # sorted, largest first
        tau = tl.max(tl.where(tl.arange(0, K_PAD) == top_k - 1, top, float("-inf")), axis=0)
        tau = tl.where(tau <= NEG_FLT_MAX, float("-inf"), tau)
    else:
        tau = float("-inf")
    # Step 2: a line with g1 >= tau needs its vector at gab alone when g2 < tau, else all its blocks.
    cand = g1 >= tau
    every = cand & (g2 >= tau)
    n_blocks = (hi - lo + BLOCK - 1) // BLOCK
    per_line = tl.where(every, n_blocks, cand.to(tl.int32))
    n_vec = tl.sum(per_line, axis=0)
    n = -1
    if n_vec <= CAP_P:
        at = tl.cumsum(per_line, axis=0) - per_line
        line_col = tl.arange(0, LINES) * VEC
        tl.store(pairs_dst + at, gab + line_col, mask=cand & ~every)
        if tl.sum(every.to(tl.int32), axis=0) > 0:
            for b in range(0, n_blocks):
                tl.store(pairs_dst + at + b, lo + b * BLOCK + line_col, mask=every)
        tl.debug_barrier()  # the vectors' columns are read by other threads below
        jp = tl.arange(0, PAIRS)
        n = 0
        for p0 in range(0, n_vec, PAIRS):
            vec_ok = p0 + jp < n_vec
            first = tl.load(pairs_dst + p0 + jp, mask=vec_ok, other=0)
            cols = first[:, None] + tl.arange(0, VEC)[None, :]
            ok = vec_ok[:, None] & (cols < hi)
            y = scaled(tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32), t, HAS_TEMP)
            ge = ok & (y >= tau)
            n += _compact_capped(ge, keys_of(y, cols, ge), cand_dst, n, CAP)
        if n > CAP:
            n = -1
    if n < 0:  # step 3: the logits > tau and the top_k lowest columns == tau
        tl.debug_barrier()  # step 2 may have written cand_dst: its stores come first
        j = tl.arange(0, RESCAN)
        n_sel = 0
        n_eq = 0
        for off in range(lo, hi, RESCAN):
            cols = off + j
            ok = cols < hi
            y = scaled(tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32), t, HAS_TEMP)
            eq = (ok & (y == tau)).to(tl.int32)
            before = n_eq + tl.cumsum(eq, axis=0) - eq
            sel = (ok & (y > tau)) | ((eq != 0) & (before < top_k))
            n_sel += _compact_capped(sel, keys_of(y, cols, sel), cand_dst, n_sel, CAP)
            n_eq += tl.sum(eq, axis=0)
        n = tl.where(n_sel <= CAP, n_sel, -1)
    kk = tl.arange(0, K_PAD)
    if n >= 0:
        tl.debug_barrier()  # the candidates were written by other threads
        if n <= K_PAD:  # all of them fit (the common case): stored as they are, padded
            tl.store(out + kk, tl.load(cand_dst + kk, mask=kk < n, other=KEY_PAD))
        else:
            j = tl.arange(0, CAP)
            keys = tl.load(cand_dst + j, mask=j < n, other=KEY_PAD)
            tl.store(out + kk, tl.topk(keys, K_PAD))
    else:  # step 4: merged PIECE logits at a time
        out_k = out + kk
        best = tl.full([K_PAD], KEY_PAD, tl.int64)
        j = tl.arange(0, PIECE)
        for off in range(lo, hi, PIECE):
            cols = off + j
            ok = cols < hi
            y = scaled(tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32), t, HAS_TEMP)
            best = merge_top(best, tl.topk(keys_of(y, cols, ok), K_PAD), K_PAD)
        tl.store(out_k, best)


@triton.jit
def _ptx(ASM: tl.constexpr):
    tl.inline_asm_elementwise(ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def merge_row(
    row, row_ptr, base, chosen, code, outs, parts, sizes, BLOCK, RESUM, RESUM_BLOCK, VEC, ARGMAX, CACHE, ENTROPY
):
    """Merge a row's partials in chunk order, store its outputs, return its log-sum-exp."""
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
            # A flagged chunk within 128 of the row's maximum is summed again (further below, it adds 0).
            LINES: tl.constexpr = RESUM_BLOCK // VEC
            cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
            for k in range(0, n_chunks):
                flagged = tl.load(part_s_ptr + base + k, cache_modifier=CACHE) < 0
                if flagged & (tl.load(part_m_ptr + base + k, cache_modifier=CACHE) >= big - 128.0):
                    start = k * chunk_span
                    end = tl.minimum(start + chunk_span, vocab)
                    m_k = tl.full([LINES], NEG_FLT_MAX, tl.float32)
                    s_k = tl.zeros([LINES], tl.float32)
                    u_k = tl.zeros([LINES], tl.float32)
                    for off in tl.range(start, end, RESUM_BLOCK, loop_unroll_factor=1):
                        idx = off + cols
                        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
                        m_k, s_k, u_k = online_update(x, m_k, s_k, u_k, ENTROPY)
                    _, s_k, u_k = fold_lines(m_k, s_k, u_k, ENTROPY)
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
        tl.store(entropy_ptr + row, tl.log(total) - ent / total)
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
    logits_ptr, ids_ptr, temp_ptr,  # [batch, row_stride] logits, first `vocab` read; [batch] ids; T (HAS_TEMP)
    # out per chunk: float32 max (a chunk of -inf: -FLT_MAX; WORDS: -inf), float32 sum of exp(y - max) (WORDS:
    # -1 where flagged), int32 count of y >= y[token]; per row: the token's scaled logit (NaN: invalid id), its code
    part_m_ptr, part_s_ptr, part_c_ptr, tok_y_ptr, tok_ok_ptr,
    part_k_ptr, cand_ptr, pairs_ptr,  # TOPK: a program's best keys (at its first chunk); scratch: keys, vectors
    part_am_ptr, part_a_ptr,  # ARGMAX, per chunk: largest non-NaN logit, its lowest column (or INT32_MAX)
    logprob_ptr, rank_ptr, argmax_ptr, part_u_ptr, entropy_ptr,  # CLUSTER: the row's outputs; part_u: chunks' u
    vocab, row_stride, chunk_blocks, n_chunks, group, top_k,  # group: chunks per program (grid axis 1)
    BLOCK: tl.constexpr, VEC: tl.constexpr,  # logits per loop step, per 16-byte vector
    HAS_TEMP: tl.constexpr, WORDS: tl.constexpr, SHIFT: tl.constexpr,  # the fused path; rows not 16-byte aligned
    PACKED_COUNT: tl.constexpr, GDC: tl.constexpr,  # inline PTX (no interpreter); GDC: the next kernel launches early
    TOPK: tl.constexpr, SEL: tl.constexpr,  # k_pad (0: no top-k); group maxima for the threshold
    ARGMAX: tl.constexpr, UNROLL: tl.constexpr,  # negative ids are greedy rows; the element path's unroll
    CLUSTER: tl.constexpr,  # a row's programs form one cluster (sm_90+), whose first merges the row (no TOPK)
    MERGE_BLOCK: tl.constexpr, RESUM_BLOCK: tl.constexpr,  # CLUSTER: the combine kernel's BLOCK, RESUM_BLOCK
    ENTROPY: tl.constexpr,  # each chunk's u; CLUSTER: the row's entropy
):  # fmt: skip
    """Grid ``(batch, cdiv(n_chunks, group))``: program ``(row, p)`` stores chunks ``p * group ..``."""
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
        row_words = (skew + ITEMSIZE * vocab) // 16 * 4  # the row's last 16-byte boundary, in words
        safe_cols = tl.maximum(4 * row_words - skew, 0) // ITEMSIZE
    else:
        skew = 0
        words = row_ptr.to(tl.pointer_type(tl.int32))
        row_words = 0
    wcols = tl.arange(0, LINES)[:, None] * 4 + tl.arange(0, 4)[None, :]  # each line's four words
    lay = (row_ptr, words, wcols, skew, row_words)
    if WORDS:  # the first two blocks in flight during the token's two dependent loads
        w0, w1 = ahead_blocks(words, wcols, first * span, span, stop, skew, row_words, BLOCK, SHIFT)
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid_tok = (token >= 0) & (token < vocab)
    if HAS_TEMP:  # T not finite and > 0: NaN, so the row reads as a row of NaN logits
        t = tl.load(temp_ptr + row)
        t = tl.where((t > 0.0) & (t < float("inf")), t, float("nan"))
    else:
        t = 1.0
    chosen = scaled(tl.load(row_ptr + tl.where(valid_tok, token, 0)).to(tl.float32), t, HAS_TEMP)
    chosen = tl.where(valid_tok, chosen, float("nan"))  # an invalid id: NaN
    greedy = token < 0  # with ARGMAX, a greedy row: scored as its argmax
    if first == 0:  # the row's token and its code (0: invalid id, 1: valid, 2: greedy row)
        tl.store(tok_y_ptr + row, chosen)
        tl.store(tok_ok_ptr + row, tl.where(greedy, 2, valid_tok.to(tl.int32)) if ARGMAX else valid_tok.to(tl.int32))
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
            g1, g2, gab, line_m, line_s, line_c, _, line_b, line_u = chunk_lines_fast(
                lay, (w0, w1), cols, bounds, tok, track, LINES, BLOCK, PACKED_COUNT, TRACK, ARGMAX, SHIFT, ENTROPY
            )
            # The next chunk's first blocks, before this chunk's reductions (ARGMAX: after its read-back).
            if not ARGMAX:
                w0, w1 = ahead_blocks(words, wcols, start + span, span, stop, skew, row_words, BLOCK, SHIFT)
            big, total, ent = fold_fast(line_m, line_s, line_u, ENTROPY)
            if ARGMAX:
                amax, acol, count = argmax_chunk(row_ptr, cols, end, line_m, line_b, line_c, 1.0, greedy, False)
                w0, w1 = ahead_blocks(words, wcols, start + span, span, stop, skew, row_words, BLOCK, SHIFT)
            else:
                amax, acol, count = 0.0, 0, tl.sum(line_c, axis=0)
            total = tl.where((tl.abs(big) > TAME) & (tl.abs(big) < float("inf")), -1.0, total)  # flagged
        elif ARGMAX and greedy:  # a greedy row takes its own compiled block loop
            big, total, count, g1, g2, gab, amax, acol, ent = chunk_safe(
                lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, True, True, SHIFT, UNROLL, ENTROPY
            )
        else:
            big, total, count, g1, g2, gab, amax, acol, ent = chunk_safe(
                lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TRACK, ARGMAX, False, SHIFT, UNROLL,
                ENTROPY,
            )  # fmt: skip
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
            code = tl.where(greedy, 2, valid_tok.to(tl.int32)) if ARGMAX else valid_tok.to(tl.int32)
            merge_row(
                row, row_ptr, row * n_chunks, chosen, code, (logprob_ptr, rank_ptr, argmax_ptr, entropy_ptr),
                (part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr, part_u_ptr), (vocab, n_chunks, span),
                MERGE_BLOCK, WORDS, RESUM_BLOCK, VEC, ARGMAX, ".cg", ENTROPY,
            )  # fmt: skip
    if TOPK > 0:  # the program's best keys (an exact set), at its first chunk's slot
        ptrs = (pairs_ptr, cand_ptr, part_k_ptr)
        slot, lo, hi = row * n_chunks + first, first * span, tl.minimum(last * span, vocab)
        program_topk(row_ptr, slot, lo, hi, (g1, g2, gab), t, top_k, ptrs, LINES, VEC, BLOCK, SEL, TOPK, HAS_TEMP)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_chunks", "top_k", "chunk_span", "group"],
    do_not_specialize_on_alignment=(
        "logits_ptr logprob_ptr rank_ptr topk_lp_ptr topk_id_ptr part_m_ptr part_s_ptr "
        "part_c_ptr part_k_ptr tok_y_ptr tok_ok_ptr argmax_ptr part_am_ptr part_a_ptr part_u_ptr entropy_ptr"
    ).split(),
)
def logprob_rank_combine_kernel(
    logits_ptr,  # as in the chunk kernel (read only to re-sum flagged chunks, RESUM)
    logprob_ptr, rank_ptr, topk_lp_ptr, topk_id_ptr,  # out: [batch]; [batch, top_k] (K_PAD > 0)
    part_m_ptr, part_s_ptr, part_c_ptr, part_k_ptr, tok_y_ptr, tok_ok_ptr,  # as the chunk kernel wrote them
    argmax_ptr, part_am_ptr, part_a_ptr,  # ARGMAX: [batch] out, the greedy token; the chunks' greedy partials
    part_u_ptr, entropy_ptr,  # ENTROPY (else None): each chunk's u; [batch] float32 out
    vocab, row_stride, n_chunks, top_k, chunk_span, group,  # group: the chunk kernel's chunks per program
    BLOCK: tl.constexpr, K_PAD: tl.constexpr, KEY_TILES: tl.constexpr,  # BLOCK >= n_chunks; KEY_TILES key sets a step
    RESUM: tl.constexpr, RESUM_BLOCK: tl.constexpr, VEC: tl.constexpr,  # RESUM: partials of sum -1 are re-summed
    GDC: tl.constexpr, ARGMAX: tl.constexpr, ENTROPY: tl.constexpr,  # GDC: a programmatic dependent of the chunk kernel
):  # fmt: skip
    """Grid ``(batch,)``: merge each row's partials and, with ``K_PAD``, its programs' keys."""
    if GDC:  # a chained kernel waits for this grid to end before it reads anything
        _ptx("griddepcontrol.launch_dependents; // $0")
        _ptx("griddepcontrol.wait; // $0")
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    base = row * n_chunks
    chosen, code = tl.load(tok_y_ptr + row), tl.load(tok_ok_ptr + row)
    lse = merge_row(
        row, row_ptr, base, chosen, code, (logprob_ptr, rank_ptr, argmax_ptr, entropy_ptr),
        (part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr, part_u_ptr), (vocab, n_chunks, chunk_span),
        BLOCK, RESUM, RESUM_BLOCK, VEC, ARGMAX, "", ENTROPY,
    )  # fmt: skip
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
