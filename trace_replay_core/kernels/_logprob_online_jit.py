"""The online reductions of the logprob kernels (:mod:`._logprob_rank_jit`), per 16-byte line (a
thread's own running values) and across a chunk's lines and a row's chunks.

Each line keeps its maximum ``m`` and ``s = sum(exp(y - m))``; with ``ENTROPY`` also
``u = sum(exp(y - m) * (y - m))``, every term <= 0, and a term whose exponential is 0 (a -inf
logit among them) adds exactly 0, never NaN (:func:`entropy_fold`). When the maximum grows from
``m`` to ``m'``, with ``c = exp(m - m')``: ``s' = c * s + new terms`` and
``u' = c * (u + (m - m') * s) + new terms``. Lines, then chunks, combine the same way relative to
the larger maximum ``big`` (:func:`entropy_sum`), and a row whose sum is ``S`` and ``u`` is ``U``
(both relative to its maximum) has entropy ``log(S) - U / S``: two terms >= 0 (``S >= 1``,
``U <= 0``), so nothing cancels. No -inf, NaN or +inf is special-cased: a row of only -inf has
``S = 0`` (entropy NaN), a NaN or a +inf makes ``S`` NaN. The element path folds with
:func:`online_update` and :func:`fold_lines`, the fused bfloat16 path with :func:`online_fast`
and :func:`fold_fast`; with ``ENTROPY`` false neither keeps ``u``.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)  # the element path's start: a chunk of -inf stays finite
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
TAME = tl.constexpr(2.0**20)  # the fused path clamps line maxima to +-TAME; a chunk beyond it is flagged


@triton.jit
def _fma_pairs(acc, t, d):
    """``acc + t[:, 0] * d[:, 0] + t[:, 1] * d[:, 1]`` for ``[LINES, 2]`` operands: two multiply-adds."""
    t0, t1 = tl.split(t)
    d0, d1 = tl.split(d)
    return tl.fma(t1, d1, tl.fma(t0, d0, acc))


@triton.jit
def _fma_line(acc, t, d):
    """``acc`` plus the sum of ``t * d`` along each line of ``[LINES, VEC]`` operands (VEC 4 or 8),
    as one chain of multiply-adds (the even columns, then the odd ones)."""
    te, to = tl.split(t.reshape([t.shape[0], t.shape[1] // 2, 2]))
    de, do = tl.split(d.reshape([d.shape[0], d.shape[1] // 2, 2]))
    if t.shape[1] == 8:
        tee, teo = tl.split(te.reshape([te.shape[0], 2, 2]))
        dee, deo = tl.split(de.reshape([de.shape[0], 2, 2]))
        toe, too = tl.split(to.reshape([to.shape[0], 2, 2]))
        doe, doo = tl.split(do.reshape([do.shape[0], 2, 2]))
        acc = _fma_pairs(_fma_pairs(acc, tee, dee), teo, deo)
        return _fma_pairs(_fma_pairs(acc, toe, doe), too, doo)
    else:
        return _fma_pairs(_fma_pairs(acc, te, de), to, do)


@triton.jit
def entropy_fold(u, s, shift, c, d, terms, SAFE: tl.constexpr):
    """Each line's ``c * (u + shift * s)`` plus its sum of ``terms * d`` (``[LINES, VEC]``), a zero
    ``c`` or term adding exactly 0 and a NaN staying NaN. Per logit one max and one multiply-add:
    ``d`` is clamped to ``-FLT_MAX`` (only -inf changes, and its term is 0), so a zero term times a
    finite ``d`` is 0, and a NaN logit's term is NaN whatever the clamp does with its ``d``. Per
    line, ``SAFE`` (the element path) tests ``c = 0``: there ``shift`` may be -inf, or ``shift * s``
    overflow where the maximum jumps by ~1e38; the fused path's ``shift`` is a difference of
    clamped offsets and its ``s`` and ``u`` are finite, so ``c = 0`` gives 0 as it is."""
    if SAFE:
        kept = tl.where(c == 0, 0.0, c * (u + shift * s))
    else:
        kept = c * (u + shift * s)
    return _fma_line(kept, terms, tl.maximum(d, NEG_FLT_MAX))


@triton.jit
def entropy_sum(u, s, shift, f):
    """``sum(f * (u + shift * s))`` over lines or chunks, ``f = exp(shift)`` each (a zero ``f``
    adds exactly 0)."""
    return tl.sum(tl.where(f == 0, 0.0, f * (u + shift * s)), axis=0)


@triton.jit
def online_update(x, m, s, u, ENTROPY: tl.constexpr):
    """Fold the ``[LINES, VEC]`` block ``x`` into each line's running max ``m``, sum ``s`` of
    ``exp(x - m)`` and, with ``ENTROPY``, ``u``, within the line's thread (``u`` is returned as
    it came without). A NaN never becomes a maximum but poisons the sum."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * LOG2E)  # m = m_new = +inf: NaN, as it should
    d = x - m_new[:, None]
    terms = tl.exp2(d * LOG2E)  # x = -inf: 0; x = NaN: NaN
    if ENTROPY:
        u = entropy_fold(u, s, m - m_new, scale, d, terms, True)
    return m_new, s * scale + tl.sum(terms, axis=1), u


@triton.jit
def fold_lines(m, s, u, ENTROPY: tl.constexpr):
    """A chunk's maximum, sum and (``ENTROPY``, else 0) ``u`` from :func:`online_update`'s line
    states (a line whose max is +inf: a NaN sum)."""
    big = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2((m - big) * LOG2E), axis=0)
    if ENTROPY:
        ent = entropy_sum(u, s, m - big, tl.exp2((m - big) * LOG2E))
    else:
        ent = 0.0
    return big, total, ent


@triton.jit
def _mc(m):
    """A fused line's exponent offset ``m * log2(e)``, ``m`` clamped to ``+-TAME``: its rounding
    error (< 0.1) keeps every exponent of the line's logits below 0.1, so no term overflows."""
    return tl.minimum(tl.maximum(m, -TAME), TAME) * LOG2E


@triton.jit
def online_fast(y, m, s, u, ENTROPY: tl.constexpr):
    """:func:`online_update` with one fused multiply-add per exponent: ``s`` sums ``t = 2**a``,
    ``a = y * log2(e) - mc`` with ``mc = _mc(m)``; :func:`fold_fast` rescales it in one rounding.

    ``u`` (``ENTROPY``) sums ``t * a``: the element path's ``u`` in log2 units against the line's
    offset. Exactly, ``y - m = (a + mc - m * log2(e)) * ln(2)`` and ``exp(y - m) = t * 2**(mc -
    m * log2(e))``, so the offset's rounding and clamp are a common term of every ``a`` that
    :func:`fold_fast` takes out with the offset itself. When the maximum grows, ``mc' = _mc(m')``:
    every ``a`` drops by ``mc' - mc`` and every ``t`` is scaled by ``c = 2**(mc - mc')``, so
    ``s' = c * s + sum(t')`` and ``u' = c * (u + (mc - mc') * s) + sum(t' * a')``: the element
    path's update with offsets for maxima (a line still at -inf has ``s = u = 0``: whatever
    ``c`` its clamped offset gives, it adds 0)."""
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
    """The fused path's chunk maximum, sum and (``ENTROPY``, else 0) ``u`` in natural units
    against that maximum ``big``: with ``e = mc - big * log2(e)`` per line, ``exp(y - big) = t *
    2**e`` and ``y - big = (a + e) * ln(2)``, so a line adds ``2**e * (u + e * s) * ln(2)`` (a
    chunk of only -inf: maximum -inf; a line whose max is +inf, or a NaN sum, gives NaN)."""
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    # 2**(mc - big * log2(e)) in one rounding; a line whose max is +inf (or NaN sums) gives NaN.
    total = tl.sum(s * tl.exp2(tl.fma(-big_safe, LOG2E, _mc(m))), axis=0)
    if ENTROPY:
        e = tl.fma(-big_safe, LOG2E, _mc(m))
        ent = entropy_sum(u, s, e, tl.exp2(e)) * LN2
    else:
        ent = 0.0
    return big, total, ent


@triton.jit
def entropy_of(total, ent):
    """A row's entropy from its sum ``S`` and ``U`` (both against its maximum): ``log(S) - U / S``."""
    return tl.log(total) - ent / total
