"""GPU tier on two GPUs: the tensor-parallel torch loop over NCCL on cuda:0 and cuda:1, and the
JAX loop on a 2-GPU mesh with the logits sharded over the vocabulary.

Torch: two ranks spawned once (``multi_device_workers.run_ranks``, NCCL, rank ``r`` on
``cuda:r``) run every job; each job against the one-GPU loop (``torch_loop.run_decode`` on
``cuda:0``): float32 (CUDA-graph step and eager step) with tokens equal and logprobs within
2e-5, bf16 with the traced tokens equal and logprobs within bf16 tolerance; both ranks return
the same bits. One model has the real vocabulary of Qwen2.5 (151,936) and its 14/2 heads.

JAX: ``jax_mesh_loop_cases.py`` in a subprocess with ``TRACE_REPLAY_MESH_PLATFORM=gpu``.

NVLink multicast stays off: the spawned ranks and the subprocess get ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` (set in their own
environment; this process's environment is not changed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.llama_cases import check_same, hf_model, hf_reference, load, make_checkpoint, make_requests  # noqa: E402
from helpers.multi_device_workers import NO_MULTICAST, run_ranks  # noqa: E402

from trace_replay_app.models.llama import torch_loop  # noqa: E402
from trace_replay_app.models.llama.config import LlamaConfig, seeded_weights  # noqa: E402

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_GPUS < 2, reason=f"needs 2 CUDA GPUs (found {_GPUS})")]

JAX_CASES = Path(__file__).with_name("jax_mesh_loop_cases.py")
QWEN_HEADS = LlamaConfig(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    qkv_bias=True,
    tie_word_embeddings=True,
)


def _bf16_close(got, ref, what, atol=0.05):
    for a, b in zip(got, ref, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist(), f"{what}, request {a.id}: tokens differ"
        diff = np.abs(a.logprobs - b.logprobs).max()
        assert diff <= atol, f"{what}, request {a.id}: logprobs differ by {diff:.3g}"


def test_nccl_two_ranks_equal_one_gpu(tmp_path, rng):
    jobs, models = [], {}
    for i, case in enumerate(("qwen2", "llama-untied-llama3-biases", "qwen3")):
        folder = make_checkpoint(case, str(tmp_path / case), seed=i)
        config, weights = load(folder)
        requests = make_requests(rng, config.vocab_size, n=7)
        jobs.append((case, config, weights, requests, dict(max_batch=4)))
        jobs.append((case + "-eager", config, weights, requests, dict(max_batch=4, cuda_graph=False)))
        models[case] = models[case + "-eager"] = hf_model(folder)
    big = seeded_weights(QWEN_HEADS, seed=int(rng.integers(2**31)))
    models["qwen-heads"] = models["qwen-heads-sampled"] = hf_reference(QWEN_HEADS, big, str(tmp_path / "qwen-heads"))
    big_requests = make_requests(rng, QWEN_HEADS.vocab_size, n=6)
    jobs.append(("qwen-heads", QWEN_HEADS, big, big_requests, dict(max_batch=3)))
    traced = [r for r in big_requests if r.trace is not None]
    jobs.append(("qwen-heads-bf16", QWEN_HEADS, big, traced, dict(max_batch=3, dtype="bfloat16")))
    jobs.append(("qwen-heads-sampled", QWEN_HEADS, big, big_requests, dict(max_batch=3, temperature=1.2, seed=3)))

    per_rank = run_ranks(jobs, str(tmp_path), backend="nccl", timeout_s=600)

    for name, config, weights, requests, options in jobs:
        ref = torch_loop.run_decode(config, weights, requests, device="cuda:0", **options)
        if options.get("dtype") == "bfloat16":
            _bf16_close(per_rank[0][name], ref, f"{name}: 2 GPUs vs 1")
        else:
            check_same(
                per_rank[0][name], ref, f"{name}: 2 GPUs vs 1", atol=2e-5, reference=models[name], requests=requests
            )
        check_same(per_rank[1][name], per_rank[0][name], f"{name}: cuda:1 vs cuda:0", atol=0)


def test_jax_loop_on_a_two_gpu_mesh(rng):
    env = dict(os.environ, **NO_MULTICAST)
    env["TRACE_REPLAY_MESH_PLATFORM"] = "gpu"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["TRACE_REPLAY_TEST_SEED"] = str(int(rng.integers(2**32)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(JAX_CASES)],
        cwd=JAX_CASES.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    assert proc.returncode == 0, f"2-GPU mesh cases failed (rc={proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
