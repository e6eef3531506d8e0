"""Train/rollout mismatch measures under the names three RL stacks log them (numpy only).

Input: per request, the logprobs of the same tokens from the trainer side (``train``: a
teacher-forced forward, the stacks' ``old_log_prob`` / ``trainer_logprobs``) and from the
engine that sampled them (``rollout``: ``rollout_log_prob`` / ``inference_logprobs``).
Notation, per request i with n_i tokens: ``t``, ``r`` its logprobs, ``x = t - r`` the log
importance ratio (train minus rollout in all three stacks), ``rho = exp(x)``,
``S_i = sum(x)``. "token mean": over every token of the batch; "sequence mean": each
request's token mean, then the mean over requests.

Keys are ``<stack>/`` followed by the exact key the stack logs, so that stripping the first
component gives the dashboard name (verl logs ``rollout_corr/kl``; prime-rl
``mismatch_kl/all/mean``; slime ``train/train_rollout_logprob_abs_diff``).

verl: ``volcengine/verl`` at b178a3cd (2026-01-29), ``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_offpolicy_metrics`` (diagnostics) and ``compute_rollout_correction_weights`` /
``compute_is_metrics`` (IS statistics); documented in ``docs/algo/rollout_corr.md`` (Metrics)
and ``docs/algo/rollout_corr_math.md`` (section 4). ``B = 20`` is verl's ``SAFETY_BOUND``.

- ``training_log_ppl`` / ``rollout_log_ppl``: sequence mean of ``-mean(t)`` / ``-mean(r)``.
- ``training_ppl`` / ``rollout_ppl``: sequence mean of ``exp(-mean(t))`` / ``exp(-mean(r))``
  (each request's perplexity, then averaged: not the perplexity of the pooled tokens).
- ``log_ppl_diff``: sequence mean of ``d_i = mean(r) - mean(t)`` (positive: train less
  confident); ``log_ppl_abs_diff`` sequence mean of ``|d_i|``; ``log_ppl_diff_max`` /
  ``log_ppl_diff_min`` the max / min of ``d_i`` over requests.
- ``ppl_ratio``: sequence mean of ``exp(d_i)`` (training PPL over rollout PPL per request).
  rollout_corr.md writes ``exp(mean(log(training_ppl / rollout_ppl)))``, a geometric mean;
  the code takes the arithmetic mean of the per-request ratios, which is what is used here.
- ``kl``: token mean of ``r - t`` (estimates KL(rollout || train); can be negative).
- ``k3_kl``: token mean of ``rho - x - 1`` (>= 0 per token).
- ``chi2_token``: token mean of ``exp(2 clip(x, -B, B))``, minus 1 (may be < 0 on a sample).
- ``chi2_seq``: sequence mean of ``exp(2 clip(S_i, -B, B))``, minus 1 (likewise).
- ``rollout_is_*``, which verl logs only when IS is on: ``rollout_is`` is ``"token"`` or
  ``"sequence"`` (null, off, in rollout_correction.yaml; ``"sequence"`` in
  ``RolloutCorrectionConfig``; ``"token"`` here), threshold ``C`` (``rollout_is_threshold``,
  default 2.0 in both), ``c = 1/C``. At ``"token"`` a token's weight is
  ``w = exp(clip(x, -B, B))``; at ``"sequence"`` every token of request i carries
  ``W_i = exp(clip(S_i, -B, B))``, and ``s_i`` is the token mean of request i's weights.

  - ``rollout_is_mean``: token mean of the weights (at ``"sequence"`` a long request counts
    more than a short one, unlike ``rollout_is_seq_mean``).
  - ``rollout_is_max`` / ``_min``: max / min of ``w``; at ``"sequence"``
    ``exp(min(max S_i, B))`` / ``exp(min S_i)``, so past ``B`` the min can exceed the max.
  - ``rollout_is_ratio_fraction_high`` / ``_low``: token fraction with ``w > C`` /
    ``w < c``; at ``"sequence"`` the fraction of requests with ``S_i > log C`` /
    ``S_i < log c``.
  - ``rollout_is_std``: population std over tokens of ``v = clip(weight, c, C)`` (0.0 for a
    single token); ``rollout_is_eff_sample_size``: ``1 / mean((v / mean(v))**2)`` over
    tokens, a fraction in (0, 1].
  - ``rollout_is_seq_mean`` / ``_std`` (``ddof=1``; 0.0 for one request) / ``_max`` /
    ``_min`` of ``s_i`` over requests; ``rollout_is_seq_max_deviation``: max
    ``|s_i - 1|``; ``rollout_is_seq_fraction_high`` / ``_low``: fraction of requests with
    ``s_i > C`` / ``s_i < c``.

prime-rl: ``PrimeIntellect-ai/prime-rl`` at 559b4477 (2026-08-21).
``src/prime_rl/trainer/rl/loss.py`` ``compute_importance_ratio_and_mismatch_kl``: per token
``mismatch_kl = exp(x) - x - 1`` with ``x = trainer_logprobs - inference_logprobs``;
``src/prime_rl/trainer/rl/train.py`` collects it over every trainable token as
``mismatch_kl/all`` and ``src/prime_rl/trainer/utils.py`` ``Tensors.compute_stats`` reduces
the pooled tokens: ``mismatch_kl/all/mean``, ``/median`` (torch's: the lower of the two
middle values for an even count), ``/std`` (``ddof=1``; None for one token, where torch
gives nan), ``/min``, ``/max``. ``mean`` equals verl's ``k3_kl``.

slime: ``THUDM/slime`` at 624b824a (2026-08-21), ``slime/backends/megatron_utils/loss.py``
``policy_loss_function``, reduced by ``sum_of_sample_mean``
(``slime/backends/megatron_utils/cp_utils.py`` ``get_sum_of_sample_mean``) and divided by the
rollout count: a sequence mean, under slime's default (``--calculate-per-token-loss`` off)
and one sample per rollout. Logged with the ``train/`` prefix.

- ``train_rollout_logprob_abs_diff``: sequence mean of ``mean(|t - r|)`` (always logged when
  rollout logprobs are present).
- ``tis`` / ``tis_abs`` / ``tis_clipfrac`` (logged with ``--use-tis`` or
  ``--get-mismatch-metrics``; ``vanilla_tis_function`` and the masking ``icepop_function``
  log the same three): sequence means of ``rho`` (untruncated), of ``|rho - 1|``, and of the
  indicator ``rho > C or rho < tis_clip_low`` (``--tis-clip`` default 2.0,
  ``--tis-clip-low`` default 0, ``slime/utils/arguments.py``).

Not covered: verl's ``rollout_is_batch_norm_factor`` and ``rollout_rs_*`` (rejection
sampling), slime's ``ois`` (current over old policy, not train over rollout) and the
``mis_*`` metrics of its example ``examples/train_infer_mismatch_helper/mis.py``.

Numerical deviations (same definitions, float64, more digits kept):

- ``rho - x - 1`` is ``expm1(x) - x``, and its Taylor series for ``|x| < 1e-2``; ``rho**2 - 1``
  is ``expm1(2x)`` and ``|rho - 1|`` is ``|expm1(x)|``: the stacks' forms lose most or all
  of the digits for the tiny ``x`` of a numerics mismatch.
- ``d_i`` is ``mean(r - t)`` rather than ``mean(r) - mean(t)`` (no cancellation).
- A mean of exponentials (``training_ppl``, ``rollout_ppl``, ``ppl_ratio``, ``tis``,
  ``k3_kl``) whose largest exponent is 700 or more goes through ``logsumexp``, so that a
  term past float64's range does not make a representable mean infinite; a per-token value
  past it (``mismatch_kl`` max, median, std) comes out None.
- verl's ``masked_mean`` divides by ``count + 1e-8`` and its ESS by ``mean + 1e-8``; here by
  the count and the mean (relative differences of order 1e-8).
- Requests with no tokens are left out of every mean and counted (``empty_requests``); verl
  and slime would count such a row as a sequence with mean 0 (perplexity 1).

Every value is a float, or None where it is undefined (no token) or not finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["METRIC_KEYS", "VERL_SAFETY_BOUND", "RLMetrics", "rl_metrics"]

VERL_SAFETY_BOUND = 20.0
_LSE_FROM = 700.0
_SERIES_BELOW = 1e-2

_VERL = "verl/rollout_corr/"
_PRIME = "prime_rl/mismatch_kl/all/"
_SLIME = "slime/train/"
_VERL_NAMES = (
    "training_ppl training_log_ppl kl k3_kl rollout_ppl rollout_log_ppl log_ppl_diff log_ppl_abs_diff "
    "log_ppl_diff_max log_ppl_diff_min ppl_ratio chi2_token chi2_seq rollout_is_mean rollout_is_max "
    "rollout_is_min rollout_is_ratio_fraction_high rollout_is_ratio_fraction_low rollout_is_std "
    "rollout_is_eff_sample_size rollout_is_seq_mean rollout_is_seq_std rollout_is_seq_max rollout_is_seq_min "
    "rollout_is_seq_max_deviation rollout_is_seq_fraction_high rollout_is_seq_fraction_low"
).split()
METRIC_KEYS: tuple[str, ...] = (
    *(_VERL + k for k in _VERL_NAMES),
    *(_PRIME + k for k in ("mean", "median", "std", "min", "max")),
    *(_SLIME + k for k in ("train_rollout_logprob_abs_diff", "tis", "tis_abs", "tis_clipfrac")),
)


@dataclass(frozen=True)
class RLMetrics:
    """What :func:`rl_metrics` returns. ``per_request``: one dict per input request, in input
    order, each the batch measures of a batch holding that request alone (every value None for
    an empty request); ``batch``: the measures over the non-empty requests (every value None
    when there is none); ``requests`` / ``empty_requests``: how many requests had tokens / had
    none; ``tokens``: the tokens measured. Keys: :data:`METRIC_KEYS`."""

    per_request: list[dict[str, float | None]]
    batch: dict[str, float | None]
    requests: int
    empty_requests: int
    tokens: int


def _value(x: float | np.floating) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _mean_exp(v: np.ndarray) -> float:
    """``mean(exp(v))``, through logsumexp when an exponent is large."""
    top = float(v.max())
    if top < _LSE_FROM:
        return float(np.exp(v).mean())
    with np.errstate(over="ignore"):
        return float(np.exp(top + np.log(np.exp(v - top).mean())))


def _k3_terms(x: np.ndarray) -> np.ndarray:
    """``exp(x) - x - 1`` per element, to full relative precision."""
    with np.errstate(over="ignore"):
        out = np.expm1(x) - x
    small = np.abs(x) < _SERIES_BELOW
    s = x[small]
    poly = 1 / 720 + s * (1 / 5040 + s / 40320)
    out[small] = s * s * (1 / 2 + s * (1 / 6 + s * (1 / 24 + s * (1 / 120 + s * poly))))
    return out


def _k3_mean(x: np.ndarray) -> float:
    if float(x.max()) < _LSE_FROM:
        return float(_k3_terms(x).mean())
    return _mean_exp(x) - float(x.mean()) - 1.0


def _measures(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], threshold: float, clip_low: float, level: str
) -> dict[str, float | None]:
    b = VERL_SAFETY_BOUND
    xs = [t - r for t, r in pairs]
    x = np.concatenate(xs)
    n = np.array([len(xi) for xi in xs])
    neg_mt = -np.array([t.mean() for t, _ in pairs])
    neg_mr = -np.array([r.mean() for _, r in pairs])
    d = -np.array([xi.mean() for xi in xs])
    s_sum = np.array([xi.sum() for xi in xs])
    out: dict[str, float | np.floating] = {
        "training_ppl": _mean_exp(neg_mt),
        "training_log_ppl": neg_mt.mean(),
        "kl": (-x).mean(),
        "k3_kl": _k3_mean(x),
        "rollout_ppl": _mean_exp(neg_mr),
        "rollout_log_ppl": neg_mr.mean(),
        "log_ppl_diff": d.mean(),
        "log_ppl_abs_diff": np.abs(d).mean(),
        "log_ppl_diff_max": d.max(),
        "log_ppl_diff_min": d.min(),
        "ppl_ratio": _mean_exp(d),
        "chi2_token": np.expm1(2 * np.clip(x, -b, b)).mean(),
        "chi2_seq": np.expm1(2 * np.clip(s_sum, -b, b)).mean(),
    }
    low = 1.0 / threshold
    if level == "token":
        w = np.exp(np.clip(x, -b, b))
        seq_w = np.array([np.exp(np.clip(xi, -b, b)).mean() for xi in xs])
        out["rollout_is_max"], out["rollout_is_min"] = w.max(), w.min()
        out["rollout_is_ratio_fraction_high"] = (w > threshold).mean()
        out["rollout_is_ratio_fraction_low"] = (w < low).mean()
    else:
        seq_w = np.exp(np.clip(s_sum, -b, b))
        w = np.repeat(seq_w, n)
        out["rollout_is_max"] = math.exp(min(float(s_sum.max()), b))
        out["rollout_is_min"] = np.exp(s_sum.min())
        out["rollout_is_ratio_fraction_high"] = (s_sum > math.log(threshold)).mean()
        out["rollout_is_ratio_fraction_low"] = (s_sum < math.log(low)).mean()
    v = np.clip(w, low, threshold)
    out["rollout_is_mean"] = w.mean()
    out["rollout_is_std"] = np.sqrt(v.var()) if v.size > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / np.mean(np.square(v / v.mean()))
    out["rollout_is_seq_mean"] = seq_w.mean()
    out["rollout_is_seq_std"] = seq_w.std(ddof=1) if seq_w.size > 1 else 0.0
    out["rollout_is_seq_max"], out["rollout_is_seq_min"] = seq_w.max(), seq_w.min()
    out["rollout_is_seq_max_deviation"] = np.abs(seq_w - 1.0).max()
    out["rollout_is_seq_fraction_high"] = (seq_w > threshold).mean()
    out["rollout_is_seq_fraction_low"] = (seq_w < low).mean()
    result = {_VERL + k: _value(val) for k, val in out.items()}

    k3 = _k3_terms(x)
    result[_PRIME + "mean"] = _value(_k3_mean(x))
    result[_PRIME + "median"] = _value(np.sort(k3)[(k3.size - 1) // 2])
    with np.errstate(invalid="ignore"):
        result[_PRIME + "std"] = _value(k3.std(ddof=1)) if k3.size > 1 else None
    result[_PRIME + "min"], result[_PRIME + "max"] = _value(k3.min()), _value(k3.max())

    with np.errstate(over="ignore"):
        rhos = [np.exp(xi) for xi in xs]
        tis_abs = np.mean([np.abs(np.expm1(xi)).mean() for xi in xs])
    clipped = [((rho > threshold) | (rho < clip_low)).mean() for rho in rhos]
    result[_SLIME + "train_rollout_logprob_abs_diff"] = _value(np.mean([np.abs(xi).mean() for xi in xs]))
    result[_SLIME + "tis"] = _value(np.mean([_mean_exp(xi) for xi in xs]))
    result[_SLIME + "tis_abs"] = _value(tis_abs)
    result[_SLIME + "tis_clipfrac"] = _value(np.mean(clipped))
    return {k: result[k] for k in METRIC_KEYS}


def _checked(side: str, i: int, a: object) -> np.ndarray:
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{side}[{i}] must be 1-D (got shape {arr.shape})")
    if not np.isfinite(arr).all():
        raise ValueError(f"{side}[{i}] holds a non-finite logprob")
    return arr


def rl_metrics(
    *,
    train: Sequence[np.ndarray],
    rollout: Sequence[np.ndarray],
    is_threshold: float = 2.0,
    tis_clip_low: float = 0.0,
    rollout_is: Literal["token", "sequence"] = "token",
) -> RLMetrics:
    """The mismatch measures of verl, prime-rl and slime (see the module docstring) for a batch
    of requests: ``train[i]`` and ``rollout[i]`` are the two sides' logprobs of request i's
    tokens (1-D, equal lengths, finite; converted to float64).

    ``is_threshold``: the IS truncation threshold C (verl ``rollout_is_threshold``, slime
    ``--tis-clip``; both default 2.0); ``tis_clip_low``: slime's ``--tis-clip-low`` (default
    0); ``rollout_is``: verl's IS aggregation level, ``"token"`` or ``"sequence"``.
    ``ValueError`` for inputs or options outside these."""
    if len(train) != len(rollout):
        raise ValueError(f"train has {len(train)} requests, rollout {len(rollout)}")
    if not (math.isfinite(is_threshold) and is_threshold > 0):
        raise ValueError(f"is_threshold must be positive and finite (got {is_threshold})")
    if not (math.isfinite(tis_clip_low) and 0 <= tis_clip_low < is_threshold):
        raise ValueError(f"tis_clip_low must be in [0, is_threshold) (got {tis_clip_low})")
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be 'token' or 'sequence' (got {rollout_is!r})")
    pairs = []
    for i, (t, r) in enumerate(zip(train, rollout)):
        ta, ra = _checked("train", i, t), _checked("rollout", i, r)
        if ta.shape != ra.shape:
            raise ValueError(f"request {i}: train has {ta.size} logprobs, rollout {ra.size}")
        pairs.append((ta, ra))
    kept = [p for p in pairs if p[0].size]
    nothing = dict.fromkeys(METRIC_KEYS)
    args = (float(is_threshold), float(tis_clip_low), rollout_is)
    return RLMetrics(
        per_request=[_measures([p], *args) if p[0].size else dict(nothing) for p in pairs],
        batch=_measures(kept, *args) if kept else dict(nothing),
        requests=len(kept),
        empty_requests=len(pairs) - len(kept),
        tokens=sum(p[0].size for p in kept),
    )
