"""GPU tier of the Llama-family loops: on CUDA, in float32 and bfloat16, both loops against
transformers on CUDA (the models of ``llama_cases``), and the torch loop's CUDA-graph step
against its eager step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from helpers.bf16_bounds import LLAMA_BF16, check_caught, check_close, refs_gaps  # noqa: E402
from helpers.llama_cases import (  # noqa: E402
    check_against_hf,
    check_same,
    hf_model,
    load,
    make_checkpoint,
    make_requests,
    teacher_forced,
)

from trace_replay_app.models.llama import torch_loop  # noqa: E402

_GPU_CASES = [
    "llama-tied-llama3-sharded",
    "mistral-window-bf16",
    "qwen2",
    "qwen3",
    "qwen3-yarn",
    "phi3-window",
    "olmo2-biases",
    "olmo3-yarn-window",
    "gemma3-window",
    "gemma2-softcap",
    "smollm3-nope-window",
]


def _loop(framework):
    if framework == "torch":
        return torch_loop.run_decode
    from helpers.jax_helpers import jax_gpu

    jax_gpu()  # skips with the reason when JAX sees no GPU
    from trace_replay_app.models.llama import jax_loop

    return jax_loop.run_decode


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, case in enumerate(_GPU_CASES):
        folder = make_checkpoint(case, str(tmp_path_factory.mktemp(case)), seed=i)
        out[case] = (folder,) + load(folder)
    return out


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", _GPU_CASES)
def test_gpu_float32_matches_transformers(checkpoints, case, framework, rng):
    folder, config, weights = checkpoints[case]
    model = hf_model(folder, device="cuda")
    requests = make_requests(rng, config.vocab_size, n=9)
    results = _loop(framework)(config, weights, requests, device="cuda", max_batch=4)
    check_against_hf(model, requests, results, f"{case} {framework} cuda float32", atol=2e-5)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", _GPU_CASES)
def test_gpu_bfloat16_close_to_transformers(checkpoints, case, framework, rng):
    """bf16 compute: forced tokens' logprobs within ``bf16_bounds.LLAMA_BF16`` of transformers'
    bf16 model on CUDA (mean |d| over the positions, a loose max), the same tokens; on qwen2 the
    same run without its q/k/v biases is refused (the negative control of the bound here)."""
    folder, config, weights = checkpoints[case]
    model = hf_model(folder, device="cuda", dtype=torch.bfloat16)
    # 14 traced requests: 90 positions on average, fewer than check_close's 40 about once in 1e5 draws
    requests = [r for r in make_requests(rng, config.vocab_size, n=28) if r.trace is not None]
    results = _loop(framework)(config, weights, requests, device="cuda", max_batch=3, dtype="bfloat16")
    want = [teacher_forced(model, r.prompt, r.trace)[0] for r in requests]
    for r, res in zip(requests, results):
        assert res.tokens.tolist() == list(r.trace)
    check_close(refs_gaps(results, want), LLAMA_BF16, f"{case} {framework} cuda bf16 vs transformers bf16")
    if config.qkv_bias:
        no_bias = {
            k: np.zeros_like(v) if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) else v
            for k, v in weights.items()
        }
        bad = _loop(framework)(config, no_bias, requests, device="cuda", max_batch=3, dtype="bfloat16")
        check_caught(refs_gaps(bad, want), LLAMA_BF16, f"{case} {framework} cuda bf16 without q/k/v biases")


@pytest.mark.parametrize("temperature", [0.0, 1.3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_cuda_graph_equals_eager(checkpoints, dtype, temperature, rng):
    _, config, weights = checkpoints["qwen3"]
    requests = make_requests(rng, config.vocab_size, n=11)
    kwargs = dict(device="cuda", max_batch=4, dtype=dtype, temperature=temperature, seed=9)
    graph = torch_loop.run_decode(config, weights, requests, cuda_graph=True, **kwargs)
    eager = torch_loop.run_decode(config, weights, requests, cuda_graph=False, **kwargs)
    check_same(graph, eager, f"graph vs eager {dtype} T={temperature}", atol=0)


def test_gpu_torch_and_jax_agree(checkpoints, rng):
    folder, config, weights = checkpoints["llama-tied-llama3-sharded"]
    requests = make_requests(rng, config.vocab_size, n=9)
    a = _loop("torch")(config, weights, requests, device="cuda", max_batch=3)
    b = _loop("jax")(config, weights, requests, device="cuda", max_batch=3)
    check_same(a, b, "torch vs jax on cuda", atol=2e-5, reference=hf_model(folder), requests=requests)


def test_gpu_matches_cpu(checkpoints, rng):
    folder, config, weights = checkpoints["mistral-window-bf16"]
    requests = make_requests(rng, config.vocab_size, n=9)
    gpu = torch_loop.run_decode(config, weights, requests, device="cuda:0", max_batch=3)
    cpu = torch_loop.run_decode(config, weights, requests, device="cpu", max_batch=3)
    check_same(gpu, cpu, "torch cuda vs cpu", atol=2e-5, reference=hf_model(folder), requests=requests)
