"""The Llama-family decode loop in JAX: one jitted program per decode step, replay inside it.

:func:`run_decode` decodes :class:`~trace_replay_app.records.TraceRequest` with a KV cache and
continuous batching through slots (the shared schedule, :mod:`trace_replay_app.schedule`),
forces traced requests onto their traces with :func:`trace_replay_jax.replay` inside the
jitted step (``state.tables`` passed in as an argument), and takes logprob and rank of every
token from the unmodified logits with :func:`trace_replay_jax.token_logprob_rank`, in the same
program. The PyTorch twin is ``torch_loop.run_decode``.

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.llama.config import default_config, seeded_weights
    from trace_replay_app.models.llama.jax_loop import run_decode
    from trace_replay_app.records import TraceRequest

    config = default_config("qwen3")
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()

Programs: the decode step (one per config, dtype, ``max_batch``, KV length and trace length
bucket), the prefill of one prompt (one per config, dtype and prompt length bucket, whatever
the batch) and the write of its keys and values into a slot. Buckets are powers of two, so a
run compiles a handful of programs and later runs of similar sizes reuse them. Keys and values
live in one buffer per layer (``[slots, kv_heads, kv_len, head_dim]``, donated to each step and
updated in place). Float32 matrix products run at full precision (``precision="highest"``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trace_replay_jax import ReplayTables, TraceReplayState, replay, resolve_device, token_logprob_rank

from ...records import RequestResult, TraceRequest
from ...schedule import check_device, check_run, check_sampling, collect_results, plan
from ..decode_buffers import bucket, fresh_outputs, prompt_prefix, run_chunks
from .config import LlamaConfig, check_weights, inv_freq

__all__ = ["run_decode"]


class _Carry(NamedTuple):
    """Decode state that lives on the device between steps (donated to each step).

    ``keys``/``values``: one ``[slots, kv_heads, kv_len, head_dim]`` buffer per layer, in the
    compute dtype. ``prompt_len``/``total_len``: per slot, int32 (``total_len`` = prompt + tokens
    decoded so far). ``last``: the token each row feeds next. ``step``: the next step's index
    within the current chunk of ``CHUNK`` steps; ``t``: its index in the run (the sampling
    noise of step ``t`` comes from ``fold_in(key, t)``). ``tokens``, ``argmax``, ``logprobs``,
    ``ranks``: that chunk's per-step outputs ``[CHUNK, max_batch]``.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    prompt_len: jax.Array
    total_len: jax.Array
    last: jax.Array
    step: jax.Array
    t: jax.Array
    tokens: jax.Array
    argmax: jax.Array
    logprobs: jax.Array
    ranks: jax.Array


# -- the model ----------------------------------------------------------------------------------
def _params(config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> dict:
    """Host pytree of the weights: projections transposed to ``[in, out]``, q/k/v and gate/up
    concatenated (float32; the caller casts them on the device). Absent biases/norms are left out."""

    def get(name):
        return np.asarray(weights[name], dtype=np.float32) if name in weights else None

    layers = []
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layer = {
            "ln1": get(f"model.layers.{i}.input_layernorm.weight"),
            "ln2": get(f"model.layers.{i}.post_attention_layernorm.weight"),
            "qkv_w": np.concatenate([get(a + n + ".weight") for n in ("q_proj", "k_proj", "v_proj")]).T,
            "o_w": get(a + "o_proj.weight").T,
            "gu_w": np.concatenate([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]).T,
            "down_w": get(m + "down_proj.weight").T,
        }
        optional = {
            "qkv_b": [a + n + ".bias" for n in ("q_proj", "k_proj", "v_proj")],
            "o_b": [a + "o_proj.bias"],
            "q_norm": [a + "q_norm.weight"],
            "k_norm": [a + "k_norm.weight"],
            "gu_b": [m + "gate_proj.bias", m + "up_proj.bias"],
            "down_b": [m + "down_proj.bias"],
        }
        for key, names in optional.items():
            if names[0] in weights:
                layer[key] = np.concatenate([get(n) for n in names])
        layers.append({k: np.ascontiguousarray(v) for k, v in layer.items()})
    params = {"layers": layers, "embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        params["head"] = np.ascontiguousarray(get("lm_head.weight").T)
    return params


def _mm(x, w):
    return jnp.matmul(x, w, precision="highest" if x.dtype == jnp.float32 else None)


def _linear(x, w, b=None):
    y = _mm(x, w)
    return y if b is None else y + b


def _rms(x, weight, eps: float):
    """RMSNorm as transformers computes it: in float32, rounded to ``x``'s dtype, then scaled."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


def _rotate(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos[:, None] + jnp.concatenate([-x2, x1], axis=-1) * sin[:, None]


def _layers(p, config: LlamaConfig, tokens, positions, attend, state):
    """Hidden states after the final norm ``[tokens, hidden]``, and ``state``;
    ``attend(layer, q, k, v, state)`` (rotated ``[tokens, heads or kv_heads, head_dim]``)
    returns the attention output ``[tokens, heads * head_dim]`` and the new state."""
    c, eps = config, config.rms_norm_eps
    dtype = p["embed"].dtype
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(c))[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
    x = p["embed"][tokens]
    n, d = x.shape[0], c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d, c.num_key_value_heads * d
    for i, w in enumerate(p["layers"]):
        qkv = _linear(_rms(x, w["ln1"], eps), w["qkv_w"], w.get("qkv_b"))
        q = qkv[:, :q_dim].reshape(n, c.num_attention_heads, d)
        k = qkv[:, q_dim : q_dim + kv_dim].reshape(n, c.num_key_value_heads, d)
        v = qkv[:, q_dim + kv_dim :].reshape(n, c.num_key_value_heads, d)
        if c.qk_norm:
            q, k = _rms(q, w["q_norm"], eps), _rms(k, w["k_norm"], eps)
        a, state = attend(i, _rotate(q, cos, sin), _rotate(k, cos, sin), v, state)
        x = x + _linear(a, w["o_w"], w.get("o_b"))
        gate, up = jnp.split(_linear(_rms(x, w["ln2"], eps), w["gu_w"], w.get("gu_b")), 2, axis=-1)
        x = x + _linear(jax.nn.silu(gate) * up, w["down_w"], w.get("down_b"))
    return _rms(x, p["norm"], eps), state


def _logits(p, h):
    return _mm(h, p["head"]) if "head" in p else _mm(h, p["embed"].T)


def _softmax_f32(scores, visible, dtype):
    """transformers' eager attention softmax: in float32 over visible keys, rounded to ``dtype``."""
    return jax.nn.softmax(jnp.where(visible, scores.astype(jnp.float32), -jnp.inf), axis=-1).astype(dtype)


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill(params, tokens, *, config: LlamaConfig):
    """Keys and values of ``tokens`` (``[bucket]``, positions ``0 ..``): per layer ``(k, v)``,
    each ``[kv_heads, bucket, head_dim]``. Independent of the batch: one program per bucket."""
    c = config
    n = tokens.shape[0]
    pos = jnp.arange(n)
    scale = c.head_dim**-0.5

    def attend(layer, q, k, v, kv):
        window = c.window(layer)
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible = visible & (pos[None, :] > pos[:, None] - window)
        qg = q.reshape(n, c.num_key_value_heads, c.kv_groups, c.head_dim)
        scores = jnp.einsum("qkgd,tkd->kgqt", qg, k, precision="highest" if q.dtype == jnp.float32 else None)
        probs = _softmax_f32(scores * scale, visible, q.dtype)
        out = jnp.einsum("kgqt,tkd->qkgd", probs, v, precision="highest" if q.dtype == jnp.float32 else None)
        return out.reshape(n, -1), kv + [(k.transpose(1, 0, 2), v.transpose(1, 0, 2))]

    _, kv = _layers(params, c, tokens, pos, attend, [])
    return kv


@functools.partial(jax.jit, donate_argnames=("carry",))
def _admit(carry: _Carry, kv, slot, prompt_len, last) -> _Carry:
    """A request joins ``slot``: its prefilled keys/values (``kv`` from :func:`_prefill`) go
    into the slot's cache at positions ``0 ..``; its lengths and first token are set.
    Positions past the real prompt hold padding; a decode step overwrites each before any
    query reads it (a step writes its own position first and attends to no later one)."""
    keys = tuple(jax.lax.dynamic_update_slice(buf, k[None], (slot, 0, 0, 0)) for buf, (k, _) in zip(carry.keys, kv))
    values = tuple(jax.lax.dynamic_update_slice(buf, v[None], (slot, 0, 0, 0)) for buf, (_, v) in zip(carry.values, kv))
    return carry._replace(
        keys=keys,
        values=values,
        prompt_len=carry.prompt_len.at[slot].set(prompt_len),
        total_len=carry.total_len.at[slot].set(prompt_len),
        last=carry.last.at[slot].set(last),
    )


def _decode(p, config: LlamaConfig, carry: _Carry, positions):
    """One token per row: row ``b`` feeds ``carry.last[b]`` at ``positions[b]`` to slot ``b``'s
    cache. Returns ``(logits [rows, vocab] in the compute dtype, keys, values)``."""
    c = config
    rows = jnp.arange(positions.shape[0])
    kpos = jnp.arange(carry.keys[0].shape[2])
    scale = c.head_dim**-0.5
    masks = {}
    for layer in range(c.num_hidden_layers):
        w = c.window(layer)
        if w not in masks:
            visible = kpos[None, :] <= positions[:, None]
            if w:
                visible = visible & (kpos[None, :] > positions[:, None] - w)
            masks[w] = visible[:, None, None, :]  # [rows, 1, 1, kv_len]

    def attend(layer, q, k, v, kv):
        keys, values = kv
        kb = keys[layer].at[rows, :, positions].set(k)
        vb = values[layer].at[rows, :, positions].set(v)
        qg = q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim)
        prec = "highest" if q.dtype == jnp.float32 else None
        scores = jnp.einsum("bkgd,bktd->bkgt", qg, kb, precision=prec) * scale
        probs = _softmax_f32(scores, masks[c.window(layer)], q.dtype)
        out = jnp.einsum("bkgt,bktd->bkgd", probs, vb, precision=prec).reshape(q.shape[0], -1)
        return out, (keys[:layer] + (kb,) + keys[layer + 1 :], values[:layer] + (vb,) + values[layer + 1 :])

    h, (keys, values) = _layers(p, c, carry.last, positions, attend, (carry.keys, carry.values))
    return _logits(p, h), keys, values


@functools.partial(jax.jit, static_argnames=("config", "sample"), donate_argnames=("carry",))
def _step(
    params, tables: ReplayTables, idx_chunk, carry: _Carry, key, temperature, *, config: LlamaConfig, sample: bool
) -> _Carry:
    """One decode step of every row: logits, (sampling), replay, then one pass over the logits
    (:func:`trace_replay_jax.token_logprob_rank` with ``argmax=True``) for logprob, rank and the
    greedy token, append. Greedy: rows start at -1 ("not drawn"), replay writes the traced rows,
    the logprob call scores the -1 rows as their argmax, and those rows take it."""
    k = carry.step
    idx_mapping = idx_chunk[k]  # row -> slot, -1: empty row (this chunk's schedule)
    active = idx_mapping >= 0
    positions = jnp.where(active, carry.total_len - 1, 0)  # empty rows: anywhere in range
    logits, keys, values = _decode(params, config, carry, positions)
    drawn = jnp.full(idx_mapping.shape, -1, jnp.int32)  # greedy: the argmax, chosen below
    if sample:  # Gumbel-max over logits / temperature
        noise = jax.random.gumbel(jax.random.fold_in(key, carry.t), logits.shape, jnp.float32)
        drawn = jnp.argmax(logits.astype(jnp.float32) / temperature + noise, axis=-1).astype(jnp.int32)
    sampled = replay(tables, drawn, idx_mapping, carry.total_len, carry.prompt_len)  # -1 rows stay -1
    # One read of the logits: logprob and rank of each row's token (a -1 row: of its argmax), and
    # the argmax (ties: the lowest id; NaN never chosen).
    logprobs, ranks, argmax = token_logprob_rank(logits, sampled, argmax=True)
    sampled = jnp.where(sampled < 0, argmax, sampled)
    return _Carry(
        keys=keys,
        values=values,
        prompt_len=carry.prompt_len,
        total_len=carry.total_len + active.astype(jnp.int32),
        last=jnp.where(active, sampled, carry.last),
        step=k + 1,
        t=carry.t + 1,
        tokens=carry.tokens.at[k].set(sampled),
        argmax=carry.argmax.at[k].set(argmax),
        logprobs=carry.logprobs.at[k].set(logprobs),
        ranks=carry.ranks.at[k].set(ranks.astype(jnp.int32)),
    )


# -- the loop -----------------------------------------------------------------------------------
def run_decode(
    config: LlamaConfig,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    *,
    device: str = "cpu",
    max_batch: int = 8,
    on_step: Callable[[int], None] | None = None,
    dtype: str = "float32",
    temperature: float = 0.0,
    seed: int = 0,
) -> list[RequestResult]:
    """Decode ``requests`` with the Llama-family model ``config``/``weights``, replaying traces.

    Arguments and results as in ``torch_loop.run_decode`` (the family contract of
    :mod:`trace_replay_app.models.family`), except the sampling noise: with ``temperature``
    above 0, untraced rows sample from ``softmax(logits / temperature)`` by Gumbel-max, the
    noise of step ``t`` drawn from ``jax.random.fold_in(jax.random.key(seed), t)``, so the
    same arguments give the same tokens (not the torch loop's tokens). Token ids are int32 on
    the device and int64 in the results.

    Each step is one jitted program (caches and outputs donated): logits, (sampling), replay
    with ``state.tables`` passed in, logprob/rank/argmax in one read of the logits (greedy rows
    take the argmax), append; ``state.apply_staged_writes()`` runs
    between steps. Nothing waits for the device between steps; outputs are copied to the host
    once at the end. Arguments are checked before anything runs (``TypeError`` / ``ValueError``
    naming the argument); a rejected call does nothing.
    """
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=LlamaConfig, check_weights=check_weights
    )
    temperature = check_sampling(dtype, temperature, seed)
    check_device(device)
    dev = resolve_device(device)  # ValueError when JAX has no such device
    schedule = plan([r.new_tokens for r in requests], max_batch)
    outputs = None
    if schedule.n_steps:
        outputs = _decode_all(
            config, weights, prompts, traces, schedule, dev, on_step, getattr(jnp, dtype), temperature, seed
        )
    return collect_results(requests, schedule, outputs)


def _decode_all(
    config, weights, prompts, traces, schedule, dev, on_step, dtype, temperature, seed
) -> dict[str, np.ndarray]:
    """Run every step of ``schedule``; return the per-step outputs ``[n_steps, max_batch]`` on the host."""
    c = config
    rows = schedule.max_batch
    kv_len = bucket(schedule.kv_positions([len(p) for p in prompts]), c.n_positions)
    put = functools.partial(jax.device_put, device=dev)
    params = jax.tree.map(lambda w: put(w).astype(dtype), _params(c, weights))
    key = put(jax.random.key(seed))
    temp = put(np.float32(temperature if temperature > 0 else 1.0))
    cache_shape = (rows, c.num_key_value_heads, kv_len, c.head_dim)
    with jax.default_device(dev):
        empty = [jnp.zeros(cache_shape, dtype) for _ in range(2 * c.num_hidden_layers)]
    carry = _Carry(
        keys=tuple(empty[: c.num_hidden_layers]),
        values=tuple(empty[c.num_hidden_layers :]),
        **put(
            dict(
                prompt_len=np.zeros(rows, np.int32),
                total_len=np.zeros(rows, np.int32),
                last=np.zeros(rows, np.int32),
                t=np.zeros((), np.int32),
                **fresh_outputs(rows),
            )
        ),
    )

    def admit(carry: _Carry, slot: int, prompt) -> _Carry:
        kv = _prefill(params, put(prompt_prefix(prompt, kv_len)), config=c)
        return _admit(carry, kv, np.int32(slot), np.int32(len(prompt)), np.int32(prompt[-1]))

    def step(carry: _Carry, tables: ReplayTables, idx_chunk) -> _Carry:
        return _step(params, tables, idx_chunk, carry, key, temp, config=c, sample=temperature > 0)

    max_trace = bucket(max((len(t) for t in traces if t is not None), default=1), c.n_positions)
    with TraceReplayState(rows, max_trace, device=dev, vocab_size=c.vocab_size) as state:
        return run_chunks(
            schedule,
            prompts,
            traces,
            state,
            carry,
            put=put,
            fetch=jax.device_get,
            admit=admit,
            step=step,
            on_step=on_step,
        )
