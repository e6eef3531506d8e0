"""The gpt2 loops' compute dtype and temperature sampling, in both frameworks (CPU tier).

Greedy (temperature 0, the default) is the path the other loop tests check; here: passing the
defaults explicitly changes nothing, bit for bit; sampling with a seed is reproducible and
follows the temperature; logprobs and ranks stay those of the raw logits (checked against the
float64 reference at the sampled tokens); bfloat16 compute runs, replays every trace and stays
near the float64 reference and the other framework within ``bf16_bounds.GPT2_BF16``, which
refuses the same runs with a dropped bias or a layer-norm epsilon 10x off; bad
dtype/temperature/seed are refused before anything runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.bf16_bounds import GPT2_BF16, check_caught, check_close, gaps, refs_gaps  # noqa: E402
from helpers.gpt2_cases import (  # noqa: E402
    CONFIG,
    LOGPROB_ATOL,
    LOOPS,
    log_softmax,
    make_requests,
    reference_rows,
    small_jax_chunks,
    torch_one_thread,
    weights_for,
)

from trace_replay_app.records import TraceRequest  # noqa: E402

__all__ = ["small_jax_chunks", "torch_one_thread"]  # the autouse fixtures, applied here too


def _free(rng, n: int, new: int = 12):
    return [
        TraceRequest(
            f"f{i}",
            tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, int(rng.integers(1, 9)))),
            max_new_tokens=new,
        )
        for i in range(n)
    ]


def _same(a, b) -> bool:
    return all(
        np.array_equal(getattr(x, k), getattr(y, k))
        for x, y in zip(a, b, strict=True)
        for k in ("tokens", "forced", "logprobs", "ranks", "argmax")
    )


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_explicit_greedy_defaults_are_bit_identical(framework, rng):
    run, weights, requests = LOOPS[framework], weights_for(rng), make_requests(rng, 6)
    default = run(CONFIG, weights, requests, max_batch=3)
    explicit = run(CONFIG, weights, requests, max_batch=3, dtype="float32", temperature=0.0, seed=12345)
    assert _same(default, explicit)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_sampling_is_reproducible_and_logprobs_are_of_raw_logits(framework, rng):
    run, weights = LOOPS[framework], weights_for(rng, "scaled")
    requests = _free(rng, 5) + [r for r in make_requests(rng, 4, traced_share=1.0) if r.trace is not None]
    first = run(CONFIG, weights, requests, max_batch=3, temperature=1.0, seed=7)
    again = run(CONFIG, weights, requests, max_batch=3, temperature=1.0, seed=7)
    other = run(CONFIG, weights, requests, max_batch=3, temperature=1.0, seed=8)
    assert _same(first, again), "the same seed must give the same run"
    free = [i for i, q in enumerate(requests) if q.trace is None]
    assert any(not np.array_equal(first[i].tokens, other[i].tokens) for i in free), "seeds 7 and 8 drew alike"
    for q, r in zip(requests, first, strict=True):
        ref = reference_rows(weights, q, r.tokens)
        ref_lp = log_softmax(ref)[np.arange(len(r.tokens)), r.tokens]
        bad = np.flatnonzero(~(np.abs(r.logprobs - ref_lp) <= LOGPROB_ATOL))  # NaN is a failure
        assert bad.size == 0, f"{q.id}: logprobs are not the raw logits' at {bad.tolist()}"
        assert (ref[np.arange(len(r.tokens)), r.argmax] >= ref.max(axis=1) - 1e-4).all(), f"{q.id}: argmax"
        if q.trace is not None:
            assert r.tokens.tolist() == list(q.trace) and r.forced.all()
        else:
            assert not r.forced.any()
    sampled = np.concatenate([first[i].tokens for i in free])
    greedy = np.concatenate([first[i].argmax for i in free])
    assert (sampled != greedy).mean() > 0.3, "temperature 1 on these logits should often leave the argmax"


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_low_temperature_approaches_greedy(framework, rng):
    run, weights = LOOPS[framework], weights_for(rng, "scaled")
    requests = _free(rng, 6)
    cold = run(CONFIG, weights, requests, max_batch=3, temperature=1e-3, seed=1)
    hot = run(CONFIG, weights, requests, max_batch=3, temperature=5.0, seed=1)
    agree = lambda results: np.mean(np.concatenate([r.tokens == r.argmax for r in results]))  # noqa: E731
    assert agree(cold) > 0.95 and agree(hot) < 0.5, (agree(cold), agree(hot))
    assert np.mean(np.concatenate([r.logprobs for r in hot])) < np.mean(np.concatenate([r.logprobs for r in cold]))


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_bfloat16_compute(framework, rng):
    run, weights = LOOPS[framework], weights_for(rng)
    requests = make_requests(rng, 12)
    bf16 = run(CONFIG, weights, requests, max_batch=3, dtype="bfloat16")
    for q, r in zip(requests, bf16, strict=True):
        assert r.logprobs.dtype == np.float32
        if q.trace is not None:
            assert r.tokens.tolist() == list(q.trace)
    d = refs_gaps(bf16, _reference_logprobs(weights, requests, bf16))
    assert d.max() > 0  # not float32 (which is within 5e-5) ...
    check_close(d, GPT2_BF16, f"{framework} bf16 vs the float64 reference")  # ... but near it


def _reference_logprobs(weights, requests, results):
    """The float64 reference's logprobs of each result's tokens."""
    out = []
    for q, r in zip(requests, results, strict=True):
        out.append(log_softmax(reference_rows(weights, q, r.tokens))[np.arange(len(r.tokens)), r.tokens])
    return out


def _traced(rng, n: int = 16):
    return [r for r in make_requests(rng, n, traced_share=1.0) if r.trace is not None]


def test_bfloat16_torch_and_jax_agree_on_traced_tokens(rng):
    weights = weights_for(rng)
    requests = _traced(rng)
    a, b = (LOOPS[fw](CONFIG, weights, requests, max_batch=3, dtype="bfloat16") for fw in ("torch", "jax"))
    for x, y in zip(a, b, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
    check_close(gaps(a, b), GPT2_BF16, "torch bf16 vs JAX bf16")


def _planted(error: str, weights):
    """``(config, weights)`` with one modelling error planted (the caller's weights unchanged)."""
    if error == "no-mlp-bias":  # a loader that drops one tensor kind
        broken = dict(weights)
        for layer in range(CONFIG.n_layer):
            broken[f"h.{layer}.mlp.c_fc.bias"] = np.zeros_like(weights[f"h.{layer}.mlp.c_fc.bias"])
        return CONFIG, broken
    assert error == "eps-10x"
    return dataclasses.replace(CONFIG, layer_norm_epsilon=10 * CONFIG.layer_norm_epsilon), weights


@pytest.mark.parametrize("error", ["no-mlp-bias", "eps-10x"])
def test_bfloat16_bound_catches_planted_errors(error, rng):
    """Negative control of GPT2_BF16: the JAX loop with one modelling error, against the torch
    loop (the cross-framework check) and against the float64 reference, is refused."""
    weights = weights_for(rng)
    requests = _traced(rng)
    config, broken = _planted(error, weights)
    good = LOOPS["torch"](CONFIG, weights, requests, max_batch=3, dtype="bfloat16")
    bad = LOOPS["jax"](config, broken, requests, max_batch=3, dtype="bfloat16")
    check_caught(gaps(good, bad), GPT2_BF16, f"{error}: torch bf16 vs JAX bf16")
    check_caught(refs_gaps(bad, _reference_logprobs(weights, requests, bad)), GPT2_BF16, f"{error}: vs reference")


BAD = {
    "dtype": ({"dtype": "float16"}, r"^dtype must be one of float32, bfloat16 \(got 'float16'\)$"),
    "temperature-negative": (
        {"temperature": -0.5},
        r"^temperature must be a finite number >= 0 \(0 = greedy\) \(got -0\.5\)$",
    ),
    "temperature-inf": ({"temperature": float("inf")}, r"^temperature must be a finite number >= 0"),
    "temperature-str": ({"temperature": "1"}, r"^temperature must be a finite number >= 0 .*\(got '1'\)$"),
    "seed-negative": ({"seed": -1}, r"^seed must be an int in \[0, 2\*\*63\) \(got -1\)$"),
    "seed-float": ({"seed": 1.5}, r"^seed must be an int in \[0, 2\*\*63\) \(got 1\.5\)$"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_bad_sampling_arguments(framework, case, rng):
    change, pattern = BAD[case]
    calls = []
    with pytest.raises(ValueError, match=pattern):
        LOOPS[framework](CONFIG, weights_for(rng), _free(rng, 2), on_step=calls.append, **change)
    assert calls == []
