"""The ``@triton.jit`` kernels of the logprob-and-rank op: the chunk kernel (one read of the
logits: partial max, sum and count per chunk, with top-k each program's best keys; launched in
clusters, it also merges each row in its first program) and the combine kernel (one program per
row). A chunk's partial: :mod:`._logprob_chunk_jit`; top-k: :mod:`._logprob_topk_jit`. The
contract and the design are in :mod:`.logprob_rank`, which plans and launches these kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_chunk_jit import TAME, ahead_blocks, chunk_end_fast, chunk_lines_fast, chunk_safe, resum_safe
from ._logprob_lines_jit import INT32_MAX, LOG2E, scaled
from ._logprob_topk_jit import KEY_PAD, merge_top, program_topk

__all__ = ["logprob_rank_chunk_kernel", "logprob_rank_combine_kernel", "merge_row"]


@triton.jit
def _launch_dependents():
    """Let the next kernel on the stream, if launched as a programmatic dependent launch, start
    now (it waits for this grid's results with :func:`_wait_prerequisites`; PTX
    ``griddepcontrol``, sm_90)."""
    tl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _wait_prerequisites():
    """Wait until the grids this one depends on have finished and their writes are visible (a
    no-op when the kernel was launched the ordinary way)."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cluster_arrive():
    """Arrive at the cluster's barrier with release semantics: this thread's earlier writes are
    visible to every thread of the cluster that then waits on it (PTX ``barrier.cluster``,
    sm_90). A thread may exit after arriving: an exited thread holds no barrier up."""
    tl.inline_asm_elementwise("barrier.cluster.arrive.release; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cluster_wait():
    """Wait until every thread of the cluster has arrived (or exited), acquiring their writes."""
    tl.inline_asm_elementwise("barrier.cluster.wait.acquire; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP: tl.constexpr):
    """Whether the row's token id is valid, its scaled logit (NaN when invalid), T, and whether
    the id is negative (with ``ARGMAX``: a greedy row, scored as its argmax)."""
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)
    if HAS_TEMP:
        t = tl.load(temp_ptr + row)
    else:
        t = 1.0
    chosen = scaled(tl.load(row_ptr + tl.where(valid, token, 0)).to(tl.float32), t, HAS_TEMP)
    return valid, tl.where(valid, chosen, float("nan")), t, token < 0


@triton.jit
def merge_row(
    row,
    row_ptr,
    base,
    chosen,
    code,
    outs,
    parts,
    sizes,
    BLOCK,
    RESUM,
    RESUM_BLOCK,
    VEC,
    ARGMAX,
    CACHE,
):
    """Merge row ``row``'s ``n_chunks`` partials (at ``base``) in chunk order and store its
    logprob, rank and (``ARGMAX``) greedy token; return its log-sum-exp. ``chosen`` is the token's
    scaled logit, ``code`` 0 for an invalid id, 1 for a valid one, 2 for a greedy row. Run by the
    combine kernel (one warp) or by a cluster's first program (four warps, ``CACHE = ".cg"``: the
    partials read from L2); a row's partials (at most 16 in a cluster) are reduced within one warp
    in both: the same bits. ``outs``: logprob, rank, argmax outputs; ``parts``: the partials' max,
    sum, count, greedy maximum, its column; ``sizes``: vocabulary, chunks, logits per chunk."""
    logprob_ptr, rank_ptr, argmax_ptr = outs
    part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr = parts
    vocab, n_chunks, chunk_span = sizes
    # One load of each of the row's partials (the plan keeps n_chunks <= BLOCK), all issued
    # together: the merge below runs on registers.
    j = tl.arange(0, BLOCK)
    inside = j < n_chunks
    m = tl.load(part_m_ptr + base + j, mask=inside, other=float("-inf"), cache_modifier=CACHE)
    s = tl.load(part_s_ptr + base + j, mask=inside, other=0.0, cache_modifier=CACHE)
    c = tl.load(part_c_ptr + base + j, mask=inside, other=0, cache_modifier=CACHE)
    if ARGMAX:
        am = tl.load(part_am_ptr + base + j, mask=inside, other=float("-inf"), cache_modifier=CACHE)
        a = tl.load(part_a_ptr + base + j, mask=inside, other=INT32_MAX, cache_modifier=CACHE)
    valid = code == 1
    big = tl.max(m, axis=0)
    if RESUM:
        if tl.sum((s < 0).to(tl.int32), axis=0) > 0:
            # Rare: a flagged chunk (maximum beyond +-2**20) within 128 of the row's maximum is
            # summed again here; a flagged chunk further below adds s * 2**(< -184) = 0 as it is.
            LINES: tl.constexpr = RESUM_BLOCK // VEC
            cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
            for k in range(0, n_chunks):
                if (tl.load(part_s_ptr + base + k, cache_modifier=CACHE) < 0) & (
                    tl.load(part_m_ptr + base + k, cache_modifier=CACHE) >= big - 128.0
                ):
                    start = k * chunk_span
                    s_k = resum_safe(row_ptr, cols, start, tl.minimum(start + chunk_span, vocab), LINES, RESUM_BLOCK)
                    tl.store(part_s_ptr + base + k, s_k)
            tl.debug_barrier()  # the re-summed partials are read by every thread below
            s = tl.load(part_s_ptr + base + j, mask=inside, other=0.0, cache_modifier=CACHE)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    total = tl.sum(s * tl.exp2((m - big_safe) * LOG2E), axis=0)
    count = tl.sum(c, axis=0)
    lse = big + tl.log(total)  # total == 0 only for a row of -inf: lse = -inf
    if ARGMAX:
        # The row's greedy maximum, its lowest column over the chunks that hold it (exact: no
        # order of evaluation matters), and the ties at it; a row of only NaN gets column 0.
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
    """The best ``K_PAD`` keys of a row's programs ``p0 .. p0 + KEY_TILES`` (those that exist),
    sorted, largest first (the sets need not be sorted)."""
    p = p0 + tt
    slots = base + p * group
    keys = tl.load(part_k_ptr + slots[:, None] * K_PAD + kk[None, :], mask=(p < n_progs)[:, None], other=KEY_PAD)
    return tl.topk(tl.reshape(keys, [KEY_TILES * K_PAD]), K_PAD)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "chunk_blocks", "n_chunks", "group", "top_k"],
    do_not_specialize_on_alignment=(
        "logits_ptr ids_ptr temp_ptr part_m_ptr part_s_ptr part_c_ptr tok_y_ptr tok_ok_ptr "
        "part_k_ptr cand_ptr pairs_ptr part_am_ptr part_a_ptr logprob_ptr rank_ptr argmax_ptr"
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
):
    if GDC:
        _launch_dependents()
        _wait_prerequisites()  # launched as a dependent of the kernel before it: wait for its writes
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * group
    last = tl.minimum(first + group, n_chunks)
    row_ptr = logits_ptr + row * row_stride
    if not SHIFT:
        row_ptr = tl.multiple_of(row_ptr, 16)
    LINES: tl.constexpr = BLOCK // VEC
    span = chunk_blocks * BLOCK
    stop = tl.minimum(last * span, vocab)  # the end of the program's columns
    ITEMSIZE: tl.constexpr = 16 // VEC
    if SHIFT:  # the row's start rounded down to 16 bytes, and how far below the row it lies
        skew = (row_ptr.to(tl.int64) % 16).to(tl.int32)
        words = tl.multiple_of((row_ptr - skew // ITEMSIZE).to(tl.pointer_type(tl.int32)), 16)
        # The row's last 16-byte boundary, in words past ``words``, and the columns before it: the
        # vectors of lines that end there lie whole inside the row (no load reads past its end).
        row_words = (skew + ITEMSIZE * vocab) // 16 * 4
        safe_cols = tl.maximum(4 * row_words - skew, 0) // ITEMSIZE
    else:
        skew = 0
        words = row_ptr.to(tl.pointer_type(tl.int32))
        row_words = 0
    wcols = tl.arange(0, LINES)[:, None] * 4 + tl.arange(0, 4)[None, :]  # each line's four words
    lay = (row_ptr, words, wcols, skew, row_words)
    if WORDS:
        # The first chunk's first two blocks, in flight while the token's id and then its logit
        # load (two dependent round trips that every program starts with).
        w0, w1 = ahead_blocks(words, wcols, first * span, span, stop, skew, row_words, BLOCK, SHIFT)
    valid_tok, chosen, t, greedy = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    if first == 0:  # the row's token, for the combine kernel (it need not load it again)
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
    # Top-k: per line, its maximum over the program, the block of it, the best of the other blocks.
    g1 = tl.full([LINES], float("-inf"), tl.float32)
    g2 = tl.full([LINES], float("-inf"), tl.float32)
    gab = tl.zeros([LINES], tl.int32) + first * span
    # ``group`` (a runtime value: one compiled kernel for every batch) only says which program
    # computes which chunk; each chunk's partial is computed by the same instructions either way.
    for chunk in range(first, last):
        start = chunk * span
        n_here = tl.minimum(span, vocab - start)
        full_end = start + (n_here // BLOCK) * BLOCK
        if SHIFT:  # whole blocks up to the row's last 16-byte boundary; the columns after it a logit per load
            full_end = start + (tl.maximum(tl.minimum(full_end, safe_cols) - start, 0) // BLOCK) * BLOCK
        end = start + n_here
        bounds, track = (start, full_end, end), (g1, g2, gab)
        # With ARGMAX an element-path row takes one of two compiled forms of the block loop by its
        # own id (greedy or scored), so that no block pays for the other's compares; the fused
        # path selects per line at run time (faster there). Either way a row's bits are its own.
        if WORDS:
            res = chunk_lines_fast(
                lay, (w0, w1), cols, bounds, tok, track, LINES, BLOCK, PACKED_COUNT, TOPK > 0, ARGMAX, SHIFT
            )
            line_m, line_s, line_c, line_b, g1, g2, gab = res
            # The next chunk's first two blocks, if any, issued before this chunk's reductions (its
            # cross-warp barriers): loads stay in flight across the chunk boundary. With ARGMAX
            # after them: its read-back would otherwise hold them in registers too (occupancy).
            if not ARGMAX:
                w0, w1 = ahead_blocks(words, wcols, start + span, span, stop, skew, row_words, BLOCK, SHIFT)
            big, total, count, amax, acol = chunk_end_fast(
                row_ptr, cols, end, line_m, line_s, line_c, line_b, greedy, ARGMAX
            )
            if ARGMAX:
                w0, w1 = ahead_blocks(words, wcols, start + span, span, stop, skew, row_words, BLOCK, SHIFT)
            # A finite maximum beyond +-2**20 (a chunk masked with finfo.min instead of -inf, say):
            # the clamped offsets may have lost the chunk's terms, so its sum is flagged (-1); the
            # combine kernel sums it again in the safe form if it can matter to the row (the count
            # is exact either way). Whether a chunk is flagged depends on its own logits alone.
            total = tl.where((tl.abs(big) > TAME) & (tl.abs(big) < float("inf")), -1.0, total)
        else:
            if ARGMAX and greedy:
                res = chunk_safe(
                    lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TOPK > 0, True, True, SHIFT, UNROLL
                )
                big, total, count, g1, g2, gab, amax, acol = res
            else:
                res = chunk_safe(
                    lay, cols, bounds, chosen, t, track, LINES, BLOCK, HAS_TEMP, TOPK > 0, ARGMAX, False, SHIFT, UNROLL
                )
                big, total, count, g1, g2, gab, amax, acol = res
        part = row * n_chunks + chunk
        tl.store(part_m_ptr + part, big)
        tl.store(part_s_ptr + part, total)
        tl.store(part_c_ptr + part, count)
        if ARGMAX:
            tl.store(part_am_ptr + part, amax)
            tl.store(part_a_ptr + part, acol)
    if CLUSTER:
        # The row's programs are one cluster, resident together: each arrives at the cluster's
        # barrier once its partials are stored (release) and exits; the first waits for the
        # others (acquire) and merges the row by the combine kernel's instructions, reading the
        # partials from L2. No second kernel, no atomics: the same bits as the combine kernel.
        _cluster_arrive()
        if tl.program_id(1) == 0:
            _cluster_wait()
            if ARGMAX:
                code = tl.where(greedy, 2, valid_tok.to(tl.int32))
            else:
                code = valid_tok.to(tl.int32)
            outs = (logprob_ptr, rank_ptr, argmax_ptr)
            parts = (part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr)
            sizes = (vocab, n_chunks, span)
            merge_row(
                row,
                row_ptr,
                row * n_chunks,
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
            )
    if TOPK > 0:
        # The program's best keys (an exact set: which program holds a chunk changes no bit of
        # the row's top-k), at its first chunk's slot (the combine kernel reads no other).
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
        "part_c_ptr part_k_ptr tok_y_ptr tok_ok_ptr argmax_ptr part_am_ptr part_a_ptr"
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
):
    if GDC:
        # A chained kernel's programs may be scheduled now or once this grid's wait is over; either
        # way they wait for this grid to end before they read anything.
        _launch_dependents()
        _wait_prerequisites()
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    base = row * n_chunks
    outs = (logprob_ptr, rank_ptr, argmax_ptr)
    parts = (part_m_ptr, part_s_ptr, part_c_ptr, part_am_ptr, part_a_ptr)
    chosen, code = tl.load(tok_y_ptr + row), tl.load(tok_ok_ptr + row)
    sizes = (vocab, n_chunks, chunk_span)
    lse = merge_row(row, row_ptr, base, chosen, code, outs, parts, sizes, BLOCK, RESUM, RESUM_BLOCK, VEC, ARGMAX, "")
    if K_PAD > 0:
        # The programs' keys, at the first chunk of each (chunks 0, group, 2 * group, ...), in no
        # particular order: the row's best K_PAD of KEY_TILES programs at a time, sorted.
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
