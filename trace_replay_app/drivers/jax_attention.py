"""Decode attention for the JAX families: which implementation a run uses, and the masked form's
two contractions over a slot-major KV cache.

A family's cache holds each slot's keys as ``[kv_len, kv_heads, head_dim]`` (the layout cuDNN's
fused attention reads, ``[rows, kv_len, kv_heads, head_dim]`` per layer). Where the masked form
runs (float32, the CPU, a mesh, windowed layers), its scores and its weighted sum of values are
written here as products summed over the cache's own axes, never as a ``dot_general`` whose
batch axes (rows, heads) are not the cache's leading ones: XLA lowers such a dot by first
transposing the whole layer's cache, a copy of it per layer and step, which is what made the
masked step slower than the attention it feeds. The products are taken in float32 (exact for
bfloat16 and float16 inputs, rounded once for float32 ones, as in a matrix product) and summed
in float32, so each result is what a matrix product with float32 accumulation returns, up to
the order of its sum.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["attention_for", "cache_scores", "cache_mix"]


def attention_for(device: Any, dtype: Any) -> str:
    """The implementation of :func:`jax.nn.dot_product_attention` a family's decode and score
    use on ``device`` in compute ``dtype``: ``"cudnn"`` (cuDNN's fused attention, over each
    row's own keys) for bfloat16 or float16 on a GPU, else ``"xla"`` (where the families keep
    transformers' eager attention: the scores of every cache position, the invisible ones
    masked before the softmax)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if device.platform == "gpu" and half else "xla"


def cache_scores(q: jax.Array, keys: jax.Array) -> jax.Array:
    """``q . k`` of each row's query heads with every key of its slot: ``q`` ``[rows, kv_heads,
    groups, head_dim]`` (query head ``h`` at ``[h // groups, h % groups]``), ``keys`` ``[rows,
    kv_len, kv_heads, head_dim]``; returns ``[rows, kv_len, kv_heads, groups]`` in ``q``'s dtype
    (a softmax over the keys is along axis 1)."""
    f32 = jnp.float32
    return jnp.sum(q[:, None].astype(f32) * keys[:, :, :, None, :].astype(f32), axis=-1).astype(q.dtype)


def cache_mix(probs: jax.Array, values: jax.Array) -> jax.Array:
    """The values weighted by ``probs`` ``[rows, kv_len, kv_heads, groups]`` and summed over the
    keys: ``values`` ``[rows, kv_len, kv_heads, head_dim]``; returns ``[rows, kv_heads, groups,
    head_dim]`` in ``probs``' dtype."""
    f32 = jnp.float32
    return jnp.sum(probs[..., None].astype(f32) * values[:, :, :, None, :].astype(f32), axis=1).astype(probs.dtype)
