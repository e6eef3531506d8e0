"""The ``@triton.jit`` kernels of the logprob op's backward (contract, math and design:
:mod:`.logprob_backward`, which plans and launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_chunk_jit import LOG2E, scaled

__all__ = ["logprob_backward_kernel", "logprob_backward_combine_kernel"]


@triton.jit
def _dy(y, lse, g_all, h, g_h, ENTROPY: tl.constexpr):
    """``dL/dy`` without the one-hot terms: ``-p (g_all + g_H (log p + H))``, and ``log p``."""
    lp = y - lse
    p = tl.exp2(lp * LOG2E)
    if ENTROPY:  # a -inf logit: p = 0 adds 0 (not 0 * -inf); NaN stays NaN
        return tl.where(p == 0.0, 0.0, -p * (g_all + g_h * (lp + h))), lp
    return -p * g_all, lp


@triton.jit
def _y(x, inv_t, HAS_TEMP: tl.constexpr):
    """``x / T`` as ``x * (1 / T)``: within an ulp of the forward's division, which only the
    token's logit must repeat exactly (it recovers ``lse``)."""
    return x * inv_t if HAS_TEMP else x


@triton.jit
def _scale(dy, inv_t, HAS_TEMP: tl.constexpr):
    return dy * inv_t if HAS_TEMP else dy


@triton.jit
def _row_lse(row_ptr, vocab, t, BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr):
    """The row's log-sum-exp reduced again (two reads; the rare rows whose forward outputs do
    not give it): NaN for a NaN or ``+inf`` entry, ``-inf`` for a row of ``-inf``."""
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in tl.range(0, vocab, BLOCK, loop_unroll_factor=1):
        y = scaled(
            tl.load(row_ptr + off + cols, mask=off + cols < vocab, other=float("-inf")).to(tl.float32), t, HAS_TEMP
        )
        m = tl.maximum(m, y)
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    s = tl.zeros([BLOCK], tl.float32)
    for off in tl.range(0, vocab, BLOCK, loop_unroll_factor=1):
        y = scaled(
            tl.load(row_ptr + off + cols, mask=off + cols < vocab, other=float("-inf")).to(tl.float32), t, HAS_TEMP
        )
        s += tl.exp2((y - big_safe) * LOG2E)  # NaN and +inf: NaN
    return big + tl.log(tl.sum(s, axis=0))


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "grad_row_stride", "chunk_blocks", "top_k"],
    do_not_specialize_on_alignment=(
        "logits_ptr ids_ptr argmax_ptr temp_ptr lp_ptr glp_ptr tk_ids_ptr tk_lp_ptr gtk_ptr ent_ptr gent_ptr "
        "grad_ptr part_ptr"
    ).split(),
)
def logprob_backward_kernel(
    logits_ptr,  # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,  # [batch] int32/int64 token per row
    argmax_ptr,  # [batch] greedy token per row (ARGMAX: a negative id is scored as it; else None)
    temp_ptr,  # [batch] float32 temperature (HAS_TEMP; else None)
    lp_ptr,  # [batch] float32: the forward's logprobs
    glp_ptr,  # [batch] float32 upstream gradient of the logprobs (HAS_GLP; else None)
    tk_ids_ptr,  # [batch, top_k] the forward's top-k ids (TOPK; else None)
    tk_lp_ptr,  # [batch, top_k] float32 the forward's top-k logprobs (TOPK; else None)
    gtk_ptr,  # [batch, top_k] float32 their upstream gradient (GTOPK; else None)
    ent_ptr,  # [batch] float32 the forward's entropy (ENTROPY; else None)
    gent_ptr,  # [batch] float32 its upstream gradient (ENTROPY; else None)
    grad_ptr,  # [batch, grad_row_stride] out: the gradient of the logits, their dtype
    part_ptr,  # [batch * n_chunks] float32 out: each chunk's sum of dL/dy (y - lse) (TEMP_GRAD)
    vocab,
    row_stride,
    grad_row_stride,
    chunk_blocks,  # blocks of BLOCK logits per chunk
    top_k,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,  # every row of the logits and the gradient starts on 16 bytes
    K_PAD: tl.constexpr,  # top_k rounded up to a power of two (1 without top-k)
    TOPK: tl.constexpr,
    NP: tl.constexpr,  # one-hot places: the token and the top-k ids, a power of two
    HAS_TEMP: tl.constexpr,
    ARGMAX: tl.constexpr,
    HAS_GLP: tl.constexpr,
    GTOPK: tl.constexpr,
    ENTROPY: tl.constexpr,
    TEMP_GRAD: tl.constexpr,
):
    """Grid ``(batch, n_chunks)``: program ``(row, chunk)`` writes the gradient of the row's
    columns ``[chunk * chunk_blocks * BLOCK, ...)``: the dense part in one pass over full blocks and a masked
    tail, then (after a barrier) the one-hot places that fall in the chunk, again."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row * row_stride
    out_ptr = grad_ptr + row * grad_row_stride
    if ALIGNED:
        row_ptr = tl.multiple_of(row_ptr, 16)
        out_ptr = tl.multiple_of(out_ptr, 16)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    if ARGMAX:
        tok = tl.where(tok < 0, tl.load(argmax_ptr + row).to(tl.int64), tok)
    valid = (tok >= 0) & (tok < vocab)
    if HAS_TEMP:  # T not finite and > 0: NaN, as the forward (the row reads as NaN logits)
        t = tl.load(temp_ptr + row)
        t = tl.where((t > 0.0) & (t < float("inf")), t, float("nan"))
    else:
        t = 1.0
    y_tok = scaled(tl.load(row_ptr + tl.where(valid, tok, 0)).to(tl.float32), t, HAS_TEMP)
    lse = tl.where(valid, y_tok - tl.load(lp_ptr + row), float("nan"))
    if HAS_GLP:
        g_tok = tl.where(valid, tl.load(glp_ptr + row), 0.0)
    else:
        g_tok = 0.0  # an id out of range: a constant NaN, no gradient
    q = tl.arange(0, NP)
    kq = q - 1
    in_k = (kq >= 0) & (kq < top_k)
    if TOPK:
        ids_q = tl.load(tk_ids_ptr + row * top_k + kq, mask=in_k, other=-1).to(tl.int64)
        # the top-1 logprob lies in [-log vocab, 0]: the most exact recovery of lse
        id0 = tl.load(tk_ids_ptr + row * top_k)
        y0 = scaled(tl.load(row_ptr + tl.where(id0 >= 0, id0, 0)).to(tl.float32), t, HAS_TEMP)
        lse0 = y0 - tl.load(tk_lp_ptr + row * top_k)
        lse = tl.where((id0 >= 0) & (tl.abs(lse0) < float("inf")), lse0, lse)
    else:
        ids_q = tl.full([NP], -1, tl.int64)
    ids_q = tl.where(q == 0, tl.where(valid, tok, -1), ids_q)
    if GTOPK:
        g_q = tl.load(gtk_ptr + row * top_k + kq, mask=in_k, other=0.0)
        g_q = tl.where(ids_q >= 0, g_q, 0.0)
    else:
        g_q = tl.zeros([NP], tl.float32)
    g_q = tl.where(q == 0, g_tok, g_q)
    g_all = tl.sum(g_q, axis=0)
    # whether the row has a gradient that depends on its logits (a boolean scalar tensor)
    if HAS_GLP:
        need = valid
    else:
        need = tok != tok
    if GTOPK or ENTROPY:
        need = tok == tok
    if ENTROPY:
        h = tl.load(ent_ptr + row)
        g_h = tl.load(gent_ptr + row)
    else:
        h = 0.0
        g_h = 0.0
    redo = need & ~(tl.abs(lse) < float("inf"))  # no finite source: reduce the row again
    if HAS_TEMP:
        redo = redo & (t == t)
        need = need | (t != t)  # a bad temperature: NaN gradients
    if redo:
        lse = _row_lse(row_ptr, vocab, t, BLOCK, HAS_TEMP)
    inv_t = 1.0 / t  # 1 / NaN: NaN; the dense columns scale by it (the token's logit above as the forward)
    lo = chunk * chunk_blocks * BLOCK  # a multiple of BLOCK: with ALIGNED, 16-byte vectors
    hi = tl.minimum(lo + chunk_blocks * BLOCK, vocab)
    full_end = lo + (hi - lo) // BLOCK * BLOCK
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in tl.range(lo, full_end, BLOCK):
        y = _y(tl.load(row_ptr + off + cols).to(tl.float32), inv_t, HAS_TEMP)
        dy, lp = _dy(y, lse, g_all, h, g_h, ENTROPY)
        dy = tl.where(need, dy, 0.0)
        tl.store(out_ptr + off + cols, _scale(dy, inv_t, HAS_TEMP).to(grad_ptr.dtype.element_ty))
        if TEMP_GRAD:
            acc += tl.where(dy != 0.0, dy * lp, 0.0)
    if full_end < hi:
        m = full_end + cols < hi
        y = _y(tl.load(row_ptr + full_end + cols, mask=m, other=0.0).to(tl.float32), inv_t, HAS_TEMP)
        dy, lp = _dy(y, lse, g_all, h, g_h, ENTROPY)
        dy = tl.where(need, dy, 0.0)
        tl.store(out_ptr + full_end + cols, _scale(dy, inv_t, HAS_TEMP).to(grad_ptr.dtype.element_ty), mask=m)
        if TEMP_GRAD:
            acc += tl.where(m & (dy != 0.0), dy * lp, 0.0)
    # The one-hot places of this chunk: the dense value plus every gradient at that id, stored
    # again once the block stores above are done (a barrier orders them within the program).
    tl.debug_barrier()
    here = (ids_q >= lo) & (ids_q < hi) & (q * 0 + need.to(tl.int32) != 0)  # a vector of bools (the interpreter)
    pos = tl.where(here, ids_q, lo)
    y_q = _y(tl.load(row_ptr + pos, mask=here, other=0.0).to(tl.float32), inv_t, HAS_TEMP)
    dy_q, lp_q = _dy(y_q, lse, g_all, h, g_h, ENTROPY)
    same = (ids_q[:, None] == ids_q[None, :]) & here[None, :]
    onehot = tl.sum(tl.where(same, g_q[None, :], 0.0), axis=1)
    tl.store(
        out_ptr + pos, _scale(dy_q + onehot, inv_t, HAS_TEMP).to(grad_ptr.dtype.element_ty), mask=here & (onehot != 0.0)
    )
    if TEMP_GRAD:
        fix = tl.sum(tl.where(here & (g_q != 0.0), g_q * lp_q, 0.0), axis=0)
        tl.store(part_ptr + row * tl.num_programs(1) + chunk, tl.sum(acc, axis=0) + fix)


@triton.jit(do_not_specialize=["n_chunks"], do_not_specialize_on_alignment=["part_ptr", "temp_ptr", "grad_t_ptr"])
def logprob_backward_combine_kernel(part_ptr, temp_ptr, grad_t_ptr, n_chunks, BLOCK: tl.constexpr):
    """Grid ``(batch,)``: ``grad_temperature[row] = -(1 / T) * sum of the row's chunk partials``,
    added in one order fixed by ``n_chunks`` (a NaN T: NaN)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    parts = tl.load(part_ptr + row * n_chunks + j, mask=j < n_chunks, other=0.0)
    t = tl.load(temp_ptr + row)
    t = tl.where((t > 0.0) & (t < float("inf")), t, float("nan"))
    tl.store(grad_t_ptr + row, -tl.sum(parts, axis=0) / t)
