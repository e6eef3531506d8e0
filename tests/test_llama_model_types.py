"""The Llama family's other model types (``llama_cases.VARIANT_CASES``: Phi-3, OLMo 2 and 3,
SmolLM3, Gemma 2 and 3, YaRN and linear rotary scaling) through both decode loops on the CPU,
each a random model made and saved by transformers and read back through
``trace_replay_app.checkpoint``: every forced token's logprob within 1e-5 of transformers'
teacher-forced forward (float32), ranks and argmax identical wherever a logit gap decides them,
untraced greedy requests equal to ``generate``, and the two frameworks agree. The loop tests
that are not about a model type's layer math run on the first cases (test_llama_loops.py)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers.llama_cases import CASES, VARIANT_CASES, check_against_hf, check_same, checkpoints_of, make_requests

from trace_replay_app.models.llama import torch_loop

LOOPS = {"torch": torch_loop.run_decode}
HAS_JAX = importlib.util.find_spec("jax") is not None
if HAS_JAX:  # only a missing jax skips the JAX cases: an import error in our own loop fails here
    from trace_replay_app.models.llama import jax_loop

    LOOPS["jax"] = jax_loop.run_decode


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoints_of(VARIANT_CASES, tmp_path_factory, seed=100)


@pytest.mark.parametrize("framework", sorted(LOOPS))
@pytest.mark.parametrize("case", VARIANT_CASES)
def test_matches_transformers(checkpoints, case, framework, rng):
    folder, config, weights, model = checkpoints[case]
    assert config.model_type == CASES[case][0]
    requests = make_requests(rng, config.vocab_size)
    results = LOOPS[framework](config, weights, requests, max_batch=3)
    check_against_hf(model, requests, results, f"{case} {framework}")


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
@pytest.mark.parametrize("case", VARIANT_CASES)
def test_torch_and_jax_agree(checkpoints, case, rng):
    _, config, weights, model = checkpoints[case]
    requests = make_requests(rng, config.vocab_size, n=7)
    a = LOOPS["torch"](config, weights, requests, max_batch=3)
    b = LOOPS["jax"](config, weights, requests, max_batch=3)
    check_same(a, b, f"{case} torch vs jax", reference=model, requests=requests)
