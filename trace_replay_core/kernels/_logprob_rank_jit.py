"""The ``@triton.jit`` code of the logprob-and-rank op: the chunk kernel (no top-k), the tile
kernel (top-k), the combine kernel and their device helpers.

The contract, the batch-invariance argument and the top-k filter are described in
:mod:`.logprob_rank`, which plans and launches these kernels on plain integers; nothing here
runs on the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["logprob_rank_chunk_kernel", "logprob_rank_tile_kernel", "logprob_rank_combine_kernel"]

_NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)     # a chunk of only -inf keeps a finite maximum
_LOG2E = tl.constexpr(1.4426950408889634)
_TAME = tl.constexpr(2.0 ** 20)      # _chunk_fast: line maxima clamped to +-_TAME; a chunk beyond it is flagged
_KEY_PAD = tl.constexpr(-(2**63))                       # the smallest top-k key: padding, NaN, masked lanes


# -- device helpers -------------------------------------------------------------------------------

@triton.jit
def _launch_dependents():
    """Let the next kernel on the stream, if launched as a programmatic dependent launch, start
    now (it waits for this grid's results with :func:`_wait_prerequisites`; PTX
    ``griddepcontrol``, sm_90)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _wait_prerequisites():
    """Wait until the grids this one depends on have finished and their writes are visible (a
    no-op when the kernel was launched the ordinary way)."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tree_sum(x, LOG_N: tl.constexpr, HIGH_BITS: tl.constexpr, TREE: tl.constexpr):
    """Sum of the ``2**LOG_N`` elements of ``x`` in a fixed binary tree over the index bits:
    the ``HIGH_BITS`` highest bits first (elements one register pass apart), then the others
    from the lowest up. Every node adds two values (a + b == b + a), so the result depends on
    the indices alone, never on which thread holds which element."""
    if TREE:
        h = tl.reshape(x, [2] * LOG_N)
        for i in tl.static_range(HIGH_BITS):
            h = tl.sum(h, axis=0)
        for i in tl.static_range(LOG_N - HIGH_BITS):
            h = tl.sum(h, axis=LOG_N - HIGH_BITS - 1 - i)
        return h
    else:
        return tl.sum(x, axis=0)


@triton.jit
def _scaled(x, t, HAS_TEMP: tl.constexpr):
    if HAS_TEMP:
        return tl.math.div_rn(x, t)      # IEEE division, as logits / T in torch and numpy
    else:
        return x


@triton.jit
def _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP: tl.constexpr):
    """The row's token id, whether it is valid, its scaled logit (NaN when invalid) and T."""
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)
    if HAS_TEMP:
        t = tl.load(temp_ptr + row)
    else:
        t = 1.0
    chosen = _scaled(tl.load(row_ptr + tl.where(valid, token, 0)).to(tl.float32), t, HAS_TEMP)
    return valid, tl.where(valid, chosen, float("nan")), t


@triton.jit
def _keys(y, cols, ok):
    """64-bit keys ordering (value descending, then column ascending); NaN and masked lanes get
    the smallest key. -0.0 is keyed as +0.0 (they compare equal, so the lower id wins)."""
    y = tl.where(y == 0.0, 0.0, y)
    b = y.to(tl.int32, bitcast=True)
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    low = (~cols).to(tl.uint32, bitcast=True).to(tl.int64)        # 2**32 - 1 - column
    key = (o.to(tl.int64) << 32) | low
    return tl.where(ok & (y == y), key, _KEY_PAD)


@triton.jit
def _merge_top(a, b, K_PAD: tl.constexpr):
    """The best ``K_PAD`` of two sets of ``K_PAD`` keys (order of the inputs is irrelevant)."""
    both = tl.reshape(tl.join(a, b), [2 * K_PAD])
    return tl.topk(both, K_PAD)


@triton.jit
def _keys_at(row_ptr, cols, ok, t, HAS_TEMP: tl.constexpr):
    x = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return _keys(_scaled(x, t, HAS_TEMP), cols, ok)


@triton.jit
def _compact(sel, cols, dst):
    """Write the columns where ``sel`` holds to ``dst[0..)``, in column order."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(dst + pos, cols, mask=sel)


@triton.jit
def _tile_topk(y, cols, valid, row_ptr, t, cand_dst, start, vocab, top_k, TILE: tl.constexpr,
               HAS_TEMP: tl.constexpr, K_PAD: tl.constexpr, N_GROUPS: tl.constexpr, CAP: tl.constexpr):
    """The tile's best ``K_PAD`` keys (exact for its best ``top_k``; see the module docstring)."""
    real = valid & (y == y)
    yk = tl.where(real, y, float("-inf"))
    gmax = tl.max(tl.reshape(yk, [N_GROUPS, TILE // N_GROUPS]), axis=1)
    tau = tl.min(tl.topk(gmax, K_PAD), axis=0)
    # K_PAD groups have a maximum >= tau, so at least K_PAD >= top_k real logits are >= tau
    # (or tau = -inf and every real logit passes): the tile's best top_k all pass.
    ge = real & (yk >= tau)
    n_sel = tl.sum(ge.to(tl.int32), axis=0)
    if n_sel <= CAP:
        _compact(ge, cols, cand_dst)
    else:
        # Many ties at tau (a tile of -inf, say): only the top_k lowest columns equal to tau
        # can be selected.
        gt = real & (yk > tau)
        eq = real & (yk == tau)
        n_eq = tl.sum(eq.to(tl.int32), axis=0)
        n_sel = tl.sum(gt.to(tl.int32), axis=0) + tl.minimum(n_eq, top_k)
        if n_sel <= CAP:
            eq_i = eq.to(tl.int32)
            before = tl.cumsum(eq_i, axis=0) - eq_i
            _compact(gt | (eq & (before < top_k)), cols, cand_dst)
        else:
            n_sel = -1
    tl.debug_barrier()              # the compacted columns are read by other threads below
    j = tl.arange(0, CAP)
    if n_sel >= 0:
        ok = j < n_sel
        c = tl.load(cand_dst + j, mask=ok, other=0)
        best = tl.topk(_keys_at(row_ptr, c, ok, t, HAS_TEMP), K_PAD)
    else:
        best = tl.full([K_PAD], _KEY_PAD, tl.int64)
        for off in range(0, TILE, CAP):
            c = start + off + j
            best = _merge_top(best, tl.topk(_keys_at(row_ptr, c, c < vocab, t, HAS_TEMP), K_PAD), K_PAD)
    return best


@triton.jit
def _online_update(x, m, s):
    """Fold the ``[LINES, VEC]`` block ``x`` into the per-line running max ``m`` and sum ``s``
    (an online log-sum-exp: ``m' = max(m, max(x))``, ``s' = s * exp(m - m') + sum(exp(x - m'))``).
    Each thread owns whole lines of ``VEC`` contiguous logits (one 16-byte vector), so the line
    max and line sum stay inside the thread: no shuffles, no barriers."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * _LOG2E)                 # m = m_new = +inf: NaN, as it should
    terms = tl.exp2((x - m_new[:, None]) * _LOG2E)        # x = -inf: 0; x = NaN: NaN
    return m_new, s * scale + tl.sum(terms, axis=1)


@triton.jit
def _fold_block(x, chosen, t, m, s, count, HAS_TEMP: tl.constexpr):
    """Fold one whole loaded block into the running line maxima, sums and counts."""
    y = _scaled(x.to(tl.float32), t, HAS_TEMP)
    m, s = _online_update(y, m, s)
    return m, s, count + tl.sum((y >= chosen).to(tl.int32), axis=1)


@triton.jit
def _chunk_safe(row_ptr, cols, start, full_end, end, chosen, t, LINES: tl.constexpr, BLOCK: tl.constexpr,
                HAS_TEMP: tl.constexpr):
    """One chunk's partial ``(max, sum of exp(y - max), count of y >= chosen)``, element loads,
    exponentials as ``exp2((y - m) * log2(e))``: exact for any finite logits."""
    m = tl.full([LINES], _NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES], tl.int32)
    # Whole blocks: unmasked (16-byte vector loads when the rows are aligned).
    for off in tl.range(start, full_end, BLOCK, loop_unroll_factor=2):
        m, s, count = _fold_block(tl.load(row_ptr + off + cols), chosen, t, m, s, count, HAS_TEMP)
    # The partial last block, where there is one (only in a row's last chunk). A fully masked
    # block of -inf would leave finite m, s and count as they are, so it is skipped.
    if full_end < end:
        idx = full_end + cols
        inside = idx < end
        y = _scaled(tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32), t, HAS_TEMP)
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
        m, s = _online_update(y, m, s)
    big = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2((m - big) * _LOG2E), axis=0)   # a line whose max is +inf: NaN
    return big, total, tl.sum(count, axis=0)


@triton.jit
def _resum_safe(row_ptr, cols, start, end, LINES: tl.constexpr, BLOCK: tl.constexpr):
    """The max and sum of :func:`_chunk_safe` for the chunk ``[start, end)`` of a row (no
    temperature), in one plain masked loop: the combine kernel's rare path for chunks that
    :func:`_chunk_fast` flagged."""
    m = tl.full([LINES], _NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    for off in tl.range(start, end, BLOCK, loop_unroll_factor=1):
        idx = off + cols
        m, s = _online_update(tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32), m, s)
    big = tl.max(m, axis=0)
    return big, tl.sum(s * tl.exp2((m - big) * _LOG2E), axis=0)


@triton.jit
def _mc(m):
    """The offset of a line's exponents: ``m * log2(e)`` with ``m`` clamped to ``[-2**20, 2**20]``,
    so that its rounding error (at most ``2**20 * log2(e) * 2**-24`` < 0.1) keeps every exponent
    ``y * log2(e) - mc`` of the line's logits ``y <= m`` below 0.1: no term overflows. A line
    below ``-2**20`` only loses terms to underflow that are ``< 2**-150`` next to a chunk maximum
    above ``-2**20``; a chunk whose maximum is beyond ``+-2**20`` is flagged (see the chunk kernel)."""
    return tl.minimum(tl.maximum(m, -_TAME), _TAME) * _LOG2E


@triton.jit
def _online_fast(y, m, s):
    """:func:`_online_update` with one fused multiply-add per exponent: ``s`` sums
    ``2**(y * log2(e) - mc)`` with ``mc = _mc(m')`` (rescaled by ``2**(mc_old - mc)`` when the line
    maximum grows). The chunk's end multiplies each line's sum by ``2**(mc - big * log2(e))``
    (one rounding), which undoes ``mc``'s own rounding error: the result is that of
    :func:`_online_update` to within the rounding of the exponents."""
    m_new = tl.maximum(m, tl.max(y, axis=1))
    mc = _mc(m_new)
    terms = tl.sum(tl.exp2(tl.fma(y, _LOG2E, -mc[:, None])), axis=1)
    return m_new, s * tl.exp2(_mc(m) - mc) + terms


@triton.jit
def _ge_masks(w, chosen_w):
    """Per 32-bit word of two bfloat16 logits: ``0xFFFF`` in each half whose logit is ``>=`` the
    chosen one (``chosen_w`` holds it in both halves; NaN compares false), else 0. One packed
    compare per two logits (PTX ``set.ge.u32.bf16x2``, sm_90)."""
    return tl.inline_asm_elementwise("set.ge.u32.bf16x2 $0, $1, $2;", "=r,r,r", [w, chosen_w],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _chunk_fast(words, wcols, row_ptr, cols, start, full_end, end, chosen, chosen_w, LINES: tl.constexpr,
                BLOCK: tl.constexpr, PACKED_COUNT: tl.constexpr):
    """:func:`_chunk_safe` for aligned bfloat16 rows without a temperature: whole blocks read as
    32-bit words (two logits each, widened by a shift and a mask), exponentials by
    :func:`_online_fast`, the count by packed compares where ``PACKED_COUNT`` (else per logit).
    The maximum of a chunk of only -inf is -inf here (``_chunk_safe``: -FLT_MAX); the combine
    kernel treats both alike."""
    m = tl.full([LINES], float("-inf"), tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES], tl.int32)
    masks = tl.zeros([LINES], tl.uint32)
    for off in tl.range(start, full_end, BLOCK, loop_unroll_factor=2):
        w = tl.load(words + off // 2 + wcols)
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
        m, s = _online_fast(tl.join(lo, hi).reshape([LINES, BLOCK // LINES]), m, s)
        if PACKED_COUNT:
            masks += tl.sum(_ge_masks(w, chosen_w), axis=1)      # wraps: decoded below
        else:
            count += tl.sum((lo >= chosen).to(tl.int32) + (hi >= chosen).to(tl.int32), axis=1)
    if PACKED_COUNT:
        # masks = 0xFFFF * (n_lo + 65536 * n_hi) mod 2**32, and 0xFFFEFFFF is 0xFFFF's inverse
        # mod 2**32: the product is n_lo + 65536 * n_hi (each half counts at most
        # 4 * chunk_blocks < 2**16 logits: the host checks the plan).
        packed = masks * 0xFFFEFFFF
        count += ((packed & 0xFFFF) + (packed >> 16)).to(tl.int32)
    if full_end < end:
        idx = full_end + cols
        inside = idx < end
        y = tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32)
        count += tl.sum(((y >= chosen) & inside).to(tl.int32), axis=1)
        m, s = _online_fast(y, m, s)
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    # 2**(mc - big * log2(e)) in one rounding; a line whose max is +inf (or NaN sums) gives NaN.
    total = tl.sum(s * tl.exp2(tl.fma(-big_safe, _LOG2E, _mc(m))), axis=0)
    return big, total, tl.sum(count, axis=0)


# -- kernels ----------------------------------------------------------------------------------------

@triton.jit(
    do_not_specialize=["vocab", "row_stride", "chunk_blocks", "n_chunks", "group"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "temp_ptr", "part_m_ptr", "part_s_ptr",
                                    "part_c_ptr", "tok_y_ptr", "tok_ok_ptr"],
)
def logprob_rank_chunk_kernel(
    logits_ptr,         # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,            # [batch] int32/int64 token per row
    temp_ptr,           # [batch] float32 temperature (read when HAS_TEMP)
    part_m_ptr,         # [batch * n_chunks] float32 out: chunk maximum (a chunk of -inf: -FLT_MAX; WORDS: -inf)
    part_s_ptr,         # [batch * n_chunks] float32 out: sum of exp(y - max) (WORDS: -1 for a flagged chunk)
    part_c_ptr,         # [batch * n_chunks] int32 out: count of y >= y[token]
    tok_y_ptr,          # [batch] float32 out: the token's scaled logit (NaN for an invalid id)
    tok_ok_ptr,         # [batch] int32 out: whether the id is in [0, vocab)
    vocab,
    row_stride,         # elements between rows
    chunk_blocks,       # blocks of BLOCK logits per chunk
    n_chunks,           # chunks per row
    group,              # consecutive chunks per program (grid axis 1 = cdiv(n_chunks, group))
    BLOCK: tl.constexpr,    # logits per loop step
    VEC: tl.constexpr,      # logits per 16-byte vector (8 for 2-byte dtypes, 4 for float32)
    ALIGNED: tl.constexpr,  # logits_ptr and row_stride * itemsize are multiples of 16 bytes
    HAS_TEMP: tl.constexpr,
    WORDS: tl.constexpr,    # bfloat16, ALIGNED, no temperature: _chunk_fast
    PACKED_COUNT: tl.constexpr,  # with WORDS: packed compares (inline PTX; not in Triton's interpreter)
    GDC: tl.constexpr,      # sm_90+: the combine kernel may launch early (inline PTX; not in the interpreter)
):
    if GDC:
        _launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * group
    last = tl.minimum(first + group, n_chunks)
    row_ptr = logits_ptr + row * row_stride
    if ALIGNED:
        row_ptr = tl.multiple_of(row_ptr, 16)
    valid_tok, chosen, t = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    if first == 0:          # the row's token, for the combine kernel (it need not load it again)
        tl.store(tok_y_ptr + row, chosen)
        tl.store(tok_ok_ptr + row, valid_tok.to(tl.int32))
    LINES: tl.constexpr = BLOCK // VEC
    cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    if WORDS:
        words = row_ptr.to(tl.pointer_type(tl.int32))
        wcols = tl.arange(0, LINES)[:, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, :]
        bits = (chosen.to(tl.uint32, bitcast=True) >> 16)          # the token's bfloat16 bits
        chosen_w = tl.full([LINES, VEC // 2], 0, tl.uint32) + (bits | (bits << 16))
    # ``group`` (a runtime value: one compiled kernel for every batch) only says which program
    # computes which chunk; each chunk's partial is computed by the same instructions either way.
    for chunk in range(first, last):
        start = chunk * (chunk_blocks * BLOCK)
        n_here = tl.minimum(chunk_blocks * BLOCK, vocab - start)
        full_end = start + (n_here // BLOCK) * BLOCK
        end = start + n_here
        if WORDS:
            big, total, count = _chunk_fast(words, wcols, row_ptr, cols, start, full_end, end, chosen,
                                            chosen_w, LINES, BLOCK, PACKED_COUNT)
            # A finite maximum beyond +-2**20 (a chunk masked with finfo.min instead of -inf, say):
            # the clamped offsets may have lost the chunk's terms, so its sum is flagged (-1); the
            # combine kernel sums it again in the safe form if it can matter to the row (the count
            # is exact either way). Whether a chunk is flagged depends on its own logits alone.
            total = tl.where((tl.abs(big) > _TAME) & (tl.abs(big) < float("inf")), -1.0, total)
        else:
            big, total, count = _chunk_safe(row_ptr, cols, start, full_end, end, chosen, t, LINES, BLOCK,
                                            HAS_TEMP)
        part = row * n_chunks + chunk
        tl.store(part_m_ptr + part, big)
        tl.store(part_s_ptr + part, total)
        tl.store(part_c_ptr + part, count)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_tiles", "top_k"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "temp_ptr", "part_m_ptr", "part_s_ptr",
                                    "part_c_ptr", "part_k_ptr", "cand_ptr", "tok_y_ptr", "tok_ok_ptr"],
)
def logprob_rank_tile_kernel(
    logits_ptr,         # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,            # [batch] int32/int64 token per row
    temp_ptr,           # [batch] float32 temperature (read when HAS_TEMP)
    part_m_ptr,         # [batch * n_tiles] float32 out: tile maximum
    part_s_ptr,         # [batch * n_tiles] float32 out: sum of exp(y - max)
    part_c_ptr,         # [batch * n_tiles] int32 out: count of y >= y[token]
    part_k_ptr,         # [batch * n_tiles, K_PAD] int64 out: the tile's best keys (K_PAD > 0)
    cand_ptr,           # [batch * n_tiles, CAP] int32 scratch: candidate columns (K_PAD > 0)
    tok_y_ptr,          # [batch] float32 out: the token's scaled logit (NaN for an invalid id)
    tok_ok_ptr,         # [batch] int32 out: whether the id is in [0, vocab)
    vocab,
    row_stride,         # elements between rows
    n_tiles,            # programs per row
    top_k,
    TILE: tl.constexpr, LOG_TILE: tl.constexpr, HIGH_BITS: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_TEMP: tl.constexpr, K_PAD: tl.constexpr, N_GROUPS: tl.constexpr, CAP: tl.constexpr, TREE: tl.constexpr,
    GDC: tl.constexpr,
):
    if GDC:
        _launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_tiles
    start = ((pid - row * n_tiles) * TILE).to(tl.int32)
    row_ptr = logits_ptr + row * row_stride
    if ALIGNED:
        row_ptr = tl.multiple_of(row_ptr, 16)
    valid_tok, chosen, t = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    if start == 0:          # the row's token, for the combine kernel
        tl.store(tok_y_ptr + row, chosen)
        tl.store(tok_ok_ptr + row, valid_tok.to(tl.int32))
    cols = start + tl.arange(0, TILE)
    valid = cols < vocab
    if start + TILE <= vocab:
        # A whole tile: unmasked, so the loads are 16-byte vectors (a mask on a runtime vocab
        # would make every load a scalar one).
        x = tl.load(row_ptr + cols)
    else:
        x = tl.load(row_ptr + cols, mask=valid, other=float("-inf"))
    y = _scaled(x.to(tl.float32), t, HAS_TEMP)
    y = tl.where(valid, y, float("-inf"))
    m = tl.max(y, axis=0)                                   # NaN is skipped here, but poisons the sum
    m_safe = tl.where(m == float("-inf"), 0.0, m)           # a tile of -inf: sum 0, not NaN
    s = _tree_sum(tl.exp2((y - m_safe) * _LOG2E), LOG_TILE, HIGH_BITS, TREE)
    count = tl.sum(((y >= chosen) & valid).to(tl.int32), axis=0)
    tl.store(part_m_ptr + pid, m)
    tl.store(part_s_ptr + pid, s)
    tl.store(part_c_ptr + pid, count)
    if K_PAD > 0:
        best = _tile_topk(y, cols, valid, row_ptr, t, cand_ptr + pid * CAP, start, vocab, top_k, TILE,
                          HAS_TEMP, K_PAD, N_GROUPS, CAP)
        tl.store(part_k_ptr + pid * K_PAD + tl.arange(0, K_PAD), best)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_tiles", "top_k", "chunk_span"],
    do_not_specialize_on_alignment=["logits_ptr", "logprob_ptr", "rank_ptr", "topk_lp_ptr", "topk_id_ptr",
                                    "part_m_ptr", "part_s_ptr", "part_c_ptr", "part_k_ptr", "tok_y_ptr",
                                    "tok_ok_ptr"],
)
def logprob_rank_combine_kernel(
    logits_ptr,         # as in the chunk kernel (read only to re-sum flagged chunks, RESUM)
    logprob_ptr,        # [batch] float32 out
    rank_ptr,           # [batch] int32/int64 out
    topk_lp_ptr,        # [batch, top_k] float32 out (K_PAD > 0)
    topk_id_ptr,        # [batch, top_k] int32/int64 out (K_PAD > 0)
    part_m_ptr, part_s_ptr, part_c_ptr, part_k_ptr,
    tok_y_ptr, tok_ok_ptr,   # the token's scaled logit and validity, written by the first kernel
    vocab, row_stride, n_tiles, top_k,
    chunk_span,         # logits per chunk (read where RESUM)
    BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, K_PAD: tl.constexpr,
    KEY_TILES: tl.constexpr, TREE: tl.constexpr,
    RESUM: tl.constexpr,        # the chunk kernel ran _chunk_fast: partials with sum -1 are re-summed
    RESUM_BLOCK: tl.constexpr, VEC: tl.constexpr,   # the re-sum's block and 16-byte vector
    GDC: tl.constexpr,          # wait for the first kernel (launched as its programmatic dependent)
):
    if GDC:
        _wait_prerequisites()
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    chosen = tl.load(tok_y_ptr + row)
    valid = tl.load(tok_ok_ptr + row) != 0
    base = row * n_tiles
    j = tl.arange(0, BLOCK)
    big = float("-inf")
    flagged = 0
    for j0 in range(0, n_tiles, BLOCK):
        inside = j0 + j < n_tiles
        big = tl.maximum(big, tl.max(tl.load(part_m_ptr + base + j0 + j, mask=inside, other=float("-inf")), axis=0))
        if RESUM:
            flagged += tl.sum((tl.load(part_s_ptr + base + j0 + j, mask=inside, other=0.0) < 0).to(tl.int32), axis=0)
    if RESUM:
        if flagged > 0:
            # Rare: a flagged chunk (maximum beyond +-2**20) within 128 of the row's maximum is
            # summed again here; a flagged chunk further below adds s * 2**(< -184) = 0 as it is.
            LINES: tl.constexpr = RESUM_BLOCK // VEC
            cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
            for c in range(0, n_tiles):
                if (tl.load(part_s_ptr + base + c) < 0) & (tl.load(part_m_ptr + base + c) >= big - 128.0):
                    start = c * chunk_span
                    m_c, s_c = _resum_safe(row_ptr, cols, start, tl.minimum(start + chunk_span, vocab), LINES,
                                           RESUM_BLOCK)
                    tl.store(part_s_ptr + base + c, s_c)
            tl.debug_barrier()          # the re-summed partials are read by every thread below
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    total = 0.0
    count = 0
    for j0 in range(0, n_tiles, BLOCK):
        inside = j0 + j < n_tiles
        m = tl.load(part_m_ptr + base + j0 + j, mask=inside, other=float("-inf"))
        s = tl.load(part_s_ptr + base + j0 + j, mask=inside, other=0.0)
        total += _tree_sum(s * tl.exp2((m - big_safe) * _LOG2E), LOG_BLOCK, 0, TREE)
        count += tl.sum(tl.load(part_c_ptr + base + j0 + j, mask=inside, other=0), axis=0)
    lse = big + tl.log(total)                   # total == 0 only for a row of -inf: lse = -inf
    tl.store(logprob_ptr + row, tl.where(valid, chosen - lse, float("nan")))
    tl.store(rank_ptr + row, tl.where(valid, count, -1).to(rank_ptr.dtype.element_ty))
    if K_PAD > 0:
        kk = tl.arange(0, K_PAD)
        tt = tl.arange(0, KEY_TILES)
        best = tl.full([K_PAD], _KEY_PAD, tl.int64)
        for t0 in range(0, n_tiles, KEY_TILES):
            ptrs = part_k_ptr + (base + t0 + tt)[:, None] * K_PAD + kk[None, :]
            keys = tl.load(ptrs, mask=(t0 + tt < n_tiles)[:, None], other=_KEY_PAD)
            best = _merge_top(best, tl.topk(tl.reshape(keys, [KEY_TILES * K_PAD]), K_PAD), K_PAD)
        pad = best == _KEY_PAD
        o = (best >> 32).to(tl.int32)
        y = (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        col = ~(best.to(tl.int32))                  # the padding key decodes to -1
        out = row * top_k + kk
        keep = kk < top_k
        tl.store(topk_lp_ptr + out, tl.where(pad, float("nan"), y - lse), mask=keep)
        tl.store(topk_id_ptr + out, col.to(topk_id_ptr.dtype.element_ty), mask=keep)
