"""The Llama-family decode loops (torch and JAX) against transformers' own tiny models, on the CPU.

Per case (``llama_cases.CORE_CASES``; the other model types: test_llama_model_types.py): a
random model made and saved by transformers, read back
through ``trace_replay_app.checkpoint``; every forced token's logprob within 1e-5 of
transformers' teacher-forced forward (float32), ranks and argmax identical wherever a logit gap
above ``llama_cases.RANK_EPS`` decides them; untraced greedy requests equal
``generate(do_sample=False)``; the two frameworks agree; temperature sampling is reproducible;
bfloat16 runs stay within ``bf16_bounds.LLAMA_BF16`` of float32 and of transformers' bf16 model,
and the same bound refuses bf16 runs with a planted error (q/k/v biases dropped, rotary base
1e4 instead of 1e6, RMSNorm epsilon 1e-3 instead of 1e-6).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.bf16_bounds import LLAMA_BF16, check_caught, check_close, gaps, refs_gaps  # noqa: E402
from helpers.flash_double import flash_varlen_forward  # noqa: E402
from helpers.llama_cases import (  # noqa: E402
    CORE_CASES,
    check_against_hf,
    check_case_against_hf,
    check_loops_agree,
    check_same,
    checkpoints_of,
    decode_loops,
    hf_model,
    load,
    make_checkpoint,
    make_requests,
    teacher_forced,
)

from trace_replay_app.drivers.torch_attention import flash_decode  # noqa: E402
from trace_replay_app.models.llama import torch_loop  # noqa: E402
from trace_replay_app.models.llama.config import default_config, seeded_weights  # noqa: E402

LOOPS = decode_loops()
HAS_JAX = "jax" in LOOPS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, config, weights, transformers' model), made once per module."""
    return checkpoints_of(CORE_CASES, tmp_path_factory)


@pytest.mark.parametrize("framework", sorted(LOOPS))
@pytest.mark.parametrize("case", CORE_CASES)
def test_matches_transformers(checkpoints, case, framework, rng):
    check_case_against_hf(checkpoints, case, LOOPS[framework], f"{case} {framework}", rng)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_query_head_groups_larger_than_the_kv_heads(tmp_path, framework, rng):
    """8 query heads over 2 KV heads (groups of 4). In the cases above a group is as large as
    the number of KV heads (2 and 2), where the query heads read as [group, KV head] instead of
    [KV head, group] make the same array: only other group sizes show which KV head each
    query head attends with."""
    folder = make_checkpoint("qwen2", str(tmp_path / "gqa"), seed=7, num_attention_heads=8, num_key_value_heads=2)
    config, weights = load(folder)
    assert (config.num_key_value_heads, config.kv_groups) == (2, 4)
    requests = make_requests(rng, config.vocab_size, n=3)
    results = LOOPS[framework](config, weights, requests, max_batch=3)
    check_against_hf(hf_model(folder), requests, results, f"groups of 4 {framework}")


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
@pytest.mark.parametrize("case", CORE_CASES)
def test_torch_and_jax_agree(checkpoints, case, rng):
    check_loops_agree(checkpoints, case, LOOPS, rng)


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


def _traced(rng, config):
    # 14 traced requests: 90 positions on average, fewer than the 40 that check_close needs about once in 1e5 draws
    return [r for r in make_requests(rng, config.vocab_size, n=28) if r.trace is not None]


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_bfloat16_compute_close_to_float32(checkpoints, framework, rng):
    _, config, weights, _ = checkpoints["qwen2"]
    requests = _traced(rng, config)
    f32 = LOOPS[framework](config, weights, requests, max_batch=3)
    bf16 = LOOPS[framework](config, weights, requests, max_batch=3, dtype="bfloat16")
    for x, y in zip(f32, bf16):
        assert y.tokens.tolist() == x.tokens.tolist()
    check_close(gaps(bf16, f32), LLAMA_BF16, f"qwen2 {framework}: bf16 vs float32")


def _planted(error: str, config, weights):
    """``(config, weights)`` with one modelling error planted (the caller's objects unchanged)."""
    if error == "no-qkv-bias":  # a loader that drops the q/k/v biases
        return config, {
            k: np.zeros_like(v) if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) else v
            for k, v in weights.items()
        }
    if error == "rope-base-1e4":  # the Llama default read for a Qwen config (1e6)
        return dataclasses.replace(config, rope_theta=10000.0), weights
    assert error == "norm-eps-1e-3"  # 1000x the config's 1e-6; 10x is inside the bf16 noise
    return dataclasses.replace(config, rms_norm_eps=1e-3), weights


@pytest.mark.parametrize("error", ["no-qkv-bias", "rope-base-1e4", "norm-eps-1e-3"])
@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_bfloat16_bound_catches_planted_errors(checkpoints, framework, error, rng):
    """Negative control of LLAMA_BF16: a bf16 run with one modelling error is refused, against
    the correct float32 run (the check above) and against transformers' own bf16 model."""
    _, config, weights, _ = checkpoints["qwen2"]
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6 and config.qkv_bias
    requests = _traced(rng, config)
    f32 = LOOPS[framework](config, weights, requests, max_batch=3)
    bad_config, bad_weights = _planted(error, config, weights)
    bad = LOOPS[framework](bad_config, bad_weights, requests, max_batch=3, dtype="bfloat16")
    check_caught(gaps(bad, f32), LLAMA_BF16, f"{error} {framework}: bf16 vs float32")


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_bfloat16_close_to_transformers_bfloat16(checkpoints, framework, rng):
    """The comparison the GPU tier makes (test_gpu_models), on the CPU: the loop's bf16 logprobs
    against transformers' own bf16 model, within LLAMA_BF16; and the same with the q/k/v biases
    dropped is refused."""
    folder, config, weights, _ = checkpoints["qwen2"]
    model = hf_model(folder, dtype=torch.bfloat16)
    requests = _traced(rng, config)
    want = [teacher_forced(model, r.prompt, r.trace)[0] for r in requests]
    got = LOOPS[framework](config, weights, requests, max_batch=3, dtype="bfloat16")
    check_close(refs_gaps(got, want), LLAMA_BF16, f"qwen2 {framework} bf16 vs transformers bf16")
    bad = LOOPS[framework](*_planted("no-qkv-bias", config, weights), requests, max_batch=3, dtype="bfloat16")
    check_caught(refs_gaps(bad, want), LLAMA_BF16, f"no-qkv-bias {framework} bf16 vs transformers bf16")


@pytest.mark.parametrize(
    "device, dtype, fused, error, match",
    [
        ("cpu", torch.bfloat16, True, ValueError, r"fused=True needs a CUDA device.*got device=cpu, dtype=torch.bf"),
        ("cpu", torch.float32, "yes", TypeError, r"fused must be None, True or False \(got 'yes'\)"),
        ("cpu", torch.float32, 1, TypeError, r"fused must be None, True or False \(got 1\)"),
    ],
)
def test_fused_decode_form_refused_where_it_cannot_run(device, dtype, fused, error, match):
    config = default_config("qwen2")
    with pytest.raises(error, match=match):
        torch_loop.LlamaTorch(config, seeded_weights(config), torch.device(device), dtype, fused=fused)
    assert not torch_loop.LlamaTorch(config, seeded_weights(config), torch.device(device), dtype).fused


@pytest.mark.parametrize("window", [0, 3])
def test_flash_decode_arguments_through_a_cpu_double(monkeypatch, window, rng):
    """The fused form's flash_decode (CUDA only) on the CPU through ``helpers/flash_double``'s
    stand-in for the flash op: its sequence offsets, used key counts and left window give each
    row's attention over its keys ``0 .. positions[b]`` (the last ``window`` of them), grouped
    query heads, against numpy in float64."""
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", flash_varlen_forward)
    rows, kv_len, kv_heads, groups, d, scale = 4, 9, 2, 3, 8, 0.3
    keys, values = (torch.from_numpy(rng.standard_normal((rows, kv_len, kv_heads, d)).astype(np.float32)) for _ in "kv")
    q = torch.from_numpy(rng.standard_normal((rows, kv_heads * groups, d)).astype(np.float32))
    positions = [0, 4, kv_len - 1, 2]
    got = flash_decode(torch.tensor(positions), kv_len, scale)(keys, values, q, window).numpy()
    for b, p in enumerate(positions):
        lo = max(0, p + 1 - window) if window else 0
        for h in range(kv_heads * groups):
            k, v = (np.asarray(t[b, lo : p + 1, h // groups], np.float64) for t in (keys, values))
            s = k @ np.asarray(q[b, h], np.float64) * scale
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[b, h], w @ v / w.sum(), rtol=1e-5, atol=1e-6, err_msg=f"row {b} head {h}")
