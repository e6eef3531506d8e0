"""How far apart two bfloat16 runs' logprobs may be, measured, and the statistic that tells noise
from a modelling error (shared by the loop tests of both families, CPU and GPU tiers).

bfloat16 keeps 8 significant bits, so every position's logprob carries rounding noise of a few
1e-3, and its largest value over a hundred positions is close to what a small modelling error
(a dropped bias, a layer-norm epsilon 10x off, a rotary base halved) adds at its worst position:
a max-abs bound loose enough for the noise lets such errors through. The noise is independent
from position to position and the error is not, so the mean of ``|d|`` over all compared
positions separates them: :func:`gaps` and :func:`check_close` bound the mean tightly and the
maximum only loosely (a guard against one position far off).

Each :class:`Bound` states what it was derived from (the CPU measurement, over several seeds,
of the noise of that comparison, and the smallest planted error it must catch); the negative
controls in the tests plant those errors and show the bound refuses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Bound:
    """``mean``: the most mean ``|d|`` over all positions; ``max``: the most ``|d|`` at one
    position; ``measured``: the measurement it was derived from, in words."""

    mean: float
    max: float
    measured: str


def gaps(a: Sequence, b: Sequence, which: Sequence[int] | None = None) -> np.ndarray:
    """``|a.logprobs - b.logprobs|`` of every position of every result pair (``which``: only
    those result indices), flat."""
    pairs = list(zip(a, b, strict=True))
    if which is not None:
        pairs = [pairs[i] for i in which]
    return np.concatenate([np.abs(x.logprobs.astype(np.float64) - y.logprobs) for x, y in pairs])


def refs_gaps(results: Sequence, references: Sequence[np.ndarray]) -> np.ndarray:
    """``|result.logprobs - reference|`` of every position, flat (``references[i]``: the
    reference logprobs of ``results[i]``'s tokens)."""
    return np.concatenate(
        [np.abs(r.logprobs.astype(np.float64) - ref) for r, ref in zip(results, references, strict=True)]
    )


def check_close(d: np.ndarray, bound: Bound, what: str) -> None:
    """Fail unless the mean and the maximum of ``d`` are within ``bound``."""
    assert d.size >= 40, f"{what}: {d.size} positions are too few for a mean to mean anything"
    assert d.mean() <= bound.mean and d.max() <= bound.max, (
        f"{what}: mean |d| {d.mean():.3g} (bound {bound.mean:.3g}), max {d.max():.3g} (bound {bound.max:.3g}); "
        f"the bound: {bound.measured}"
    )


def check_caught(d: np.ndarray, bound: Bound, what: str) -> None:
    """A planted error is refused: the mean of ``d`` exceeds the bound (by itself, whatever the max)."""
    assert d.mean() > bound.mean, (
        f"{what}: the planted error moved logprobs by mean |d| {d.mean():.3g} only, within the bound "
        f"{bound.mean:.3g}: the bound would let it through"
    )


# GPT-2 (tests/helpers/gpt2_cases CONFIG, seeded weights, ~100-130 forced positions per run).
# Measured on the CPU, seeds 0-4: torch bf16 vs JAX bf16, mean |d| 7.9e-4 - 9.4e-4, max 2.5e-3 -
# 5.2e-3; either framework's bf16 vs the float64 reference, mean 6.7e-4 - 9.6e-4, max 4.3e-3.
# Planted in one framework: every layer's MLP input bias dropped, mean 3.0e-3 - 3.9e-3 (max 1.1e-2
# - 1.5e-2); layer_norm_epsilon 1e-5 -> 1e-4, mean 4.1e-3 - 5.5e-3.
GPT2_BF16 = Bound(
    mean=2e-3,
    max=1e-2,
    measured="CPU, seeds 0-4: noise mean |d| <= 9.6e-4, max <= 5.2e-3; smallest planted error mean 3.0e-3",
)

# Llama family (transformers' qwen2 of tests/helpers/llama_cases, q/k/v biases drawn at random,
# rope_theta 1e6, rms_norm_eps 1e-6; 40-55 forced positions per run). Measured on the CPU, seeds
# 0-3, per framework: bf16 vs the loop's own float32, mean |d| 5.3e-3 - 7.2e-3, max 1.4e-2 - 2.6e-2;
# bf16 vs transformers' bf16 model, mean 3.1e-3 - 3.9e-3 (torch), 6.0e-3 - 8.0e-3 (JAX), max
# <= 2.8e-2. Planted in the bf16 run: q/k/v biases dropped, mean 0.22 - 0.35; rms_norm_eps 1e-3,
# mean 3.8e-2 - 6.1e-2; rope_theta 1e4 (the Llama default read for a Qwen config), mean 8.5e-2
# (torch vs JAX, seed 0). Not caught by any bf16 bound, so left to the float32 tests (1e-5):
# rms_norm_eps 1e-5 (mean 6.4e-3, inside the noise) and rope_theta halved (mean 1.1e-2 - 1.6e-2,
# too close to it).
# The other cases of llama_cases (llama3 rope, a sliding window, q/k norms), seeds 0-1: bf16 vs
# transformers' bf16, mean <= 6.4e-3, max <= 2.4e-2; bf16 vs float32, mean <= 9.2e-3 (qwen3).
LLAMA_BF16 = Bound(
    mean=1.5e-2,
    max=5e-2,
    measured="CPU, seeds 0-3: noise mean |d| <= 9.2e-3, max <= 2.8e-2; smallest planted error mean 3.8e-2",
)
