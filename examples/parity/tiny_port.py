"""The tiny model's hand-written JAX port: pure functions over a parameter pytree and a cache pytree.

:class:`TinyJax` keeps :class:`trace_replay_app.drivers.jax_driver.JaxDecodeModel`. It is a
frozen dataclass of its config and compute dtype, so it is hashable by value: runs of equal
ports share the driver's compiled programs. Its parameters (:func:`port_params`) hold the
weights and the rotary frequencies, which the port computes from its config's base. Its KV
cache is its own layout, unlike the torch model's: a tuple of per-layer ``(keys, values)``,
each ``[slots, heads, kv_len, head_dim]``.
Float32 matrix products run at full precision (``precision="highest"``: no TF32 on a GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from tiny_model import TinyConfig

__all__ = ["TinyJax", "port_params"]


def port_params(weights: Mapping[str, np.ndarray], config: TinyConfig, dtype: str = "float32") -> dict[str, jax.Array]:
    """The torch model's weights (numpy, by name) as the port's parameters in ``dtype``, and
    ``"inv_freq"``, the rotary frequencies of ``config.rope_base`` (float32)."""
    params = {name: jnp.asarray(np.asarray(w, np.float32)).astype(dtype) for name, w in weights.items()}
    d = config.head_dim
    params["inv_freq"] = 1.0 / config.rope_base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    return params


def _rms(x, weight, eps: float):
    h = x.astype(jnp.float32)
    return weight * (h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _rotate(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos[..., None, :] + jnp.concatenate([-x2, x1], axis=-1) * sin[..., None, :]


@dataclasses.dataclass(frozen=True)
class TinyJax:
    """The port of :class:`tiny_model.TinyTorch` for ``config``, its cache in ``dtype``."""

    config: TinyConfig
    dtype: str = "float32"

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def n_positions(self) -> int:
        return self.config.n_positions

    def _mm(self, x, w):
        """``x @ w.T`` (torch's ``F.linear``)."""
        return jnp.matmul(x, w.T, precision="highest" if x.dtype == jnp.float32 else None)

    def _einsum(self, spec, a, b):
        return jnp.einsum(spec, a, b, precision="highest" if a.dtype == jnp.float32 else None)

    def _blocks(self, p, x, positions, attend, state):
        c = self.config
        d = c.head_dim
        freqs = positions.astype(jnp.float32)[..., None] * p["inv_freq"]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
        for i in range(c.layers):
            h = _rms(x, p[f"l{i}_attn_norm"], c.eps)
            q, k, v = (self._mm(h, p[f"l{i}_{n}"]).reshape(*h.shape[:-1], c.heads, d) for n in ("wq", "wk", "wv"))
            out, state = attend(i, _rotate(q, cos, sin), _rotate(k, cos, sin), v, state)
            x = x + self._mm(out.reshape(*out.shape[:-2], c.hidden), p[f"l{i}_wo"])
            h = _rms(x, p[f"l{i}_mlp_norm"], c.eps)
            gated = jax.nn.silu(self._mm(h, p[f"l{i}_gate"])) * self._mm(h, p[f"l{i}_up"])
            x = x + self._mm(gated, p[f"l{i}_down"])
        return _rms(x, p["norm"], c.eps), state

    def new_cache(self, slots: int, kv_len: int):
        c = self.config
        shape = (slots, c.heads, kv_len, c.head_dim)
        return tuple((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)) for _ in range(c.layers))

    def prefill(self, params, tokens):
        """Per layer ``(keys, values)``, each ``[heads, n, head_dim]``, of ``tokens`` ``[n]``."""
        n = tokens.shape[0]
        pos = jnp.arange(n)
        visible = pos[None, :] <= pos[:, None]
        scale = self.config.head_dim**-0.5

        def attend(i, q, k, v, kv):
            scores = self._einsum("qhd,khd->hqk", q, k).astype(jnp.float32) * scale
            probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(q.dtype)
            return self._einsum("hqk,khd->qhd", probs, v), kv + [(k.transpose(1, 0, 2), v.transpose(1, 0, 2))]

        return self._blocks(params, params["embed"][tokens], pos, attend, [])[1]

    def write(self, cache, kv, slot):
        return tuple(
            (jax.lax.dynamic_update_slice(kb, k[None], (slot, 0, 0, 0)),
             jax.lax.dynamic_update_slice(vb, v[None], (slot, 0, 0, 0)))
            for (kb, vb), (k, v) in zip(cache, kv)
        )  # fmt: skip

    def decode(self, params, cache, tokens, positions):
        rows = jnp.arange(tokens.shape[0])
        visible = jnp.arange(cache[0][0].shape[2])[None, :] <= positions[:, None]
        scale = self.config.head_dim**-0.5

        def attend(i, q, k, v, cache):
            keys = cache[i][0].at[rows, :, positions].set(k)
            values = cache[i][1].at[rows, :, positions].set(v)
            scores = self._einsum("bhd,bhtd->bht", q, keys).astype(jnp.float32) * scale
            probs = jax.nn.softmax(jnp.where(visible[:, None, :], scores, -jnp.inf), axis=-1).astype(q.dtype)
            return self._einsum("bht,bhtd->bhd", probs, values), cache[:i] + ((keys, values),) + cache[i + 1 :]

        h, cache = self._blocks(params, params["embed"][tokens], positions, attend, cache)
        return self._mm(h, params["embed"]), cache
