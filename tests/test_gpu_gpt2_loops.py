"""GPU tier of the GPT-2-style reference decode loops: the checks of ``test_gpt2_loops.py`` on
``device="cuda"`` (against the float64 reference, traced and untraced requests, batch sizes,
torch vs JAX on the GPU and across devices), and a run of the size the command line is for."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu

from helpers.gpt2_cases import (  # noqa: E402
    CONFIG,
    LOOPS,
    check_against_reference,
    check_batch_sizes,
    check_matches_reference,
    check_same_results,
    check_torch_vs_jax,
    check_untraced_unaffected,
    make_requests,
    small_jax_chunks,  # noqa: E402, F401 - the autouse fixture, applied here too
    weights_for,
)
from helpers.jax_helpers import jax_gpu  # noqa: E402

import trace_replay_app.models.gpt2.jax_loop as jax_gpt2  # noqa: E402
import trace_replay_app.models.gpt2.torch_loop as torch_gpt2  # noqa: E402
from trace_replay_app.records import TraceRequest  # noqa: E402


def _device(framework: str) -> str:
    if framework == "jax":
        jax_gpu()  # skips with the reason when JAX sees no GPU
    return "cuda"


@pytest.mark.parametrize("kind", ["seeded", "scaled"])
@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_gpu_matches_reference(framework, kind, rng):
    check_matches_reference(LOOPS[framework], _device(framework), rng, kind)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_gpu_untraced_unaffected_by_traced_neighbours(framework, rng):
    check_untraced_unaffected(LOOPS[framework], _device(framework), rng)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_gpu_continuous_batching_across_batch_sizes(framework, rng):
    check_batch_sizes(LOOPS[framework], _device(framework), rng)


def test_gpu_torch_vs_jax(rng):
    check_torch_vs_jax(_device("jax"), rng)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_gpu_matches_cpu(framework, rng):
    """The same run on the GPU and on the CPU (``cuda:0`` spelled out)."""
    device = _device(framework)
    weights, requests = weights_for(rng), make_requests(rng, 10)
    gpu = LOOPS[framework](CONFIG, weights, requests, device=f"{device}:0", max_batch=3)
    cpu = LOOPS[framework](CONFIG, weights, requests, device="cpu", max_batch=3)
    check_same_results(weights, requests, gpu, cpu, f"{framework} gpu vs cpu")


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_gpu_command_line_size(framework, rng):
    """256 requests of ~64 new tokens (half traced) with the default 8 slots: 2,000+ decode steps
    in seconds. The second run is timed (the first compiles); a sample is checked against the
    reference and the run against the other framework's tokens is left to test_gpu_torch_vs_jax."""
    device = _device(framework)
    weights = weights_for(rng)
    requests = []
    for i in range(256):
        prompt = tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, int(rng.integers(1, 33))))
        new = int(rng.integers(48, 81))
        if i % 2:
            requests.append(
                TraceRequest(f"r{i}", prompt, tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, new)))
            )
        else:
            requests.append(TraceRequest(f"r{i}", prompt, max_new_tokens=new))
    run = LOOPS[framework]
    run(CONFIG, weights, requests[:16], device=device)
    steps = []
    start = time.perf_counter()
    results = run(CONFIG, weights, requests, device=device, on_step=steps.append)
    elapsed = time.perf_counter() - start
    tokens = sum(steps)
    print(
        f"{framework}: {len(requests)} requests, {tokens} tokens in {len(steps)} steps: {elapsed:.2f} s "
        f"({elapsed / len(steps) * 1e6:.0f} us per step)"
    )
    assert tokens == sum(r.new_tokens for r in requests)
    assert elapsed < 60, f"{framework}: {elapsed:.1f} s for {len(steps)} steps"
    sample = rng.choice(len(requests), 12, replace=False)
    check_against_reference(weights, [requests[i] for i in sample], [results[i] for i in sample], framework)


def test_gpu_torch_and_jax_share_the_device(rng):
    """Both loops in one process on one GPU, one after the other, twice: the same results again."""
    device = _device("jax")
    weights, requests = weights_for(rng), make_requests(rng, 8)
    first = [
        torch_gpt2.run_decode(CONFIG, weights, requests, device=device, max_batch=3),
        jax_gpt2.run_decode(CONFIG, weights, requests, device=device, max_batch=3),
    ]
    second = [
        torch_gpt2.run_decode(CONFIG, weights, requests, device=device, max_batch=3),
        jax_gpt2.run_decode(CONFIG, weights, requests, device=device, max_batch=3),
    ]
    for framework, a, b in zip(("torch", "jax"), first, second):
        check_same_results(weights, requests, a, b, f"{framework}, first vs second run")


@pytest.mark.parametrize("temperature", [0.0, 1.3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_gpt2_cuda_graph_equals_eager(dtype, temperature, rng):
    """The GPT-2 torch loop runs on the shared driver, so its step is a CUDA graph on CUDA: the
    same bits as the eager step, greedy and sampled."""
    weights, requests = weights_for(rng, "scaled"), make_requests(rng, 10)
    kwargs = dict(device="cuda", max_batch=4, dtype=dtype, temperature=temperature, seed=9)
    graph = torch_gpt2.run_decode(CONFIG, weights, requests, cuda_graph=True, **kwargs)
    eager = torch_gpt2.run_decode(CONFIG, weights, requests, cuda_graph=False, **kwargs)
    for a, b in zip(graph, eager, strict=True):
        for field in ("tokens", "forced", "logprobs", "ranks", "argmax"):
            assert (getattr(a, field) == getattr(b, field)).all(), (a.id, field, dtype, temperature)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_gpu_gpt2_matches_transformers(framework, rng, tmp_path):
    """Both loops on CUDA against transformers' own GPT2LMHeadModel on CUDA (float32)."""
    from helpers.gpt2_hf import load, make_checkpoint
    from helpers.llama_cases import check_against_hf, hf_model
    from helpers.llama_cases import make_requests as hf_requests

    folder = make_checkpoint("gpt2-small", str(tmp_path / "gpt2"), seed=3)
    config, weights = load(folder)
    requests = hf_requests(rng, config.vocab_size, n=8, longest=config.n_positions // 2)
    results = LOOPS[framework](config, weights, requests, device=_device(framework), max_batch=3)
    check_against_hf(hf_model(folder, device="cuda"), requests, results, f"gpt2 {framework} cuda", atol=2e-5)
