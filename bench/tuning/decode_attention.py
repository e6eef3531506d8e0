"""Which decode attention and step form for the Llama loops? (the trial behind the shipped choice)

Per framework and batch (64, 256), Qwen2.5-0.5B shape in bf16, a KV cache of 1,024 positions
per row with each row's length drawn from 204-1,024: ms per decode step of the model's
``decode`` alone (no replay, no logprob), and the largest logit difference from the first
candidate. Candidates:

- torch, each captured in a CUDA graph: ``LlamaTorch(fused=False)`` (eager layers, masked
  attention over the capacity: the CPU/float32 form); ``fused=True`` (the shipped default on
  CUDA: compiled layer pieces, flash attention with ``seqused_k``); the masked and the fused
  step under ``torch.compile`` whole (their KV writes now ``index_put_`` on the cache, which
  compiles to an in-place write: the earlier whole-step rows, 23.7 / 90.7 ms, came from a write
  through a view that compiled to a copy of the cache at every write); and ``flex_attention``
  with a block mask of the rows' lengths in a compiled step. Before these, a profile of the
  eager masked step (kernels by device time).
- JAX, 32 steps in one ``lax.fori_loop`` and 32 dispatched jitted steps: the family's decode
  with ``attention="xla"`` (masked over the capacity: the float32 and mesh form) and
  ``"cudnn"`` (the shipped GPU form); and the masked form as it was before
  ``drivers/jax_attention.py`` (``einsum`` contractions, which XLA lowers by transposing each
  layer's cache first), written here as ``xla-einsum``.

Run: ``python bench/tuning/decode_attention.py [--frameworks torch,jax] [--batches 64,256]``
on the GPU; prints one JSON line per candidate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qwen_shape import FULL, QWEN2_OPTIONS  # noqa: E402

from trace_replay_app.models.llama.config import LlamaConfig, seeded_weights  # noqa: E402

CONFIG = LlamaConfig(model_type="qwen2", qkv_bias=True, **FULL["sizes"], **QWEN2_OPTIONS)  # Qwen2.5-0.5B's shape
KV_LEN = 1024
STEPS = 32


def _lengths(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(KV_LEN // 5, KV_LEN + 1, batch)


# -- torch ----------------------------------------------------------------------------------------
def _torch_rows(weights, batches):
    import torch

    from trace_replay_app.models.llama.torch_loop import LlamaTorch

    c = CONFIG
    dev = torch.device("cuda")
    masked = LlamaTorch(c, weights, dev, torch.bfloat16, fused=False)
    fused = LlamaTorch(c, weights, dev, torch.bfloat16, fused=True)

    def flex_decode(cache, tokens, positions):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from trace_replay_app.drivers.torch_attention import store_step_kv

        rows = torch.arange(tokens.shape[0], device=dev)
        b, kv_len = cache.shape[2], cache.shape[3]
        mask = create_block_mask(lambda bi, h, qi, ki: ki <= positions[bi], b, None, 1, kv_len, device=dev)

        def attend(layer, q, k, v):
            store_step_kv(cache, masked._index, layer, rows, positions, k, v)  # in place when compiled
            keys, values = cache[layer, 0].transpose(1, 2), cache[layer, 1].transpose(1, 2)
            out = flex_attention(q[:, :, None], keys, values, block_mask=mask, scale=masked.scale, enable_gqa=True)
            return out.reshape(q.shape[0], -1)

        return masked.logits(masked._layers(tokens, positions, attend))

    candidates = {
        "torch masked (fused=False)": masked.decode,
        "torch fused (shipped)": fused.decode,
        "torch masked, whole step compiled": torch.compile(masked.decode, dynamic=False),
        "torch fused, whole step compiled": torch.compile(fused.decode, dynamic=False),
        "torch flex, whole step compiled": torch.compile(flex_decode, dynamic=False),
    }
    out = []
    _profile_eager(
        masked, masked.new_cache(64, KV_LEN), torch.arange(64, device=dev), torch.full((64,), 600, device=dev)
    )
    for batch in batches:
        lengths = _lengths(batch)
        gen = torch.Generator(device="cpu").manual_seed(batch)
        shape = (c.num_hidden_layers, 2, batch, KV_LEN, c.num_key_value_heads, c.head_dim)
        fill = (torch.randn(shape, generator=gen) * 0.5).to(dev, torch.bfloat16)
        tokens = torch.randint(0, c.vocab_size, (batch,), generator=gen).to(dev)
        positions = torch.as_tensor(lengths - 1, device=dev)
        ref = None
        for name, fn in candidates.items():
            row = {"candidate": name, "batch": batch, "mean_len": float(lengths.mean())}
            try:
                cache = fill.clone()
                t0 = time.perf_counter()
                with torch.no_grad():
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(2):
                            logits = fn(cache, tokens, positions)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        logits = fn(cache, tokens, positions)
                torch.cuda.synchronize()
                row["warm_s"] = time.perf_counter() - t0
                graph.replay()
                torch.cuda.synchronize()
                first = logits.float().clone()
                ref = first if ref is None else ref
                row["max_logit_diff"] = float((first - ref).abs().max())
                times = []
                for _ in range(5):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(STEPS):
                        graph.replay()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / STEPS)
                row["ms_per_step"] = float(np.median(times))
                row["ms_spread"] = [float(min(times)), float(max(times))]
                del graph
            except Exception as exc:  # a candidate that does not run is a finding, not a stop
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            out.append(row)
            torch.cuda.empty_cache()
    return out


def _profile_eager(model, cache, tokens, positions):
    """The eager shipped step's kernels by total device time (one step after a warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model.decode(cache, tokens, positions)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.decode(cache, tokens, positions)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    kernels = sum(e.count for e in events)
    print(json.dumps({"profile": "torch mask eager, B=64", "kernels": kernels, "device_us": total}))
    for e in events[:14]:
        print(json.dumps({"kernel": e.key[:90], "count": e.count, "us": round(e.device_time_total, 1)}))


# -- JAX ------------------------------------------------------------------------------------------
def _einsum_decode(p, cache, tokens, positions):
    """The family's masked decode step as it was written before ``drivers/jax_attention.py``:
    ``einsum`` contractions over the ``[rows, kv_len, kv_heads, head_dim]`` cache (bf16)."""
    import jax
    import jax.numpy as jnp

    from trace_replay_app.models.llama import jax_loop

    c = CONFIG
    rows, kpos = jnp.arange(positions.shape[0]), jnp.arange(cache[0][0].shape[1])
    visible = (kpos[None, :] <= positions[:, None])[:, None, None, :]

    def attend(layer, q, k, v, kv):
        keys, values = kv
        kb, vb = keys[layer].at[rows, positions].set(k), values[layer].at[rows, positions].set(v)
        qg = q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim)
        scores = jnp.einsum("bkgd,btkd->bkgt", qg, kb) * c.head_dim**-0.5
        probs = jax.nn.softmax(jnp.where(visible, scores.astype(jnp.float32), -jnp.inf), axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgt,btkd->bkgd", probs, vb).reshape(q.shape[0], -1)
        return out, (keys[:layer] + (kb,) + keys[layer + 1 :], values[:layer] + (vb,) + values[layer + 1 :])

    h, cache = jax_loop._layers(p, c, tokens, positions, attend, cache)
    return jax_loop._logits(p, h), cache


def _jax_rows(weights, batches):
    import jax
    import jax.numpy as jnp

    from trace_replay_app.drivers.jax_placement import device_params
    from trace_replay_app.models.llama.jax_loop import JAX

    c = CONFIG
    dev = jax.devices()[0]
    params = device_params(JAX, c, weights, dev, jnp.bfloat16)
    out = []
    for batch in batches:
        lengths = _lengths(batch)
        rng = np.random.default_rng(batch)
        shape = (c.num_hidden_layers, batch, KV_LEN, c.num_key_value_heads, c.head_dim)
        fill = jax.device_put((0.5 * rng.standard_normal(shape)).astype(np.float32), dev).astype(jnp.bfloat16)
        tokens = jax.device_put(rng.integers(0, c.vocab_size, batch).astype(np.int32), dev)
        positions = jax.device_put((lengths - 1).astype(np.int32), dev)
        ref = None
        for attention in ("xla", "cudnn", "xla-einsum"):
            row = {"candidate": f"jax attention={attention}", "batch": batch, "mean_len": float(lengths.mean())}
            try:
                layers = [fill[i] for i in range(c.num_hidden_layers)]
                cache = (tuple(layers), tuple(x + 0 for x in layers))

                def fn(p, cache, t, q, attention=attention):
                    if attention == "xla-einsum":
                        return _einsum_decode(p, cache, t, q)
                    return JAX.decode(p, c, cache, t, q, attention)

                @functools.partial(jax.jit, donate_argnums=1)
                def loop(p, cache, tokens, positions, fn=fn, batch=batch):
                    def body(i, carry):
                        cache, acc = carry
                        logits, cache = fn(p, cache, tokens, positions)
                        return cache, acc + logits[:, :1].astype(jnp.float32)

                    return jax.lax.fori_loop(0, STEPS, body, (cache, jnp.zeros((batch, 1), jnp.float32)))

                t0 = time.perf_counter()
                first = np.asarray(jax.jit(fn)(params, cache, tokens, positions)[0].astype(jnp.float32))
                cache = jax.block_until_ready(loop(params, cache, tokens, positions))[0]
                row["warm_s"] = time.perf_counter() - t0
                ref = first if ref is None else ref
                row["max_logit_diff"] = float(np.abs(first - ref).max())
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    cache = jax.block_until_ready(loop(params, cache, tokens, positions))[0]
                    times.append((time.perf_counter() - t0) * 1e3 / STEPS)
                row["ms_per_step"] = float(np.median(times))
                row["ms_spread"] = [float(min(times)), float(max(times))]
                step = jax.jit(fn, donate_argnums=1)
                _, cache = step(params, cache, tokens, positions)
                jax.block_until_ready(cache)
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    _, cache = step(params, cache, tokens, positions)
                jax.block_until_ready(cache)
                row["ms_per_step_dispatched"] = (time.perf_counter() - t0) * 1e3 / STEPS
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--batches", default="64,256")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    weights = seeded_weights(CONFIG)
    print(f"weights in {time.perf_counter() - t0:.1f} s", flush=True)
    if "jax" in args.frameworks:
        _jax_rows(weights, batches)
    if "torch" in args.frameworks:
        _torch_rows(weights, batches)


if __name__ == "__main__":
    main()
