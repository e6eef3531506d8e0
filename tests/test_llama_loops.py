"""The Llama-family decode loops (torch and JAX) against transformers' own tiny models, on the CPU.

Per case (see ``llama_cases.CASES``): a random model made and saved by transformers, read back
through ``trace_replay_app.checkpoint``; every forced token's logprob within 1e-5 of
transformers' teacher-forced forward (float32), ranks and argmax identical wherever a logit gap
above ``llama_cases.RANK_EPS`` decides them; untraced greedy requests equal
``generate(do_sample=False)``; the two frameworks agree; temperature sampling is reproducible.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.llama_cases import CASES, check_against_hf, check_same, hf_model, load, make_checkpoint, make_requests  # noqa: E402

from trace_replay_app.models.llama import torch_loop  # noqa: E402

LOOPS = {"torch": torch_loop.run_decode}
HAS_JAX = importlib.util.find_spec("jax") is not None
if HAS_JAX:  # only a missing jax skips the JAX cases: an import error in our own loop fails here
    from trace_replay_app.models.llama import jax_loop

    LOOPS["jax"] = jax_loop.run_decode


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, config, weights, transformers' model), made once per module."""
    out = {}
    for i, case in enumerate(CASES):
        folder = make_checkpoint(case, str(tmp_path_factory.mktemp(case)), seed=i)
        config, weights = load(folder)
        out[case] = (folder, config, weights, hf_model(folder))
    return out


@pytest.mark.parametrize("framework", sorted(LOOPS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(checkpoints, case, framework, rng):
    folder, config, weights, model = checkpoints[case]
    assert config.model_type == CASES[case][0]
    requests = make_requests(rng, config.vocab_size)
    results = LOOPS[framework](config, weights, requests, max_batch=3)
    check_against_hf(model, requests, results, f"{case} {framework}")


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_and_jax_agree(checkpoints, case, rng):
    _, config, weights, model = checkpoints[case]
    requests = make_requests(rng, config.vocab_size, n=7)
    a = LOOPS["torch"](config, weights, requests, max_batch=3)
    b = LOOPS["jax"](config, weights, requests, max_batch=3)
    check_same(a, b, f"{case} torch vs jax", reference=model, requests=requests)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_temperature_sampling_is_reproducible(checkpoints, framework, rng):
    _, config, weights, _ = checkpoints["qwen3"]
    requests = make_requests(rng, config.vocab_size, n=6)
    run = LOOPS[framework]
    greedy = run(config, weights, requests, max_batch=3)
    a = run(config, weights, requests, max_batch=3, temperature=1.5, seed=11)
    b = run(config, weights, requests, max_batch=3, temperature=1.5, seed=11)
    c = run(config, weights, requests, max_batch=3, temperature=1.5, seed=12)
    check_same(a, b, f"{framework} same seed", atol=0)
    untraced = [i for i, r in enumerate(requests) if r.trace is None]
    assert any(a[i].tokens.tolist() != c[i].tokens.tolist() for i in untraced), "another seed drew the same tokens"
    assert any(a[i].tokens.tolist() != greedy[i].tokens.tolist() for i in untraced), "sampling drew greedy tokens"
    for i, r in enumerate(requests):
        if r.trace is not None:  # forced tokens: logprobs of the raw logits, whatever the temperature
            assert a[i].tokens.tolist() == list(r.trace)
            np.testing.assert_allclose(a[i].logprobs, greedy[i].logprobs, atol=1e-6)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_bfloat16_compute_close_to_float32(checkpoints, framework, rng):
    _, config, weights, _ = checkpoints["llama-tied-llama3-sharded"]
    requests = [r for r in make_requests(rng, config.vocab_size, n=6) if r.trace is not None]
    f32 = LOOPS[framework](config, weights, requests, max_batch=2)
    bf16 = LOOPS[framework](config, weights, requests, max_batch=2, dtype="bfloat16")
    for x, y in zip(f32, bf16):
        assert y.tokens.tolist() == x.tokens.tolist()
        assert np.abs(x.logprobs - y.logprobs).max() < 0.1, f"{x.id}: bf16 far from float32"
