"""GPU tier of ``run_score`` (teacher-forced): the checks of ``test_score.py`` on ``device="cuda"``
for a Qwen2 case in both frameworks (float32 within 1e-5 of transformers' CPU forward and of
decode with replay on the GPU), and bfloat16 scores close to float32 ones."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from helpers.jax_helpers import jax_gpu  # noqa: E402
from helpers.llama_cases import (  # noqa: E402
    check_against_hf,
    check_same,
    check_top_k_against_hf,
    hf_model,
    load,
    make_checkpoint,
    make_completions,
)

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
def test_gpu_score_top_k(qwen2, framework, rng):
    """``top_k=5`` on the GPU: ids and logprobs those of transformers' CPU forward (float32),
    the token's own outputs the same bits as without top-k; bfloat16 runs with top-k too."""
    config, weights, model = qwen2
    device = _device(framework)
    requests = make_completions(rng, config.vocab_size, n=4)
    got = SCORE[framework](config, weights, requests, device=device, top_k=5, chunk_rows=5)
    check_top_k_against_hf(model, requests, got, 5, f"qwen2 {framework} score top-k on cuda")
    plain = SCORE[framework](config, weights, requests, device=device, chunk_rows=5)
    for a, b in zip(got, plain, strict=True):
        assert all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("logprobs", "ranks", "entropy")), a.id
    half = SCORE[framework](config, weights, requests, device=device, dtype="bfloat16", top_k=5)
    assert all(h.topk_logprobs is not None and np.isfinite(h.topk_logprobs).all() for h in half)


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
