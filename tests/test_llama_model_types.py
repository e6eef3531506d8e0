"""The Llama family's other model types (``llama_cases.VARIANT_CASES``: Phi-3, OLMo 2 and 3,
SmolLM3, Gemma 2 and 3, YaRN and linear rotary scaling) through both decode loops on the CPU,
each a random model made and saved by transformers and read back through
``trace_replay_app.checkpoint``: every forced token's logprob within 1e-5 of transformers'
teacher-forced forward (float32), ranks and argmax identical wherever a logit gap decides them,
untraced greedy requests equal to ``generate``, and the two frameworks agree. The loop tests
that are not about a model type's layer math run on the first cases (test_llama_loops.py)."""

from __future__ import annotations

import pytest
from helpers.llama_cases import VARIANT_CASES, check_case_against_hf, check_loops_agree, checkpoints_of, decode_loops

LOOPS = decode_loops()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoints_of(VARIANT_CASES, tmp_path_factory, seed=100)


@pytest.mark.parametrize("framework", sorted(LOOPS))
@pytest.mark.parametrize("case", VARIANT_CASES)
def test_matches_transformers(checkpoints, case, framework, rng):
    check_case_against_hf(checkpoints, case, LOOPS[framework], f"{case} {framework}", rng)


@pytest.mark.skipif("jax" not in LOOPS, reason="jax is not installed")
@pytest.mark.parametrize("case", VARIANT_CASES)
def test_torch_and_jax_agree(checkpoints, case, rng):
    check_loops_agree(checkpoints, case, LOOPS, rng)
