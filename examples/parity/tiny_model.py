"""A tiny two-layer decoder in PyTorch that keeps the torch decode protocol, for the parity example.

Not a registry family and never saved: the weights come from a seed. Its KV cache is its own
layout (a list of per-layer ``(keys, values)``, each ``[slots, kv_len, heads, head_dim]``);
the driver only hands it back. Rotary position embeddings (``rope_base``), RMSNorm, a gated
SiLU MLP and an output projection tied to the embedding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["TinyConfig", "TinyTorch", "seeded_weights"]


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """The model's sizes; ``n_positions``: the most prompt + decoded tokens of one request."""

    vocab_size: int = 96
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    mlp: int = 64
    n_positions: int = 64
    rope_base: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def seeded_weights(config: TinyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights by name, drawn from ``seed``. The embedding (tied to the output
    projection) is drawn at 0.1 so that logits are of order 1, as in the models the default
    bfloat16 tolerance was measured on (:data:`trace_replay_app.parity.TOLERANCES`)."""
    rng = np.random.default_rng(seed)
    h, m = config.hidden, config.mlp

    def draw(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"embed": draw(config.vocab_size, h, scale=0.1), "norm": 1 + draw(h, scale=0.1)}
    for i in range(config.layers):
        weights |= {
            f"l{i}_attn_norm": 1 + draw(h, scale=0.1),
            f"l{i}_wq": draw(h, h, scale=h**-0.5),
            f"l{i}_wk": draw(h, h, scale=h**-0.5),
            f"l{i}_wv": draw(h, h, scale=h**-0.5),
            f"l{i}_wo": draw(h, h, scale=h**-0.5),
            f"l{i}_mlp_norm": 1 + draw(h, scale=0.1),
            f"l{i}_gate": draw(m, h, scale=h**-0.5),
            f"l{i}_up": draw(m, h, scale=h**-0.5),
            f"l{i}_down": draw(h, m, scale=m**-0.5),
        }
    return weights


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[..., heads, head_dim]``; ``cos``/``sin`` ``[..., head_dim]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[..., None, :] + torch.cat((-x2, x1), dim=-1) * sin[..., None, :]


class TinyTorch(torch.nn.Module):
    """The model on ``device`` in ``dtype``, weights from :func:`seeded_weights` (``seed``).

    Keeps :class:`trace_replay_app.drivers.torch_driver.TorchDecodeModel`: ``vocab_size``,
    ``n_positions``, ``new_cache``, ``prefill`` and ``decode``; its ``decode`` is capturable in a
    CUDA graph (fixed shapes, no host sync, the cache written in place)."""

    def __init__(self, config: TinyConfig, seed: int = 0, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.vocab_size, self.n_positions = config.vocab_size, config.n_positions
        weights = seeded_weights(config, seed)
        self.weights = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(torch.from_numpy(w).to(device, dtype)) for k, w in weights.items()}
        )
        d = config.head_dim
        self.register_buffer("inv_freq", 1.0 / config.rope_base ** (torch.arange(0, d, 2, device=device) / d))

    def state_numpy(self) -> dict[str, np.ndarray]:
        """The weights as float32 numpy arrays under :func:`seeded_weights`' names (a copy)."""
        return {k: p.detach().float().cpu().numpy() for k, p in self.weights.items()}

    def new_cache(self, slots: int, kv_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c, dev = self.config, self.inv_freq.device
        shape = (slots, kv_len, c.heads, c.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
                for _ in range(c.layers)]  # fmt: skip

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _blocks(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The layers over ``x`` ``[..., hidden]`` at ``positions`` ``[...]``; ``attend(layer,
        q, k, v)`` (``[..., heads, head_dim]``, rotated) returns the attention output."""
        c, w = self.config, self.weights
        cos, sin = self._rope(positions)
        for i in range(c.layers):
            h = _rms(x, w[f"l{i}_attn_norm"], c.eps)
            q, k, v = (F.linear(h, w[f"l{i}_{n}"]).unflatten(-1, (c.heads, c.head_dim)) for n in ("wq", "wk", "wv"))
            x = x + F.linear(attend(i, _rotate(q, cos, sin), _rotate(k, cos, sin), v).flatten(-2), w[f"l{i}_wo"])
            h = _rms(x, w[f"l{i}_mlp_norm"], c.eps)
            x = x + F.linear(F.silu(F.linear(h, w[f"l{i}_gate"])) * F.linear(h, w[f"l{i}_up"]), w[f"l{i}_down"])
        return _rms(x, w["norm"], c.eps)

    def prefill(self, cache, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keys and values of ``tokens`` ``[requests, n]`` (positions ``0 .. n-1``) into ``slots``."""
        n = tokens.shape[1]
        pos = torch.arange(n, device=tokens.device)
        future = pos[None, :] > pos[:, None]
        scale = self.config.head_dim**-0.5

        def attend(i, q, k, v):
            cache[i][0][slots, :n] = k
            cache[i][1][slots, :n] = v
            scores = torch.einsum("rqhd,rkhd->rhqk", q, k).float() * scale
            probs = scores.masked_fill(future, float("-inf")).softmax(-1).to(self.dtype)
            return torch.einsum("rhqk,rkhd->rqhd", probs, v)

        self._blocks(self.weights["embed"][tokens], pos.expand(tokens.shape), attend)

    def decode(self, cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``: logits ``[rows, vocab]``."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        hidden = torch.arange(cache[0][0].shape[1], device=tokens.device)[None, :] > positions[:, None]
        scale = self.config.head_dim**-0.5

        def attend(i, q, k, v):
            keys, values = cache[i]
            keys[rows, positions] = k
            values[rows, positions] = v
            scores = torch.einsum("bhd,bthd->bht", q, keys).float() * scale
            probs = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1).to(self.dtype)
            return torch.einsum("bht,bthd->bhd", probs, values)

        return F.linear(self._blocks(self.weights["embed"][tokens], positions, attend), self.weights["embed"])
