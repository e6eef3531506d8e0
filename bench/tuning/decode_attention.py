"""Which decode attention and step form for the Llama loops? (a trial behind bench/models.py)

Per framework and batch (64, 256), Qwen2.5-0.5B shape in bf16, a KV cache of 1,024 positions
per row with each row's length drawn from 204-1,024: ms per decode step of the model's
``decode`` alone (no replay, no logprob), and the largest logit difference from the shipped
step. Candidates:

- torch, each captured in a CUDA graph: the shipped step (masked matmul attention over the
  capacity); the same under ``torch.compile``; flash attention over each row's length
  (``aten._flash_attention_forward`` with ``seqused_k``, keys laid out ``[slots, kv_len,
  kv_heads, head_dim]``), eager and compiled; ``flex_attention`` with a block mask of the
  rows' lengths, compiled.
- JAX, 32 steps in one ``lax.fori_loop``: the shipped step; ``jax.nn.dot_product_attention``
  with ``key_value_seq_lengths``, cuDNN and XLA, keys laid out ``[slots, kv_len, kv_heads,
  head_dim]``.

Run: ``python bench/tuning/decode_attention.py [--frameworks torch,jax]`` on the GPU; prints
one JSON line per candidate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from trace_replay_app.models.llama.config import LlamaConfig, seeded_weights  # noqa: E402

CONFIG = LlamaConfig(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    qkv_bias=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
KV_LEN = 1024
STEPS = 32


def _lengths(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(KV_LEN // 5, KV_LEN + 1, batch)


# -- torch ----------------------------------------------------------------------------------------
def _torch_rows(weights, batches):
    import torch
    import torch.nn.functional as F

    from trace_replay_app.models.llama.torch_loop import LlamaTorch, _rms, _rotate

    c = CONFIG
    dev = torch.device("cuda")
    model = LlamaTorch(c, weights, dev, torch.bfloat16)

    def flash_decode(cache, tokens, positions):  # cache [layers, 2, slots, kv_len, kv_heads, d]
        rows = torch.arange(tokens.shape[0], device=dev)
        b, L = cache.shape[2], cache.shape[3]
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
        cu_k = cu_q * L
        used = (positions + 1).to(torch.int32)

        def attend(layer, q, k, v):
            keys, values = cache[layer, 0], cache[layer, 1]
            keys[rows, positions] = k
            values[rows, positions] = v
            out = torch.ops.aten._flash_attention_forward(
                q,
                keys.view(b * L, c.num_key_value_heads, c.head_dim),
                values.view(b * L, c.num_key_value_heads, c.head_dim),
                cu_q,
                cu_k,
                1,
                L,
                0.0,
                False,
                False,
                scale=model.scale,
                seqused_k=used,
            )[0]
            return out.reshape(q.shape[0], -1)

        return model.logits(model._layers(tokens, positions, attend))

    def pre(x, ln1, qkv_w, qkv_b, cos, sin):
        h = F.linear(_rms(x, ln1, c.rms_norm_eps), qkv_w, qkv_b)
        q, k, v = h.split(model.split, dim=-1)
        n = x.shape[0]
        q = _rotate(q.reshape(n, c.num_attention_heads, c.head_dim), cos, sin)
        k = _rotate(k.reshape(n, c.num_key_value_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(n, c.num_key_value_heads, c.head_dim)

    def post(x, a, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b):
        x = x + F.linear(a, o_w, o_b)
        gate, up = F.linear(_rms(x, ln2, c.rms_norm_eps), gu_w, gu_b).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, down_w, down_b)

    cpre, cpost = torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False)

    def segmented(flat):
        def decode(cache, tokens, positions):
            rows = torch.arange(tokens.shape[0], device=dev)
            freqs = positions.float()[:, None] * model.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(model.dtype), emb.sin().to(model.dtype)
            x = model.embed[tokens]
            b, L = cache.shape[2], cache.shape[3] if flat else cache.shape[4]
            cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
            cu_k, used = cu_q * L, (positions + 1).to(torch.int32)
            kpos = torch.arange(L, device=dev)
            hidden = (kpos[None, :] > positions[:, None])[:, None, None, :]
            for i, w in enumerate(model.layers):
                q, k, v = cpre(x, w["ln1"], w["qkv_w"], w["qkv_b"], cos, sin)
                keys, values = cache[i, 0], cache[i, 1]
                if flat:
                    keys[rows, positions] = k
                    values[rows, positions] = v
                    kv = (b * L, c.num_key_value_heads, c.head_dim)
                    a = torch.ops.aten._flash_attention_forward(
                        q,
                        keys.view(kv),
                        values.view(kv),
                        cu_q,
                        cu_k,
                        1,
                        L,
                        0.0,
                        False,
                        False,
                        scale=model.scale,
                        seqused_k=used,
                    )[0].reshape(b, -1)
                else:
                    keys[rows, :, positions] = k
                    values[rows, :, positions] = v
                    qg = q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim)
                    scores = torch.matmul(qg, keys.transpose(-1, -2)) * model.scale
                    probs = scores.float().masked_fill(hidden, float("-inf")).softmax(dim=-1)
                    a = torch.matmul(probs.to(model.dtype), values).reshape(b, -1)
                x = cpost(x, a, w["o_w"], w["o_b"], w["ln2"], w["gu_w"], w["gu_b"], w["down_w"], w["down_b"])
            return model.logits(_rms(x, model.norm, c.rms_norm_eps))

        return decode

    def shipped_cache(b):
        return model.new_cache(b, KV_LEN)

    def flat_cache(b):
        shape = (c.num_hidden_layers, 2, b, KV_LEN, c.num_key_value_heads, c.head_dim)
        return torch.zeros(shape, dtype=torch.bfloat16, device=dev)

    candidates = {
        "torch mask eager": (model.decode, shipped_cache, False),
        "torch flash eager": (flash_decode, flat_cache, True),
        "torch mask segments compiled": (segmented(False), shipped_cache, False),
        "torch flash segments compiled": (segmented(True), flat_cache, True),
    }
    out = []
    _profile_eager(model, shipped_cache(64), torch.arange(64, device=dev), torch.full((64,), 600, device=dev))
    for batch in batches:
        lengths = _lengths(batch)
        gen = torch.Generator(device="cpu").manual_seed(batch)
        fill = torch.randn((c.num_hidden_layers, 2, batch, c.num_key_value_heads, KV_LEN, c.head_dim), generator=gen)
        fill = (fill * 0.5).to(dev, torch.bfloat16)
        tokens = torch.randint(0, c.vocab_size, (batch,), generator=gen).to(dev)
        positions = torch.as_tensor(lengths - 1, device=dev)
        ref = None
        for name, (fn, new_cache, flat) in candidates.items():
            row = {"candidate": name, "batch": batch, "mean_len": float(lengths.mean())}
            try:
                cache = new_cache(batch)
                cache.copy_(fill.transpose(3, 4) if flat else fill)
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
                if ref is None:
                    ref = first
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
def _jax_rows(weights, batches):
    import jax
    import jax.numpy as jnp

    from trace_replay_app.drivers.jax_driver import device_params
    from trace_replay_app.models.llama import jax_loop

    c = CONFIG
    dev = jax.devices()[0]
    params = device_params(jax_loop.JAX, c, weights, dev, jnp.bfloat16)
    scale = c.head_dim**-0.5

    def dpa_decode(implementation):
        def decode(p, cache, tokens, positions):
            rows = jnp.arange(positions.shape[0])
            lengths = (positions + 1).astype(jnp.int32)

            def attend(layer, q, k, v, kv):
                keys, values = kv
                kb = keys[layer].at[rows, positions].set(k)
                vb = values[layer].at[rows, positions].set(v)
                out = jax.nn.dot_product_attention(
                    q[:, None], kb, vb, scale=scale, key_value_seq_lengths=lengths, implementation=implementation
                )
                new = (keys[:layer] + (kb,) + keys[layer + 1 :], values[:layer] + (vb,) + values[layer + 1 :])
                return out.reshape(q.shape[0], -1), new

            h, cache = jax_loop._layers(p, c, tokens, positions, attend, cache)
            return jax_loop._logits(p, h), cache

        return decode

    def shipped(p, cache, tokens, positions):
        return jax_loop._decode(p, c, cache, tokens, positions)

    candidates = {"jax mask": (shipped, False), "jax dpa cudnn": (dpa_decode("cudnn"), True)}
    out = []
    for batch in batches:
        lengths = _lengths(batch)
        rng = np.random.default_rng(batch)
        fill = 0.5 * rng.standard_normal((c.num_hidden_layers, batch, c.num_key_value_heads, KV_LEN, c.head_dim))
        fill = jax.device_put(fill.astype(np.float32), dev).astype(jnp.bfloat16)
        tokens = jax.device_put(rng.integers(0, c.vocab_size, batch).astype(np.int32), dev)
        positions = jax.device_put((lengths - 1).astype(np.int32), dev)
        ref = None
        for name, (fn, flat) in candidates.items():
            row = {"candidate": name, "batch": batch, "mean_len": float(lengths.mean())}
            try:
                layer_fill = [fill[i].transpose(0, 2, 1, 3) if flat else fill[i] for i in range(c.num_hidden_layers)]
                cache = (tuple(layer_fill), tuple(x + 0 for x in layer_fill))

                @jax.jit
                def one(p, cache, tokens, positions, fn=fn):
                    return fn(p, cache, tokens, positions)[0]

                @functools.partial(jax.jit, donate_argnums=1)
                def loop(p, cache, tokens, positions, fn=fn, batch=batch):
                    def body(i, carry):
                        cache, acc = carry
                        logits, cache = fn(p, cache, tokens, positions)
                        return cache, acc + logits[:, :1].astype(jnp.float32)

                    return jax.lax.fori_loop(0, STEPS, body, (cache, jnp.zeros((batch, 1), jnp.float32)))

                t0 = time.perf_counter()
                first = np.asarray(one(params, cache, tokens, positions).astype(jnp.float32))
                cache = jax.block_until_ready(loop(params, cache, tokens, positions))[0]
                row["warm_s"] = time.perf_counter() - t0
                if ref is None:
                    ref = first
                row["max_logit_diff"] = float(np.abs(first - ref).max())
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    cache = jax.block_until_ready(loop(params, cache, tokens, positions))[0]
                    times.append((time.perf_counter() - t0) * 1e3 / STEPS)
                row["ms_per_step"] = float(np.median(times))
                row["ms_spread"] = [float(min(times)), float(max(times))]
                step = jax.jit(lambda p, cache, t, q, fn=fn: fn(p, cache, t, q), donate_argnums=1)
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
