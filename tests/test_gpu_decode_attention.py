"""GPU tier of the decode attention over each row's own length: the torch loop's fused step
(compiled layer pieces, flash attention with ``seqused_k``), GPT-2's torch step with the same
flash attention, and the JAX step's cuDNN
attention (``key_value_seq_lengths``), each in bfloat16 against the same model's float32
masked step over a cache whose every position holds random keys and values (a kernel that
read past a row's length would see them), next to the masked step in bfloat16."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from trace_replay_app.models.llama.config import default_config, seeded_weights  # noqa: E402
from trace_replay_app.models.llama.torch_loop import LlamaTorch  # noqa: E402

ROWS, KV_LEN = 7, 96
CASES = {
    "qwen2": default_config("qwen2"),
    "qwen3": default_config("qwen3"),
    "mistral-window": default_config("mistral"),
    "llama-8-kv-heads": dataclasses.replace(default_config("llama"), num_attention_heads=8, num_key_value_heads=8),
    # windows, a rotary base per layer type, norms on both sides, a query scale of its own
    "gemma3": dataclasses.replace(default_config("gemma3_text"), query_pre_attn_scalar=20.0),
    "olmo3": default_config("olmo3"),  # norms on outputs, q/k norms over whole projections
}


def _inputs(config, rng):
    """Positions from 0 to the last cache position (a row of one key, a full row), tokens,
    and a bf16-representable cache ``[layers, 2, rows, kv_len, kv_heads, head_dim]``."""
    positions = np.concatenate([[0, KV_LEN - 1], rng.integers(1, KV_LEN - 1, ROWS - 2)])
    tokens = rng.integers(0, config.vocab_size, ROWS)
    shape = (config.num_hidden_layers, 2, ROWS, KV_LEN, config.num_key_value_heads, config.head_dim)
    cache = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16).float()
    return positions, tokens, cache


def _worse_by(fast: np.ndarray, masked: np.ndarray, reference: np.ndarray, what: str) -> None:
    """The fast bf16 step is as close to the float32 reference as the masked bf16 step (within
    2x and a small floor). A step that read keys past a row's length would attend to the
    random values there and miss by far more."""
    err_fast, err_masked = np.abs(fast - reference).max(), np.abs(masked - reference).max()
    scale = np.abs(reference).max()
    assert err_fast <= 2 * err_masked + 2e-3 * scale, (
        f"{what}: max |fast - float32| {err_fast:.3g} against masked bf16's {err_masked:.3g} (values up to {scale:.3g})"
    )


def _steps(build, fast: str, cache, t, p) -> dict:
    """One decode step of ``build(dtype, fast_form)`` in three forms: ``fast`` (bf16, the fast
    form), ``masked`` (bf16) and ``float32`` (masked): each one's logits and its cache after."""
    out = {}
    for name, dtype, flag in ((fast, torch.bfloat16, True), ("masked", torch.bfloat16, False),
                              ("float32", torch.float32, False)):  # fmt: skip
        model = build(dtype, flag)
        c = cache.to(t.device, dtype)
        with torch.no_grad():
            out[name] = model.decode(c, t, p).float().cpu().numpy()
        out[name + " cache"] = c.float().cpu().numpy()
    return out


def _writes_where_masked_does(out: dict, fast: str, cache, positions, what: str) -> None:
    """The fast step's keys and values land at each row's position, nowhere else, and are as
    close to the float32 step's as the masked bf16 step's (:func:`_worse_by`: a layer's keys
    follow the attention before it, which q/k norms can amplify past a fixed tolerance)."""
    written = np.zeros(out[fast + " cache"].shape, dtype=bool)
    written[:, :, np.arange(ROWS), positions] = True
    got, masked, reference = (out[k + " cache"][written] for k in (fast, "masked", "float32"))
    _worse_by(got, masked, reference, f"{what} cache writes")
    assert np.array_equal(out[fast + " cache"][~written], cache.numpy()[~written])


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_torch_fused_decode(case, rng):
    config = CASES[case]
    weights = seeded_weights(config, seed=3)
    positions, tokens, cache = _inputs(config, rng)
    dev = torch.device("cuda")
    t, p = torch.from_numpy(tokens).to(dev), torch.from_numpy(positions).to(dev)
    out = _steps(lambda dtype, fused: LlamaTorch(config, weights, dev, dtype, fused=fused), "fused", cache, t, p)
    assert LlamaTorch(config, weights, dev, torch.bfloat16).fused  # the default on CUDA in bf16
    _worse_by(out["fused"], out["masked"], out["float32"], f"{case} torch fused")
    _writes_where_masked_does(out, "fused", cache, positions, f"{case} torch fused")


@pytest.mark.parametrize("case", ["qwen2", "mistral-window"])
def test_gpu_torch_fused_cuda_graph(case, rng):
    """The fused step captured in a CUDA graph (after its first, compiling call) replays the
    eager fused step's bits."""
    config = CASES[case]
    model = LlamaTorch(config, seeded_weights(config, seed=4), torch.device("cuda"), torch.bfloat16)
    positions, tokens, cache = _inputs(config, rng)
    _graph_replays_eager(model, cache, torch.from_numpy(tokens).cuda(), torch.from_numpy(positions).cuda())


def _graph_replays_eager(model, cache, t, p) -> None:
    """``model``'s bf16 step captured in a CUDA graph (after one eager call, which compiles
    what it compiles) gives the eager step's logits and cache bits."""
    with torch.no_grad():
        eager_cache, graph_cache = cache.to(t.device, torch.bfloat16), cache.to(t.device, torch.bfloat16)
        want = model.decode(eager_cache, t, p)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = model.decode(graph_cache, t, p)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(graph_cache, eager_cache)


def test_gpu_gpt2_torch_flash_decode(rng):
    """GPT-2's torch step with flash attention over each row's length, against its float32
    masked step next to the bf16 masked one; its cache writes; and its CUDA-graph replay."""
    from trace_replay_app.models.gpt2 import config as gpt2_config
    from trace_replay_app.models.gpt2.torch_loop import GPT2Torch

    config = gpt2_config.GPT2Config()
    weights = gpt2_config.seeded_weights(config, seed=6)
    positions = np.concatenate([[0, KV_LEN - 1], rng.integers(1, KV_LEN - 1, ROWS - 2)])
    shape = (config.n_layer, 2, ROWS, KV_LEN, config.n_head, config.head_dim)
    cache = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16).float()
    dev = torch.device("cuda")
    t = torch.from_numpy(rng.integers(0, config.vocab_size, ROWS)).to(dev)
    p = torch.from_numpy(positions).to(dev)
    out = _steps(lambda dtype, flash: GPT2Torch(config, weights, dev, dtype, flash=flash), "flash", cache, t, p)
    assert GPT2Torch(config, weights, dev, torch.bfloat16).flash  # the default on CUDA in bf16
    _worse_by(out["flash"], out["masked"], out["float32"], "gpt2 torch flash")
    _writes_where_masked_does(out, "flash", cache, positions, "gpt2 torch flash")
    _graph_replays_eager(GPT2Torch(config, weights, dev, torch.bfloat16), cache, t, p)


@pytest.mark.parametrize("family", ["llama-qwen2", "llama-mistral-window", "llama-gemma3", "gpt2"])
def test_gpu_jax_cudnn_decode(family, rng):
    from helpers.jax_helpers import jax_gpu

    dev = jax_gpu()
    import jax
    import jax.numpy as jnp

    from trace_replay_app.drivers.jax_placement import device_params

    if family == "gpt2":
        from trace_replay_app.models.gpt2 import config as gpt2_config
        from trace_replay_app.models.gpt2.jax_loop import JAX as fam

        config = gpt2_config.GPT2Config()
        weights = gpt2_config.seeded_weights(config, seed=5)
        shape = (config.n_layer, 2, ROWS, KV_LEN, config.n_head, config.head_dim)
    else:
        from trace_replay_app.models.llama.jax_loop import JAX as fam

        config = CASES[family.removeprefix("llama-")]
        weights = seeded_weights(config, seed=5)
        shape = (config.num_hidden_layers, 2, ROWS, KV_LEN, config.num_key_value_heads, config.head_dim)
    positions = np.concatenate([[0, KV_LEN - 1], rng.integers(1, KV_LEN - 1, ROWS - 2)]).astype(np.int32)
    tokens = rng.integers(0, config.vocab_size, ROWS).astype(np.int32)
    fill = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)
    out = {}
    for name, dtype, attention in (("cudnn", jnp.bfloat16, "cudnn"), ("masked", jnp.bfloat16, "xla"),
                                   ("float32", jnp.float32, "xla")):  # fmt: skip
        params = device_params(fam, config, weights, dev, dtype)
        cache = jax.device_put(fill.astype(dtype), dev)
        if family != "gpt2":  # per layer (keys, values) tuples
            cache = (tuple(cache[i, 0] for i in range(shape[0])), tuple(cache[i, 1] for i in range(shape[0])))
        step = jax.jit(lambda p, c, t, q, a=attention: fam.decode(p, config, c, t, q, a))
        logits, _ = step(params, cache, jax.device_put(tokens, dev), jax.device_put(positions, dev))
        out[name] = np.asarray(logits.astype(jnp.float32))
    _worse_by(out["cudnn"], out["masked"], out["float32"], f"{family} jax cudnn")
