"""``token_logprob_rank`` for JAX arrays: logprob, rank and optional top-k of one token per
row, eager or in ``jax.jit``: the argument checks, ``method="jnp"`` and the public function.

Two implementations of one contract (the core's, see
:func:`trace_replay_core.token_logprob_rank`):

- ``method="kernel"`` (the default): the core's Triton kernels, which read each logit once and
  reduce in an order fixed by the vocabulary (batch-invariant: a row gives the same bits in any
  batch), run on XLA's own stream through ``jax.experimental.buffer_callback``
  (:mod:`.logprob_callback`); on the CPU the same callback runs the core's numpy backend (row by
  row, also batch-invariant) on XLA's host buffers. Differentiable: a ``jax.custom_vjp`` runs the
  core's backward kernel the same way (:mod:`.logprob_grad`); reverse mode, first order only
  (``jax.jvp``, ``jax.jacfwd`` and ``jax.hessian`` need ``method="jnp"``).
- ``method="jnp"``: the same arithmetic in ``jax.numpy`` (a max, a sum of exponentials, a
  gather, a count, ``lax.top_k``), fused by XLA into the surrounding program; it reads the
  logits more than once, but needs no callback; JAX differentiates it. It is *not*
  promised to be batch-invariant: XLA picks how to split a row's reduction from the whole
  shape, so the last bits of a row's logprob may change with the batch size.

With ``argmax=True`` either method also returns each row's greedy token from the same pass
and scores rows whose token id is negative as that token: a greedy decode step reads the
logits once (see :func:`token_logprob_rank`). With ``entropy=True`` either method also returns
each row's entropy (the kernel method from the same read).

``bench/logprob_rank.py`` measures both inside ``jax.jit`` next to the torch versions.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_replay_core import LOGITS_DTYPES, MAX_VOCAB, TOKEN_DTYPES, check_top_k

from .guards import check_fits_int32
from .logprob_grad import kernel_logprob_rank
from .logprob_results import (
    LogprobRank,
    LogprobRankArgmax,
    LogprobRankArgmaxEntropy,
    LogprobRankEntropy,
    LogprobRankTopK,
    LogprobRankTopKArgmax,
    LogprobRankTopKArgmaxEntropy,
    LogprobRankTopKEntropy,
    LogprobResult,
    named_result,
)

__all__ = [
    "token_logprob_rank",
    "METHODS",
    "LogprobRank",
    "LogprobRankTopK",
    "LogprobRankArgmax",
    "LogprobRankTopKArgmax",
    "LogprobRankEntropy",
    "LogprobRankTopKEntropy",
    "LogprobRankArgmaxEntropy",
    "LogprobRankTopKArgmaxEntropy",
]

METHODS = ("kernel", "jnp")
_TOKEN_DTYPES = tuple(np.dtype(d) for d in TOKEN_DTYPES)


def _check(logits: Any, token_ids: Any, method: Any) -> tuple[int, int]:
    """Argument checks on shapes and dtypes (trace time); returns (batch, vocab)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (got {method!r})")
    for name, x in (("logits", logits), ("token_ids", token_ids)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX or numpy array (got {type(x).__name__})")
    shape = tuple(logits.shape)
    if len(shape) != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(shape)})")
    if np.dtype(logits.dtype).name not in LOGITS_DTYPES:
        raise TypeError(f"logits must have dtype {' or '.join(LOGITS_DTYPES)} (got {np.dtype(logits.dtype).name})")
    batch, vocab = shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(
            f"logits must have between 1 and {MAX_VOCAB} columns (the vocabulary) (got shape {list(shape)})"
        )
    ids_shape = tuple(token_ids.shape)
    if ids_shape not in ((batch,), (batch, 1)):
        raise ValueError(
            f"token_ids must be [batch] or [batch, 1] with batch = {batch}, one token per row "
            f"(got shape {list(ids_shape)})"
        )
    if np.dtype(token_ids.dtype) not in _TOKEN_DTYPES:
        raise TypeError(f"token_ids must have dtype int32 or int64 (got {np.dtype(token_ids.dtype).name})")
    check_fits_int32(token_ids, "token_ids")  # an int64 numpy id JAX would wrap without x64
    return batch, vocab


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (got {type(value).__name__} {value!r})")
    return bool(value)


def _temperature(temperature: Any, batch: int) -> Any | None:
    """None, or a float32 [batch] array (a float is broadcast). Values are never checked: a T
    that is not finite and > 0 scores its row as NaN logits, in both methods."""
    if temperature is None:
        return None
    if isinstance(temperature, numbers.Real) and not isinstance(temperature, bool):
        return jnp.full((batch,), float(temperature), jnp.float32)
    if not hasattr(temperature, "shape") or not hasattr(temperature, "dtype"):
        raise TypeError(f"temperature must be None, a float or a [batch] array (got {type(temperature).__name__})")
    if tuple(temperature.shape) != (batch,):
        raise ValueError(f"temperature must be [batch] with batch = {batch} (got shape {list(temperature.shape)})")
    if np.dtype(temperature.dtype) != np.float32:
        raise TypeError(f"temperature must have dtype float32 (got {np.dtype(temperature.dtype).name})")
    return temperature


# -- method="jnp" -------------------------------------------------------------------------------


def _jnp_logprob_rank(
    logits: jax.Array,
    ids: jax.Array,
    temperature: jax.Array | None,
    top_k: int,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobResult:
    """The contract in jnp ops: float32 log-sum-exp with the row maximum subtracted, a count of
    ``y >= y[t]`` (IEEE: NaN never counts), NaN/-1 for an id outside ``[0, vocab)``, and
    ``lax.top_k`` (ties: the lower index first) with NaN ranked as ``-inf`` and reported as -1.
    With ``argmax``: the first entry equal to the largest non-NaN ``y`` (as
    ``greedy_argmax_reference``: a row of NaN and ``-inf`` gives its first ``-inf``, which a plain
    argmax with NaN as ``-inf`` would not; an all-NaN row gives 0), and negative ids scored as it.
    With ``entropy``: ``log(S) - U / S`` over ``d = y - max`` (``S = sum(exp(d))``, ``U =
    sum(exp(d) * d)``, a zero ``exp(d)`` adding 0 and no gradient), NaN where the logprob has no
    normaliser."""
    vocab = logits.shape[1]
    y = logits.astype(jnp.float32)
    if temperature is not None:  # T not finite and > 0: NaN, the row reads as NaN logits (as the kernels)
        t = temperature.astype(jnp.float32)
        y = y / jnp.where(jnp.isfinite(t) & (t > 0), t, jnp.nan)[:, None]
    ids = ids.reshape(-1)
    greedy = None
    if argmax:
        top = jax.lax.stop_gradient(jnp.max(jnp.where(jnp.isnan(y), -jnp.inf, y), axis=1))
        greedy = jnp.argmax(y == top[:, None], axis=1).astype(jnp.int32)  # no entry equal: 0
        ids = jnp.where(ids < 0, greedy.astype(ids.dtype), ids)
    valid = (ids >= 0) & (ids < vocab)
    safe = jnp.where(valid, ids, 0).astype(jnp.int32)
    chosen = jnp.take_along_axis(y, safe[:, None], axis=1)[:, 0]
    chosen = jnp.where(valid, chosen, jnp.nan)
    m = jax.lax.stop_gradient(jnp.max(y, axis=1))  # NaN or +inf in the row -> NaN sum
    lse = m + jnp.log(jnp.sum(jnp.exp(y - m[:, None]), axis=1))
    logprob = jnp.where(valid, chosen - lse, jnp.nan)
    rank = jnp.sum(y >= jax.lax.stop_gradient(chosen)[:, None], axis=1, dtype=jnp.int32)
    rank = jnp.where(valid, rank, -1).astype(jnp.int32)
    extra: tuple = (greedy,) if argmax else ()
    if entropy:  # all -inf: m = -inf, d NaN; NaN or +inf: NaN too
        d = y - m[:, None]
        e = jnp.exp(d)
        total = jnp.sum(e, axis=1)
        u = jnp.sum(e * jnp.where(e == 0, 0.0, d), axis=1)
        extra += (jnp.log(total) - u / total,)
    if not top_k:
        return named_result((logprob, rank) + extra, 0, argmax, entropy)
    keyed = jax.lax.stop_gradient(jnp.where(jnp.isnan(y), -jnp.inf, jnp.where(y == 0, 0.0, y)))
    _, top_ids = jax.lax.top_k(keyed, top_k)
    top_y = jnp.take_along_axis(y, top_ids, axis=1)
    nan = jnp.isnan(top_y)
    return named_result(
        (logprob, rank, jnp.where(nan, jnp.nan, top_y - lse[:, None]), jnp.where(nan, -1, top_ids).astype(jnp.int32))
        + extra,
        top_k,
        argmax,
        entropy,
    )


_IMPL = {"kernel": kernel_logprob_rank, "jnp": _jnp_logprob_rank}
_EAGER = {name: jax.jit(impl, static_argnums=(3, 4, 5)) for name, impl in _IMPL.items()}


def token_logprob_rank(
    logits: jax.Array,
    token_ids: jax.Array,
    *,
    method: str = "kernel",
    top_k: int = 0,
    temperature: None | float | jax.Array = None,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobResult:
    """Log-probability and rank of ``token_ids[b]`` under row ``b`` of ``logits``, and
    optionally the row's ``top_k`` most likely tokens, its greedy token and its entropy.

    ``logits``: ``[batch, vocab]`` float32, bfloat16 or float16, never modified.
    ``token_ids``: ``[batch]`` or ``[batch, 1]`` int32/int64 (e.g. the tokens after replay).
    ``method``: ``"kernel"`` (the core's one-pass Triton kernels on XLA's stream, batch-invariant;
    numpy on the CPU) or ``"jnp"`` (the same arithmetic in ``jax.numpy``, not promised
    batch-invariant). ``top_k``: 0 to ``min(64, vocab)`` (static).
    ``temperature``: None (T = 1), a float for every row, or a float32 ``[batch]`` array; the
    results are then those of ``logits / T`` (vLLM's processed logprobs). A row whose ``T`` is
    not finite and ``> 0`` (``T <= 0``, NaN, infinite; never an error: a JAX array is not read
    on the host) is scored as a row of NaN logits, by both methods: NaN logprob, top-k
    logprobs and entropy, rank 0 (-1 for an id out of range), top-k ids -1, argmax 0.

    ``argmax``, ``entropy``: bools (static); see below.

    Returns new arrays, :class:`LogprobRank` ``(logprobs, ranks)`` when ``top_k == 0``, else
    :class:`LogprobRankTopK` ``(logprobs, ranks, topk_logprobs, topk_ids)``; with
    ``argmax=True``, :class:`LogprobRankArgmax` / :class:`LogprobRankTopKArgmax`, the same
    fields followed by ``argmax``; with ``entropy=True``, :class:`LogprobRankEntropy`,
    :class:`LogprobRankTopKEntropy`, :class:`LogprobRankArgmaxEntropy`,
    :class:`LogprobRankTopKArgmaxEntropy`, the same fields followed by ``entropy``. ``logprobs``
    float32 ``[batch]`` (natural log of the softmax probability, float32); ``ranks`` int32
    ``[batch]`` = the number of vocabulary entries greater than or equal to the token's own
    (vLLM's definition: a unique argmax has rank 1; ties count against the token);
    ``topk_logprobs`` float32 and ``topk_ids`` int32 ``[batch, top_k]``, sorted descending, ties
    broken by the lower id, NaN entries never selected (-1 and NaN where a row has fewer than
    ``top_k`` others; the two methods may then differ in which ``-inf`` entries fill in).

    Special values, as the core: a row holding NaN or ``+inf``, or only ``-inf``, has logprob
    NaN (ranks stay IEEE counts: NaN never counts); ``-inf`` logits are otherwise fine; a
    token id outside ``[0, vocab)`` gives logprob NaN and rank -1 (no error: checking would
    need a host sync).

    ``argmax=True``: ``argmax`` is int32 ``[batch]``, each row's greedy token: the lowest id
    among the largest non-NaN entries of ``y`` (``logits / T``; 0 when every entry is NaN),
    found in the same pass over the logits. A row whose token id is negative (e.g. -1) is then
    scored as that greedy token: its logprob and rank are those of ``argmax[b]`` (with the
    kernel method, the same bits as a call that passes that id). A greedy decode step is thus
    one read of the logits::

        drawn = jnp.full((rows,), -1, jnp.int32)              # nothing sampled yet
        tok = trace_replay_jax.replay(tables, drawn, idx_mapping, total_len, prompt_len)
        lp, rk, am = token_logprob_rank(logits, tok, argmax=True)   # traced rows: their trace token
        tok = jnp.where(tok < 0, am, tok)                     # the other rows: greedy

    The kernel method stays batch-invariant with ``argmax``: the argmax is exact (a comparison,
    no rounding), so a row's ``argmax`` and its greedy-row logprob and rank have the same bits
    in any batch. Without ``argmax`` a negative id is out of range (logprob NaN, rank -1).

    ``entropy=True``: ``entropy`` is float32 ``[batch]``, ``-sum(p * log(p))`` of each row's
    ``p = softmax(y)`` in nats (``jax.scipy.special.entr(p).sum(-1)``, to float32 rounding),
    whatever the token: NaN for the rows whose logprob is NaN for want of a normaliser (a NaN, a
    ``+inf``, only ``-inf``). The kernel method computes it in the same pass over the logits,
    batch-invariant like the logprobs.

    Works eagerly (one jitted dispatch; never waits for the device) and inside ``jax.jit``,
    ``lax.fori_loop`` and ``lax.while_loop``. Gradients (``jax.grad``, ``jax.vjp``; first order):
    both methods give the gradient of the logprobs, top-k logprobs and entropy with respect to
    ``logits`` and ``temperature`` (ranks, ids and argmax are integers); with the kernel method it
    is the core's backward kernel (one read of the logits, one write of the gradient,
    batch-invariant) through a ``jax.custom_vjp``. A row whose id is out of range adds no gradient
    through its (NaN) logprob; a row without a normaliser (a NaN or ``+inf`` logit, only ``-inf``,
    a temperature not finite and ``> 0``) gets NaN gradients. Forward mode (``jax.jvp``,
    ``jax.jacfwd``) and second order (``jax.hessian``): ``method="jnp"`` only. The kernel method
    is reverse mode, first order: a ``jax.custom_vjp`` has no forward rule, so JAX refuses
    ``jax.jvp``/``jax.jacfwd`` of it (``TypeError``: "can't apply forward-mode autodiff (jvp) to
    a custom_vjp function") and forward mode over its gradient (``ValueError``: "Buffer
    callbacks do not support JVP"); pass ``method="jnp"`` to those transforms. ``jax.vmap``
    works, also over ``jax.jit`` and ``jax.grad`` of it: the kernel method folds a mapped axis
    into the batch axis and runs once.
    """
    batch, vocab = _check(logits, token_ids, method)
    top_k = check_top_k(top_k, vocab)
    argmax = _check_flag(argmax, "argmax")
    entropy = _check_flag(entropy, "entropy")
    temperature = _temperature(temperature, batch)
    args = (logits, token_ids) + ((temperature,) if temperature is not None else ())
    if any(isinstance(a, jax.core.Tracer) for a in args):
        return _IMPL[method](logits, token_ids, temperature, top_k, argmax, entropy)
    return _EAGER[method](logits, token_ids, temperature, top_k, argmax, entropy)
