"""The GPT-2-style family's math in JAX, and its ``run_decode`` on the shared JAX driver.

The functions here are the family's side of :class:`~trace_replay_app.drivers.jax_driver.JaxFamily`
(parameters, KV cache, prefill, write, decode); :data:`JAX` tells the driver about them and
:func:`run_decode` is the driver bound to them (:func:`trace_replay_app.drivers.jax_driver.decoder`:
slots, schedule, jitted admission and step with replay and logprob/rank inside, and ``mesh=``
for the logits sharded over the vocabulary). This module is the only one of the family that
imports JAX.

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
    from trace_replay_app.records import TraceRequest
    from trace_replay_app.models.gpt2.jax_loop import run_decode

    config = GPT2Config()
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()

The KV cache: ``[n_layer, 2 (keys, values), slots, kv_len, n_head, head_dim]`` in the compute
dtype. Matrix products run at full precision (``precision="highest"``: no TF32 on GPUs), as in
the PyTorch loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ...drivers.jax_attention import cache_mix, cache_scores
from ...drivers.jax_driver import JaxFamily, decoder
from ...drivers.jax_score import scorer
from .config import GPT2Config, check_weights

__all__ = ["JAX", "run_decode", "run_score"]

# -- the model ----------------------------------------------------------------------------------
_mm = functools.partial(jnp.matmul, precision="highest")
_einsum = functools.partial(jnp.einsum, precision="highest")


def _ln(p, x, name: str, eps: float):
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]


def _linear(p, x, name: str):
    return _mm(x, p[name + ".weight"]) + p[name + ".bias"]  # Conv1D: x @ W + b


def _layers(p, config: GPT2Config, x, attend, state):
    """The transformer blocks over ``x`` ``[tokens, n_embd]``. ``attend(layer, q, k, v, state)``
    (each of q, k, v ``[tokens, n_head, head_dim]``) returns the attention output and ``state``
    with this layer's keys and values stored; returns ``(x, state)``."""
    eps = config.layer_norm_epsilon
    for layer in range(config.n_layer):
        pre = f"h.{layer}."
        qkv = _linear(p, _ln(p, x, pre + "ln_1", eps), pre + "attn.c_attn")
        q, k, v = _split_heads(qkv, config)
        a, state = attend(layer, q, k, v, state)
        x = x + _linear(p, a.reshape(-1, config.n_embd), pre + "attn.c_proj")
        h = jax.nn.gelu(_linear(p, _ln(p, x, pre + "ln_2", eps), pre + "mlp.c_fc"), approximate=True)  # gelu_new
        x = x + _linear(p, h, pre + "mlp.c_proj")
    return x, state


def _split_heads(qkv, config: GPT2Config):
    """``[tokens, 3 * n_embd]`` -> q, k, v, each ``[tokens, n_head, head_dim]``."""
    q, k, v = jnp.split(qkv.reshape(-1, 3, config.n_head, config.head_dim), 3, axis=1)
    return q[:, 0], k[:, 0], v[:, 0]


def _embed(p, tokens, positions):
    return p["wte.weight"][tokens] + p["wpe.weight"][positions]


def _prefill(p, config: GPT2Config, tokens):
    """The keys and values of ``tokens`` (``[bucket]``, positions ``0 ..``):
    ``[n_layer, 2, 1, bucket, n_head, head_dim]``."""
    n = tokens.shape[0]
    causal = jnp.tril(jnp.ones((n, n), dtype=bool))
    scale = 1.0 / math.sqrt(config.head_dim)

    def attend(layer, q, k, v, kv):
        scores = jnp.where(causal, _einsum("qhd,khd->hqk", q, k) * scale, -jnp.inf)
        return _einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v), kv + [jnp.stack([k, v])]

    _, kv = _layers(p, config, _embed(p, tokens, jnp.arange(n)), attend, [])
    return jnp.stack(kv)[:, :, None]  # [n_layer, 2, 1 (slot), bucket, n_head, head_dim]


def _hidden(p, config: GPT2Config, tokens, attention: str = "xla"):
    """Teacher-forced: the final-norm hidden states ``[requests, n, n_embd]`` of right-padded
    ``tokens`` ``[requests, n]``; in bfloat16 through :func:`jax.nn.dot_product_attention` of
    ``attention`` (``"cudnn"`` on a GPU, ``"xla"``), in float32 the scores at full precision."""
    r, n = tokens.shape
    causal = jnp.tril(jnp.ones((n, n), dtype=bool))
    scale = 1.0 / math.sqrt(config.head_dim)

    def attend(layer, q, k, v, state):
        q, k, v = (t.reshape(r, n, config.n_head, config.head_dim) for t in (q, k, v))
        if q.dtype != jnp.float32:
            out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=attention)
            return out.reshape(r * n, -1), state
        scores = jnp.where(causal, _einsum("rqhd,rkhd->rhqk", q, k) * scale, -jnp.inf)
        return _einsum("rhqk,rkhd->rqhd", jax.nn.softmax(scores, axis=-1), v).reshape(r * n, -1), state

    x, _ = _layers(p, config, _embed(p, tokens.reshape(-1), jnp.tile(jnp.arange(n), r)), attend, None)
    return _ln(p, x, "ln_f", config.layer_norm_epsilon).reshape(r, n, -1)


def _logits(p, h):
    """The output projection of final-norm ``h`` ``[rows, n_embd]``: float32 logits."""
    head = p["head"] if "head" in p else p["wte.weight"].T
    return _mm(h, head).astype(jnp.float32)


def _write(cache, kv, slot):
    """``cache`` with ``kv`` (from :func:`_prefill`) at positions ``0 ..`` of ``slot``."""
    return jax.lax.dynamic_update_slice(cache, kv, (0, 0, slot, 0, 0, 0))


def _decode(p, config: GPT2Config, cache, tokens, positions, attention: str = "xla"):
    """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache.

    Returns ``(logits [rows, vocab] float32, cache)``. Rows attend to cache positions
    ``<= positions[b]``; an empty row computes garbage that no one reads. ``attention``
    ``"cudnn"`` (bfloat16 on a GPU): cuDNN's fused attention over each row's own keys; else the
    scores over the whole capacity (:mod:`~trace_replay_app.drivers.jax_attention`'s
    contractions, which read the cache in place).
    """
    rows = jnp.arange(tokens.shape[0])
    visible = (jnp.arange(cache.shape[3]) <= positions[:, None])[:, :, None, None]  # [rows, kv_len, 1, 1]
    scale = 1.0 / math.sqrt(config.head_dim)
    lengths = (positions + 1).astype(jnp.int32)

    def attend(layer, q, k, v, cache):
        cache = cache.at[layer, 0, rows, positions].set(k).at[layer, 1, rows, positions].set(v)
        if attention == "cudnn":
            out = jax.nn.dot_product_attention(
                q[:, None], cache[layer, 0], cache[layer, 1], scale=scale, key_value_seq_lengths=lengths,
                implementation="cudnn",
            )  # fmt: skip
            return out.reshape(q.shape), cache
        scores = jnp.where(visible, cache_scores(q[:, :, None], cache[layer, 0]) * scale, -jnp.inf)
        return cache_mix(jax.nn.softmax(scores, axis=1), cache[layer, 1]).reshape(q.shape), cache

    h, cache = _layers(p, config, _embed(p, tokens, positions), attend, cache)
    return _logits(p, _ln(p, h, "ln_f", config.layer_norm_epsilon)), cache


def _params(config: GPT2Config, weights: Mapping[str, np.ndarray], head: bool) -> dict:
    """Host float32 copies of the weights under their names; with ``head``, also ``"head"``,
    the tied output projection ``[n_embd, vocab]``."""
    params = {name: np.asarray(w, dtype=np.float32) for name, w in weights.items()}
    if head:
        params["head"] = np.ascontiguousarray(params["wte.weight"].T)
    return params


def _new_cache(config: GPT2Config, slots: int, kv_len: int, dtype):
    return jnp.zeros((config.n_layer, 2, slots, kv_len, config.n_head, config.head_dim), dtype)


JAX = JaxFamily(
    config_type=GPT2Config,
    check_weights=check_weights,
    params=_params,
    new_cache=_new_cache,
    prefill=_prefill,
    write=_write,
    decode=_decode,
    hidden=_hidden,
    logits=_logits,
)
run_decode = decoder(JAX)
run_score = scorer(JAX)
