"""Multi-device decode loops on the CPU: the tensor-parallel torch loop on 2 gloo ranks, and the
JAX loop on a 2-device mesh of CPU host devices with the logits sharded over the vocabulary.

Torch: two ranks spawned once (``torch.multiprocessing``, gloo) run every job; each job's
results must equal the one-process loop's (``torch_loop.run_decode``) token for token (traced
and untraced greedy requests, and seeded sampling), logprobs within 1e-5 (float32), ranks and
argmax those of transformers' logits wherever no near-tie leaves them open (an all-reduce sums
in another order: a rank 190 against 191 was seen), and be the same bits on both ranks.
Models: transformers' own tiny models of the cases whose layout the split touches
(``TP_CASES``: tied and untied heads, attention and MLP biases, per-head q/k norms, a window in
bfloat16, OLMo 2's norms over whole projections, which replicate the layers, and Gemma 2's soft
caps over vocabulary blocks; the rotary variants change no split and are checked in one process)
and a seeded model whose sizes do not split (one key/value head, a prime vocabulary: replicated
layers, uneven vocabulary blocks), written as a transformers checkpoint.

JAX: ``jax_mesh_loop_cases.py`` in a process of its own with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (JAX fixes its CPU device count at start).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.llama_cases import (  # noqa: E402
    CORE_CASES,
    check_against_hf,
    check_same,
    hf_model,
    hf_reference,
    load,
    make_checkpoint,
    make_requests,
)
from helpers.multi_device_workers import run_ranks  # noqa: E402

from trace_replay_app.drivers.torch_parallel import TensorParallel, vocab_blocks  # noqa: E402
from trace_replay_app.models import family_for_config  # noqa: E402
from trace_replay_app.models.gpt2 import GPT2Config  # noqa: E402
from trace_replay_app.models.gpt2 import seeded_weights as gpt2_weights  # noqa: E402
from trace_replay_app.models.llama import torch_loop  # noqa: E402
from trace_replay_app.models.llama.config import LlamaConfig, seeded_weights  # noqa: E402
from trace_replay_app.models.llama.torch_loop import splits_layers  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

JAX_CASES = Path(__file__).with_name("jax_mesh_loop_cases.py")
TP_CASES = (*CORE_CASES, "olmo2-biases", "gemma2-softcap")
# Sizes that do not split over 2 ranks: one key/value head, an odd MLP and a prime vocabulary.
ODD = LlamaConfig(
    model_type="qwen2",
    vocab_size=509,
    hidden_size=48,
    intermediate_size=97,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    max_position_embeddings=128,
    qkv_bias=True,
)


def test_vocab_blocks_cover_the_vocabulary():
    for vocab, world in ((256, 2), (509, 2), (151936, 2), (7, 3), (5, 5)):
        blocks = vocab_blocks(vocab, world)
        assert blocks[0][0] == 0 and blocks[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        sizes = [e - s for s, e in blocks]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert splits_layers(LlamaConfig(), 2) and not splits_layers(ODD, 2)


def test_refused_without_a_process_group():
    config = LlamaConfig()
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        torch_loop.run_decode(config, seeded_weights(config), [], max_batch=2, tensor_parallel=TensorParallel())
    with pytest.raises(TypeError, match=r"^tensor_parallel must be a TensorParallel or None \(got dict\)"):
        torch_loop.run_decode(config, seeded_weights(config), [], max_batch=2, tensor_parallel={})


def test_two_gloo_ranks_equal_the_one_process_loop(tmp_path, rng):
    jobs, models = [], {}
    for i, case in enumerate(sorted(TP_CASES)):
        folder = make_checkpoint(case, str(tmp_path / case), seed=i)
        config, weights = load(folder)
        requests = make_requests(rng, config.vocab_size, n=5, longest=16)
        jobs.append((case, config, weights, requests, dict(max_batch=3)))
        models[case] = hf_model(folder)
    odd_requests = make_requests(rng, ODD.vocab_size, n=5, longest=16)
    odd_weights = seeded_weights(ODD, seed=int(rng.integers(2**31)))
    jobs.append(("odd-sizes", ODD, odd_weights, odd_requests, dict(max_batch=2)))
    models["odd-sizes"] = hf_reference(ODD, odd_weights, str(tmp_path / "odd-sizes"))
    # GPT-2 on the same driver: replicated layers, its vocabulary blocks merged over the ranks.
    gpt2 = GPT2Config(vocab_size=251)
    gpt2_requests = make_requests(rng, gpt2.vocab_size, n=5, longest=16)
    jobs.append(("gpt2", gpt2, gpt2_weights(gpt2, seed=int(rng.integers(2**31))), gpt2_requests, dict(max_batch=3)))
    sampled = jobs[sorted(TP_CASES).index("qwen3")]
    jobs.append(("qwen3-sampled", sampled[1], sampled[2], sampled[3], dict(max_batch=3, temperature=1.5, seed=7)))
    models["qwen3-sampled"] = models["qwen3"]

    per_rank = run_ranks(jobs, str(tmp_path))

    for name, config, weights, requests, options in jobs:
        ref = family_for_config(config).run_decode("torch")(config, weights, requests, **options)
        if name == "gpt2":  # no transformers model here: the bits of the merge against one process
            check_same(per_rank[0][name], per_rank[1][name], "gpt2: rank 1 vs rank 0", atol=0)
            assert [r.tokens.tolist() for r in per_rank[0][name]] == [r.tokens.tolist() for r in ref]
            assert max(abs(a.logprobs - b.logprobs).max() for a, b in zip(per_rank[0][name], ref)) <= 1e-5
            continue
        check_same(
            per_rank[0][name],
            ref,
            f"{name}: 2 ranks vs 1 process",
            atol=1e-5,
            reference=models[name],
            requests=requests,
        )
        check_same(per_rank[1][name], per_rank[0][name], f"{name}: rank 1 vs rank 0", atol=0)
        if name == "qwen3-sampled":
            greedy = per_rank[0]["qwen3"]
            untraced = [i for i, r in enumerate(requests) if r.trace is None]
            assert any(per_rank[0][name][i].tokens.tolist() != greedy[i].tokens.tolist() for i in untraced)
    qwen2 = next(job for job in jobs if job[0] == "qwen2")  # and against transformers itself
    check_against_hf(models["qwen2"], qwen2[3], per_rank[0]["qwen2"], "qwen2 on 2 ranks")


def test_jax_loop_on_a_two_device_mesh(rng):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
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
    assert proc.returncode == 0, f"2-device mesh cases failed (rc={proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
