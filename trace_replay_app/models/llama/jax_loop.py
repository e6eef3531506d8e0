"""The Llama family's math in JAX, and its ``run_decode`` on the shared JAX driver.

The functions here are the family's side of :class:`~trace_replay_app.drivers.jax_driver.JaxFamily`
(parameters, KV cache, prefill, write, decode); :data:`JAX` tells the driver about them and
:func:`run_decode` is the driver bound to them (:func:`trace_replay_app.drivers.jax_driver.decoder`:
slots, schedule, jitted admission and step with replay and logprob/rank inside, and ``mesh=``
for the logits sharded over the vocabulary).

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.llama.config import default_config, seeded_weights
    from trace_replay_app.models.llama.jax_loop import run_decode
    from trace_replay_app.records import TraceRequest

    config = default_config("qwen3")
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()

Keys and values live in one buffer per layer (``([slots, kv_len, kv_heads, head_dim], ...)``
for keys, then values; donated to each step and updated in place). Float32 matrix products run
at full precision (``precision="highest"``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ...drivers.jax_attention import cache_mix, cache_scores
from ...drivers.jax_driver import JaxFamily, decoder
from ...drivers.jax_score import scorer
from .config import LlamaConfig, check_weights, inv_freq, layer_norm_names

__all__ = ["JAX", "run_decode", "run_score"]


# -- the model ----------------------------------------------------------------------------------
def _params(config: LlamaConfig, weights: Mapping[str, np.ndarray], head: bool = False) -> dict:
    """Host pytree of the weights: projections transposed to ``[in, out]``, q/k/v and gate/up
    concatenated (float32; the caller casts them on the device). Absent biases/norms are left
    out. ``head``: the output projection as ``"head"`` even when tied (a copy of the embedding's
    transpose)."""

    def get(name):
        return np.asarray(weights[name], dtype=np.float32) if name in weights else None

    layers = []
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layer = {
            **{role: get(f"model.layers.{i}.{name}.weight") for role, name in layer_norm_names(config).items()},
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
    if config.final_logit_softcapping:  # cast to the compute dtype with the weights
        params["logit_cap"] = np.float32(config.final_logit_softcapping)
    if not config.tie_word_embeddings:
        params["head"] = np.ascontiguousarray(get("lm_head.weight").T)
    elif head:
        params["head"] = np.ascontiguousarray(params["embed"].T)
    return params


def _mm(x, w):
    return jnp.matmul(x, w, precision="highest" if x.dtype == jnp.float32 else None)


def _linear(x, w, b=None):
    y = _mm(x, w)
    return y if b is None else y + b


def _rms(x, weight, eps: float, style: str = "llama"):
    """RMSNorm as transformers computes it for ``style`` (``LlamaConfig.norm_style`` says how)."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    if style == "llama":
        return weight * h.astype(x.dtype)
    w = weight.astype(jnp.float32)
    return (h * (w + 1.0 if style == "gemma" else w)).astype(x.dtype)


def _act(gate, act: str):
    return jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)


def _rotate(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos[:, None] + jnp.concatenate([-x2, x1], axis=-1) * sin[:, None]


def _cos_sin(positions, inv: np.ndarray, factor: float, dtype):
    """The rotary cos and sin of ``positions`` in ``dtype``: the angles in float32, cos and sin
    scaled by ``factor`` (YaRN) before rounding, as transformers."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if factor != 1:
        cos, sin = cos * factor, sin * factor
    return cos.astype(dtype), sin.astype(dtype)


def _layers(p, config: LlamaConfig, tokens, positions, attend, state):
    """Hidden states after the final norm ``[tokens, hidden]``, and ``state``;
    ``attend(layer, q, k, v, state)`` (rotated ``[tokens, heads or kv_heads, head_dim]``)
    returns the attention output ``[tokens, heads * head_dim]`` and the new state."""
    c, eps = config, config.rms_norm_eps
    dtype = p["embed"].dtype
    rope = _cos_sin(positions, inv_freq(c), c.rope_attention_factor, dtype)
    local = _cos_sin(positions, inv_freq(c, sliding=True), 1.0, dtype) if c.sliding_rope_theta else rope
    x = p["embed"][tokens]
    if c.embed_scale:  # Gemma: sqrt(hidden_size) as transformers' float32 buffer, rounded to the compute dtype
        x = x * jnp.asarray(np.float32(c.hidden_size**0.5)).astype(dtype)
    n, d = x.shape[0], c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d, c.num_key_value_heads * d
    style, pre, post = c.norm_style, c.norm_placement != "post", c.norm_placement != "pre"
    whole = c.qk_norm and style == "olmo"  # q/k norms over the whole projections, else per head
    for i, w in enumerate(p["layers"]):
        cos, sin = local if c.window(i) else rope
        rotate = _rotate if i not in c.nope_layers else (lambda x, cos, sin: x)  # SmolLM3's NoPE layers
        qkv = _linear(_rms(x, w["attention_in"], eps, style) if pre else x, w["qkv_w"], w.get("qkv_b"))
        q, k, v = qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]
        if whole:
            q, k = _rms(q, w["q_norm"], eps, style), _rms(k, w["k_norm"], eps, style)
        q = q.reshape(n, c.num_attention_heads, d)
        k, v = k.reshape(n, c.num_key_value_heads, d), v.reshape(n, c.num_key_value_heads, d)
        if c.qk_norm and not whole:
            q, k = _rms(q, w["q_norm"], eps, style), _rms(k, w["k_norm"], eps, style)
        a, state = attend(i, rotate(q, cos, sin), rotate(k, cos, sin), v, state)
        out = _linear(a, w["o_w"], w.get("o_b"))
        x = x + (_rms(out, w["attention_out"], eps, style) if post else out)
        h = _rms(x, w["mlp_in"], eps, style) if pre else x
        gate, up = jnp.split(_linear(h, w["gu_w"], w.get("gu_b")), 2, axis=-1)
        out = _linear(_act(gate, c.hidden_act) * up, w["down_w"], w.get("down_b"))
        x = x + (_rms(out, w["mlp_out"], eps, style) if post else out)
    return _rms(x, p["norm"], eps, style), state


def _logits(p, h):
    """The output projection of ``h``, soft-capped by ``p["logit_cap"]`` when the model has one."""
    logits = _mm(h, p["head"]) if "head" in p else _mm(h, p["embed"].T)
    return _softcap(logits, p["logit_cap"].astype(logits.dtype)) if "logit_cap" in p else logits


def _softcap(x, cap):
    """``cap * tanh(x / cap)`` in ``x``'s dtype, as transformers soft-caps (``cap``: an array,
    or a config's float where 0 means none)."""
    return x if isinstance(cap, float) and not cap else jnp.tanh(x / cap) * cap


def _softmax_f32(scores, visible, dtype, axis: int = -1):
    """transformers' eager attention softmax: in float32 over visible keys (along ``axis``),
    rounded to ``dtype``."""
    return jax.nn.softmax(jnp.where(visible, scores.astype(jnp.float32), -jnp.inf), axis=axis).astype(dtype)


def _prefill(params, config: LlamaConfig, tokens):
    """Keys and values of ``tokens`` (``[bucket]``, positions ``0 ..``): per layer ``(k, v)``,
    each ``[bucket, kv_heads, head_dim]``."""
    c = config
    n = tokens.shape[0]
    pos = jnp.arange(n)
    scale = c.attention_scale

    def attend(layer, q, k, v, kv):
        window = c.window(layer)
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible = visible & (pos[None, :] > pos[:, None] - window)
        qg = q.reshape(n, c.num_key_value_heads, c.kv_groups, c.head_dim)
        scores = jnp.einsum("qkgd,tkd->kgqt", qg, k, precision="highest" if q.dtype == jnp.float32 else None)
        probs = _softmax_f32(_softcap(scores * scale, c.attn_logit_softcapping), visible, q.dtype)
        out = jnp.einsum("kgqt,tkd->qkgd", probs, v, precision="highest" if q.dtype == jnp.float32 else None)
        return out.reshape(n, -1), kv + [(k, v)]

    return _layers(params, c, tokens, pos, attend, [])[1]


def _hidden(params, config: LlamaConfig, tokens, attention: str = "xla"):
    """Teacher-forced: the final-norm hidden states ``[requests, n, hidden]`` of right-padded
    ``tokens`` ``[requests, n]``. In bfloat16 the attention is :func:`jax.nn.dot_product_attention`
    of ``attention`` (``"cudnn"``: cuDNN's fused attention on a GPU, the ``[n, n]`` scores never
    stored; ``"xla"``); in float32 transformers' eager form at full precision, as decode."""
    c = config
    r, n = tokens.shape
    pos = jnp.arange(n)
    scale = c.attention_scale

    def attend(layer, q, k, v, state):
        q, k, v = (t.reshape(r, n, t.shape[1], c.head_dim) for t in (q, k, v))
        window = c.window(layer)
        if q.dtype != jnp.float32 and not c.attn_logit_softcapping:  # fused attention takes no soft cap
            local = (window - 1, 0) if window else None
            out = jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation=attention
            )
            return out.reshape(r * n, -1), state
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible = visible & (pos[None, :] > pos[:, None] - window)
        qg = q.reshape(r, n, c.num_key_value_heads, c.kv_groups, c.head_dim)
        scores = jnp.einsum("rqkgd,rtkd->rkgqt", qg, k, precision="highest")
        probs = _softmax_f32(_softcap(scores * scale, c.attn_logit_softcapping), visible, q.dtype)
        return jnp.einsum("rkgqt,rtkd->rqkgd", probs, v, precision="highest").reshape(r * n, -1), state

    h, _ = _layers(params, c, tokens.reshape(-1), jnp.tile(pos, r), attend, None)
    return h.reshape(r, n, -1)


def _write(cache, kv, slot):
    """``cache`` (keys, values) with ``kv`` (from :func:`_prefill`) at positions ``0 ..`` of ``slot``."""
    keys = tuple(jax.lax.dynamic_update_slice(buf, k[None], (slot, 0, 0, 0)) for buf, (k, _) in zip(cache[0], kv))
    values = tuple(jax.lax.dynamic_update_slice(buf, v[None], (slot, 0, 0, 0)) for buf, (_, v) in zip(cache[1], kv))
    return keys, values


def _new_cache(config: LlamaConfig, slots: int, kv_len: int, dtype):
    c = config
    shape = (slots, kv_len, c.num_key_value_heads, c.head_dim)
    keys = tuple(jnp.zeros(shape, dtype) for _ in range(c.num_hidden_layers))
    return keys, tuple(jnp.zeros(shape, dtype) for _ in range(c.num_hidden_layers))


def _decode(p, config: LlamaConfig, cache, tokens, positions, attention: str = "xla"):
    """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s
    cache. Returns ``(logits [rows, vocab] in the compute dtype, (keys, values))``.

    ``attention`` ``"cudnn"`` (bfloat16 on a GPU): layers without a sliding window attend by
    cuDNN's fused attention over each row's keys ``0 .. positions[b]`` only
    (:func:`jax.nn.dot_product_attention` with ``key_value_seq_lengths``); else, and in windowed
    layers (cuDNN aligns a window to the first query, not to the row's position), the scores
    over the whole capacity with a float32 softmax of the visible keys (transformers' eager
    attention; its two contractions from :mod:`~trace_replay_app.drivers.jax_attention`, which
    read the cache in place). On an H200 (Qwen2.5-0.5B shape, rows of 204-1,024 of 1,024 keys) cuDNN's step
    took 2.03 ms at batch 256 against 2.53 ms."""
    c = config
    rows = jnp.arange(positions.shape[0])
    kpos = jnp.arange(cache[0][0].shape[1])
    scale = c.attention_scale
    lengths = (positions + 1).astype(jnp.int32)
    masks = {}
    for layer in range(c.num_hidden_layers):
        w = c.window(layer)
        if w not in masks:
            visible = kpos[None, :] <= positions[:, None]
            if w:
                visible = visible & (kpos[None, :] > positions[:, None] - w)
            masks[w] = visible[:, :, None, None]  # [rows, kv_len, 1, 1]

    def attend(layer, q, k, v, kv):
        keys, values = kv
        kb = keys[layer].at[rows, positions].set(k)  # [rows, kv_len, kv_heads, head_dim]
        vb = values[layer].at[rows, positions].set(v)
        if attention == "cudnn" and not c.window(layer) and not c.attn_logit_softcapping:
            out = jax.nn.dot_product_attention(
                q[:, None], kb, vb, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn"
            ).reshape(q.shape[0], -1)
        else:
            scores = cache_scores(q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim), kb) * scale
            scores = _softcap(scores, c.attn_logit_softcapping)
            probs = _softmax_f32(scores, masks[c.window(layer)], q.dtype, axis=1)  # [rows, kv_len, kv_heads, groups]
            out = cache_mix(probs, vb).reshape(q.shape[0], -1)
        return out, (keys[:layer] + (kb,) + keys[layer + 1 :], values[:layer] + (vb,) + values[layer + 1 :])

    h, cache = _layers(p, c, tokens, positions, attend, cache)
    return _logits(p, h), cache


JAX = JaxFamily(
    config_type=LlamaConfig,
    check_weights=check_weights,
    params=_params,
    new_cache=_new_cache,
    prefill=_prefill,
    write=_write,
    decode=_decode,
    hidden=_hidden,
    logits=_logits,
    batched_prefill=True,
)
run_decode = decoder(JAX)
run_score = scorer(JAX)
