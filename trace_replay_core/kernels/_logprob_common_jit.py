"""Device helpers that every part of the logprob-and-rank op's ``@triton.jit`` code shares: its
constants, the temperature, and the online log-sum-exp of one block."""

from __future__ import annotations

import triton
import triton.language as tl

NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)  # a chunk of only -inf keeps a finite maximum
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def scaled(x, t, HAS_TEMP: tl.constexpr):
    """``x / t`` where there is a temperature (IEEE division, as ``logits / T`` in torch and
    numpy), else ``x``."""
    if HAS_TEMP:
        return tl.math.div_rn(x, t)
    else:
        return x


@triton.jit
def stream_load(ptr, mask):
    """Load the logits (or words) at ``ptr`` that the chunk kernel reads once, 0 where ``mask`` is
    given and false, marked evict-first in L1 and L2 (the lines are the first to go when the
    caches need room; the top-k read-back still finds its few vectors in L2 often enough)."""
    if mask is None:
        return tl.load(ptr, eviction_policy="evict_first")
    else:
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def online_update(x, m, s):
    """Fold the ``[LINES, VEC]`` block ``x`` into the per-line running max ``m`` and sum ``s``
    (an online log-sum-exp: ``m' = max(m, max(x))``, ``s' = s * exp(m - m') + sum(exp(x - m'))``).
    For 16-byte aligned rows each thread owns whole lines of ``VEC`` contiguous logits (one
    16-byte vector), so the line max and line sum stay inside the thread: no shuffles, no
    barriers (unaligned rows are shifted into the same lines first, ``SHIFT``). A NaN never
    becomes a line maximum (IEEE maxNum), but poisons the sum."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * LOG2E)  # m = m_new = +inf: NaN, as it should
    terms = tl.exp2((x - m_new[:, None]) * LOG2E)  # x = -inf: 0; x = NaN: NaN
    return m_new, s * scale + tl.sum(terms, axis=1)


@triton.jit
def track_lines(y, off, g1, g2, gab, TRACK: tl.constexpr):
    """With ``TRACK`` (top-k), fold the ``[LINES, VEC]`` block ``y`` that starts at column ``off``
    into each line's running maximum ``g1``, the block where it was first reached ``gab`` (its
    starting column) and the maximum over the line's other blocks ``g2``. A line's logits
    ``>= tau`` then lie in its vector at ``gab`` alone when ``g2 < tau`` (top-k reads back that one
    vector). Without ``TRACK``, the inputs are returned as they are."""
    if TRACK:
        bm = tl.max(y, axis=1)
        up = bm > g1
        g2 = tl.where(up, g1, tl.maximum(g2, bm))
        gab = tl.where(up, off, gab)
        g1 = tl.maximum(g1, bm)
    return g1, g2, gab


INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def argmax_lines(y, off, ag, ab):
    """Fold the ``[LINES, VEC]`` block ``y`` that starts at column ``off`` into each line's
    running maximum ``ag`` (never NaN: maxNum) and the block where it was first reached ``ab``.
    Returns ``(up, ag, ab)``, ``up`` telling the lines whose maximum grew in this block."""
    bm = tl.max(y, axis=1)
    up = bm > ag
    return up, tl.maximum(ag, bm), tl.where(up, off, ab)


@triton.jit
def argmax_chunk(row_ptr, cols, end, ag, ab, count, t, greedy, HAS_TEMP: tl.constexpr):
    """At a chunk's end, from the line tracking of :func:`argmax_lines`: the chunk's largest
    non-NaN ``y`` (-inf if none), the lowest column holding it (``INT32_MAX`` if none: every
    logit NaN), and the count the chunk stores. For a greedy row each line's ``count`` holds the
    ties at the line's own maximum, so the chunk's count is the sum over the lines that reach the
    chunk's maximum; else the plain sum. The column is found by reading back, for the lines that
    reach the maximum (usually one), the one 16-byte vector where they first reached it."""
    amax = tl.max(ag, axis=0)
    cand = ag == amax
    idx = ab[:, None] + cols
    v = scaled(tl.load(row_ptr + idx, mask=cand[:, None] & (idx < end), other=float("nan")).to(tl.float32), t, HAS_TEMP)
    acol = tl.min(tl.min(tl.where(v == amax, idx, INT32_MAX), axis=1), axis=0)
    ties = tl.sum(tl.where(cand, count, 0), axis=0)
    return amax, acol, tl.where(greedy, ties, tl.sum(count, axis=0))
