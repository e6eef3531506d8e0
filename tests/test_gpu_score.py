"""GPU tier of ``run_score`` (teacher-forced): the checks of ``test_score.py`` on ``device="cuda"``
for a Qwen2 case in both frameworks (float32 within 1e-5 of transformers' CPU forward and of
decode with replay on the GPU), and bfloat16 scores close to float32 ones."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from helpers.jax_helpers import jax_gpu  # noqa: E402
from helpers.llama_cases import check_against_hf, check_same, hf_model, load, make_checkpoint, make_completions  # noqa: E402

from trace_replay_app.models.llama import jax_loop, torch_loop  # noqa: E402

SCORE = {"torch": torch_loop.run_score, "jax": jax_loop.run_score}
DECODE = {"torch": torch_loop.run_decode, "jax": jax_loop.run_decode}


def _device(framework: str) -> str:
    if framework == "jax":
        jax_gpu()  # skips with the reason when JAX sees no GPU
    return "cuda"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = make_checkpoint("qwen2", str(tmp_path_factory.mktemp("qwen2")), seed=40)
    return (*load(folder), hf_model(folder))


@pytest.mark.parametrize("framework", sorted(SCORE))
def test_gpu_score_matches_transformers_and_decode(qwen2, framework, rng):
    config, weights, model = qwen2
    device = _device(framework)
    requests = make_completions(rng, config.vocab_size, n=6)
    got = SCORE[framework](config, weights, requests, device=device, max_tokens=64, chunk_rows=7)
    check_against_hf(model, requests, got, f"qwen2 {framework} score on cuda")
    decoded = DECODE[framework](config, weights, requests, device=device, max_batch=3)
    check_same(got, decoded, f"qwen2 {framework} score vs decode on cuda", reference=model, requests=requests)


@pytest.mark.parametrize("framework", sorted(SCORE))
def test_gpu_score_bfloat16_close_to_float32(qwen2, framework, rng):
    config, weights, _ = qwen2
    device = _device(framework)
    requests = make_completions(rng, config.vocab_size, n=6)
    full = SCORE[framework](config, weights, requests, device=device)
    half = SCORE[framework](config, weights, requests, device=device, dtype="bfloat16")
    diff = np.concatenate([np.abs(a.logprobs - b.logprobs) for a, b in zip(full, half, strict=True)])
    assert np.isfinite(diff).all() and 0 < diff.mean() < 0.05, diff.mean()


def test_gpu_torch_compile_changes_nothing_in_float32(qwen2, rng):
    """The compiled forward (the default on CUDA) against the eager one, float32; and the
    argument checked."""
    config, weights, _ = qwen2
    requests = make_completions(rng, config.vocab_size, n=3)
    eager = SCORE["torch"](config, weights, requests, device="cuda", compile=False)
    compiled = SCORE["torch"](config, weights, requests, device="cuda")
    for a, b in zip(eager, compiled, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5, err_msg=a.id)
        assert (a.ranks == b.ranks).all() and (a.argmax == b.argmax).all(), a.id
    with pytest.raises(TypeError, match=r"compile must be a bool or None \(got str 'yes'\)"):
        SCORE["torch"](config, weights, requests, device="cuda", compile="yes")
