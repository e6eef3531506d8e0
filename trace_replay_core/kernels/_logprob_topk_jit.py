"""Top-k selection of the logprob chunk kernel: each program finds the best ``K_PAD`` keys of the
logits it streamed, reading back only what can be among them.

A key orders (value descending, then id ascending) as one 64-bit integer, so selection is by a
total order: the same set whatever order the candidates are found in. The filter, after the
program's one streaming pass (which leaves in registers, per 16-byte line, its maximum over the
program's blocks ``g1``, the block where it was first reached ``gab`` and the maximum over the
line's other blocks ``g2``: ``track_lines``):

1. ``tau`` = the ``top_k``-th largest of ``SEL`` group maxima (each the maximum of a few lines):
   ``top_k`` distinct logits are ``>= tau``, so the program's best ``top_k`` are all ``>= tau``.
2. Vectors: only lines with ``g1 >= tau`` can hold a logit ``>= tau``, and only in their vector
   at ``gab`` unless ``g2 >= tau`` too (then in any of their blocks). When at most ``CAP_P``
   vectors are needed (the common case: about ``top_k``), they are read back (the program's data
   is still in cache) and their logits ``>= tau`` compacted into ``CAP`` slots of the workspace.
3. Otherwise (many lines tie at ``tau``: a row masked with -inf, say), or when more than ``CAP``
   logits pass, the program's logits are read back in column order and compacted with the ties at
   ``tau`` cut to the ``top_k`` lowest columns (only those can be selected).
4. If more than ``CAP`` logits are still above ``tau``, the program's logits are merged piece
   by piece (``PIECE`` keys at a time): exact, slow, for rows whose large values cluster.

Steps 2-4 end in the same exact best ``K_PAD`` keys of the candidates (all of them, unsorted,
when there are no more than ``K_PAD``), among which are the program's best ``top_k``; the combine
kernel keeps the row's best ``K_PAD`` of all programs', sorted.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._logprob_chunk_jit import scaled
from ._logprob_online_jit import NEG_FLT_MAX

KEY_PAD = tl.constexpr(-(2**63))  # the smallest key: padding, NaN, masked lanes
PAIRS = tl.constexpr(32)  # candidate vectors read back per step
RESCAN = tl.constexpr(512)  # logits per step of the rescan (step 3)
PIECE = tl.constexpr(256)  # logits per merge of the piecewise fallback (step 4)


@triton.jit
def keys_of(y, cols, ok):
    """64-bit keys ordering (value descending, then column ascending); NaN and masked lanes get
    the smallest key. -0.0 is keyed as +0.0 (they compare equal, so the lower id wins)."""
    y = tl.where(y == 0.0, 0.0, y)
    b = y.to(tl.int32, bitcast=True)
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    low = (~cols).to(tl.uint32, bitcast=True).to(tl.int64)  # 2**32 - 1 - column
    key = (o.to(tl.int64) << 32) | low
    return tl.where(ok & (y == y), key, KEY_PAD)


@triton.jit
def merge_top(a, b, K_PAD: tl.constexpr):
    """The best ``K_PAD`` of two sets of ``K_PAD`` keys (order of the inputs is irrelevant)."""
    both = tl.reshape(tl.join(a, b), [2 * K_PAD])
    return tl.topk(both, K_PAD)


@triton.jit
def _load_scaled(row_ptr, cols, ok, t, HAS_TEMP: tl.constexpr):
    return scaled(tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32), t, HAS_TEMP)


@triton.jit
def _compact_capped(sel, vals, dst, n, CAP: tl.constexpr):
    """Write ``vals`` where ``sel`` holds to ``dst[n..CAP)``, in index order (what falls beyond
    ``CAP`` is dropped); returns how many were selected, dropped ones included."""
    s = tl.reshape(sel, [sel.numel]).to(tl.int32)
    pos = n + tl.cumsum(s, axis=0) - 1
    tl.store(dst + pos, tl.reshape(vals, [sel.numel]), mask=(s != 0) & (pos < CAP))
    return tl.sum(s, axis=0)


@triton.jit
def _tau(g1, top_k, LINES: tl.constexpr, SEL: tl.constexpr, K_PAD: tl.constexpr):
    """The ``top_k``-th largest of ``SEL`` group maxima (lines ``g, g + SEL, ...`` per group: one
    thread's lines, so the first reduction stays in registers); -inf where that is ``-FLT_MAX``
    (the element path's start value, not a logit) or when there are fewer than ``K_PAD`` groups."""
    if SEL >= K_PAD:
        g = tl.max(tl.reshape(g1, [LINES // SEL, SEL]), axis=0)
        top = tl.topk(g, K_PAD)  # sorted, largest first
        tau = tl.max(tl.where(tl.arange(0, K_PAD) == top_k - 1, top, float("-inf")), axis=0)
        return tl.where(tau <= NEG_FLT_MAX, float("-inf"), tau)
    else:
        return float("-inf")


@triton.jit
def _from_vectors(
    row_ptr,
    lo,
    hi,
    g1,
    g2,
    gab,
    tau,
    t,
    pairs_dst,
    cand_dst,
    LINES: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP_P: tl.constexpr,
    PAIRS: tl.constexpr,
    CAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
):
    """Step 2: the logits ``>= tau`` of the vectors that can hold one, into ``cand_dst``; their
    number, or -1 if more than ``CAP_P`` vectors or ``CAP`` logits would be needed. A line with
    ``g1 >= tau`` needs its vector at ``gab`` alone when ``g2 < tau``, else all its blocks."""
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
            y = _load_scaled(row_ptr, cols, ok, t, HAS_TEMP)
            ge = ok & (y >= tau)
            n += _compact_capped(ge, keys_of(y, cols, ge), cand_dst, n, CAP)
        if n > CAP:
            n = -1
    return n


@triton.jit
def _rescan(row_ptr, lo, hi, tau, t, top_k, cand_dst, CAP: tl.constexpr, RESCAN: tl.constexpr, HAS_TEMP: tl.constexpr):
    """Step 3: the logits ``> tau`` and the ``top_k`` lowest columns ``== tau``, into
    ``cand_dst``; their number, or -1 if more than ``CAP``."""
    tl.debug_barrier()  # step 2 may have written cand_dst: its stores come first
    j = tl.arange(0, RESCAN)
    n_sel = 0
    n_eq = 0
    for off in range(lo, hi, RESCAN):
        cols = off + j
        ok = cols < hi
        y = _load_scaled(row_ptr, cols, ok, t, HAS_TEMP)
        eq = (ok & (y == tau)).to(tl.int32)
        before = n_eq + tl.cumsum(eq, axis=0) - eq
        sel = (ok & (y > tau)) | ((eq != 0) & (before < top_k))
        n_sel += _compact_capped(sel, keys_of(y, cols, sel), cand_dst, n_sel, CAP)
        n_eq += tl.sum(eq, axis=0)
    return tl.where(n_sel <= CAP, n_sel, -1)


@triton.jit
def _pieces(row_ptr, lo, hi, t, K_PAD: tl.constexpr, PIECE: tl.constexpr, HAS_TEMP: tl.constexpr):
    """Step 4: the best ``K_PAD`` keys of ``[lo, hi)``, merged ``PIECE`` logits at a time."""
    best = tl.full([K_PAD], KEY_PAD, tl.int64)
    j = tl.arange(0, PIECE)
    for off in range(lo, hi, PIECE):
        cols = off + j
        ok = cols < hi
        best = merge_top(best, tl.topk(keys_of(_load_scaled(row_ptr, cols, ok, t, HAS_TEMP), cols, ok), K_PAD), K_PAD)
    return best


@triton.jit
def program_topk(row_ptr, lo, hi, track, t, top_k, dst, LINES, VEC, BLOCK, SEL, K_PAD, HAS_TEMP):
    """Write the best ``K_PAD`` keys of columns ``[lo, hi)`` of the row (exact for the best
    ``top_k``) to ``out[0:K_PAD]``, padded with ``KEY_PAD``, in no particular order where no more than ``K_PAD``
    pass the filter (the combine kernel sorts them); ``g1``, ``g2``,
    ``gab``: the line tracking of ``track_lines`` over those columns. (Threshold and order by counting all pairs
    instead of by sorting networks measured 2.4x slower.)"""
    g1, g2, gab = track
    pairs_dst, cand_dst, out = dst
    CAP_P: tl.constexpr = 4 * K_PAD  # candidate vectors, then candidate logits, kept per program
    CAP: tl.constexpr = 2 * K_PAD
    tau = _tau(g1, top_k, LINES, SEL, K_PAD)
    n = _from_vectors(
        row_ptr, lo, hi, g1, g2, gab, tau, t, pairs_dst, cand_dst, LINES, VEC, BLOCK, CAP_P, PAIRS, CAP, HAS_TEMP
    )
    if n < 0:
        n = _rescan(row_ptr, lo, hi, tau, t, top_k, cand_dst, CAP, RESCAN, HAS_TEMP)
    kk = tl.arange(0, K_PAD)
    if n >= 0:
        tl.debug_barrier()  # the candidates were written by other threads
        if n <= K_PAD:
            # All of them fit (the common case): written as they are, padded; the combine kernel
            # sorts every program's keys anyway.
            tl.store(out + kk, tl.load(cand_dst + kk, mask=kk < n, other=KEY_PAD))
        else:
            j = tl.arange(0, CAP)
            keys = tl.load(cand_dst + j, mask=j < n, other=KEY_PAD)
            tl.store(out + kk, tl.topk(keys, K_PAD))
    else:
        tl.store(out + kk, _pieces(row_ptr, lo, hi, t, K_PAD, PIECE, HAS_TEMP))
