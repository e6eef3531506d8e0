"""The GPT-2-style family's math in PyTorch, and its ``run_decode`` on the shared torch driver.

:class:`GPT2Torch` is the family's :class:`~trace_replay_app.drivers.torch_driver.TorchModel`:
its prefill and decode over a slot-indexed KV cache. :data:`TORCH` tells the driver about it, and
:func:`run_decode` is the driver bound to it (:func:`trace_replay_app.drivers.torch_driver.decoder`:
slots, schedule, replay, logprob/rank, recording and, on CUDA, a CUDA graph per step). This
module is the only one of the family that imports torch.

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
    from trace_replay_app.records import TraceRequest
    from trace_replay_app.models.gpt2.torch_loop import run_decode

    config = GPT2Config()
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ...drivers.torch_attention import flash_decode, flash_decode_supported, store_step_kv
from ...drivers.torch_driver import TorchFamily, decoder
from ...drivers.torch_parallel import Shard
from ...drivers.torch_score import scorer
from .config import GPT2Config, check_weights

__all__ = ["GPT2Torch", "TORCH", "run_decode", "run_score"]


def cache_shape(config: GPT2Config, slots: int, kv_len: int) -> tuple[int, ...]:
    """``[n_layer, 2 (keys, values), slots, kv_len, n_head, head_dim]``."""
    return (config.n_layer, 2, slots, kv_len, config.n_head, config.head_dim)


class GPT2Torch:
    """The model's forward passes on ``device`` in ``dtype`` (weights, activations and KV cache;
    logits are returned as float32), over a :func:`cache_shape` KV cache: a
    :class:`~trace_replay_app.drivers.torch_driver.TorchDecodeModel`. With a ``shard`` (tensor
    parallelism) it computes its vocabulary block of the logits; its layers are never split
    (the family's ``splits_layers`` is the default, never).

    ``flash`` (default: on CUDA in bfloat16 or float16) picks the decode step's attention:
    flash attention over each row's own keys
    (:func:`~trace_replay_app.drivers.torch_attention.flash_decode`), whose cost follows the
    rows' lengths; else the scores over the whole capacity with the later positions masked, as
    transformers' eager attention (the numerics reference, and the only form on the CPU and in
    float32).
    """

    def __init__(
        self,
        config: GPT2Config,
        weights: Mapping[str, np.ndarray],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        shard: Shard | None = None,
        flash: bool | None = None,
    ):
        if flash is not None and not isinstance(flash, bool):
            raise TypeError(f"flash must be None, True or False (got {flash!r})")
        can = flash_decode_supported(device, dtype, config.head_dim)
        if flash and not can:
            raise ValueError(
                "flash=True needs a CUDA device, bfloat16 or float16 and head_dim <= 256 "
                f"(got device={device}, dtype={dtype}, head_dim={config.head_dim})"
            )
        self.flash = can if flash is None else flash
        self.config, self.device, self.dtype = config, device, dtype
        self.p: dict[str, torch.Tensor] = {
            name: torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(device=device, dtype=dtype)
            for name, w in weights.items()
        }
        self.head = self.p["wte.weight"] if shard is None else self.p["wte.weight"][shard.start : shard.end]
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._index = torch.arange(max(2, config.n_layer), device=device)  # store_step_kv's

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def n_positions(self) -> int:
        return self.config.n_positions

    def new_cache(self, slots: int, kv_len: int) -> torch.Tensor:
        """A zero :func:`cache_shape` KV cache on the model's device in its dtype."""
        return torch.zeros(cache_shape(self.config, slots, kv_len), dtype=self.dtype, device=self.device)

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, x.shape[-1:], self.p[name + ".weight"], self.p[name + ".bias"], self.config.layer_norm_epsilon
        )

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.addmm(self.p[name + ".bias"], x, self.p[name + ".weight"])  # Conv1D: x @ W + b

    def _layers(self, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        """The transformer blocks over ``x`` ``[tokens, n_embd]``; ``attend(layer, q, k, v)``
        (each ``[tokens, n_head, head_dim]``) stores keys/values and returns the attention output."""
        c = self.config
        for layer in range(c.n_layer):
            p = f"h.{layer}."
            qkv = self._linear(self._ln(x, p + "ln_1"), p + "attn.c_attn")
            q, k, v = qkv.view(-1, 3, c.n_head, c.head_dim).unbind(1)
            x = x + self._linear(attend(layer, q, k, v).reshape(-1, c.n_embd), p + "attn.c_proj")
            h = F.gelu(self._linear(self._ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")  # gelu_new
            x = x + self._linear(h, p + "mlp.c_proj")
        return x

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.p["wte.weight"][tokens] + self.p["wpe.weight"][positions]

    def prefill(self, cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store the keys and values of ``tokens`` ``[requests, n]`` (positions ``0 .. n-1``,
        right-padded) in the caches of ``slots`` ``[requests]``."""
        self._causal(tokens, cache, slots)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: the final-norm hidden states ``[requests, n, n_embd]`` of ``tokens``
        ``[requests, n]`` (positions ``0 .. n-1``, causal; right padding changes no earlier row)."""
        return self._ln(self._causal(tokens, None, None), "ln_f").reshape(*tokens.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection of final-norm ``hidden`` ``[rows, n_embd]``: float32 logits."""
        return (hidden @ self.head.T).float()

    def _causal(self, tokens: torch.Tensor, cache: torch.Tensor | None, slots: torch.Tensor | None) -> torch.Tensor:
        """The blocks over each row of ``tokens`` ``[requests, n]`` with causal attention, storing
        keys and values in ``cache`` at ``slots`` when given; ``[requests * n, n_embd]`` before ``ln_f``."""
        r, n = tokens.shape
        c = self.config
        pos = torch.arange(n, device=tokens.device)
        future = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(diagonal=1)

        def attend(layer, q, k, v):
            q, k, v = (t.reshape(r, n, c.n_head, c.head_dim) for t in (q, k, v))
            if cache is not None:
                cache[layer, 0, slots, :n] = k
                cache[layer, 1, slots, :n] = v
            scores = torch.einsum("rqhd,rkhd->rhqk", q, k) * self.scale
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            return torch.einsum("rhqk,rkhd->rqhd", probs, v).reshape(r * n, c.n_head, c.head_dim)

        return self._layers(self._embed(tokens.reshape(-1), pos.repeat(r)), attend)

    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache.

        Returns float32 logits ``[rows, vocab_size]`` (a shard's block of the vocabulary). Rows
        attend to cache positions ``<= positions[b]``; an empty row computes garbage that no one reads.
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if self.flash:
            flash = flash_decode(positions, cache.shape[3], self.scale)
        else:  # the later positions of each row, masked in every layer
            hidden = (torch.arange(cache.shape[3], device=tokens.device) > positions[:, None])[:, None, :]

        def attend(layer, q, k, v):
            store_step_kv(cache, self._index, layer, rows, positions, k, v)
            if self.flash:
                return flash(cache[layer, 0], cache[layer, 1], q)
            scores = torch.einsum("bhd,bthd->bht", q, cache[layer, 0]) * self.scale
            probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)  # hidden: [rows, 1, kv_len]
            return torch.einsum("bht,bthd->bhd", probs, cache[layer, 1])

        return self.logits(self._ln(self._layers(self._embed(tokens, positions), attend), "ln_f"))


# prefill_tokens=1: one prompt per prefill call, unpadded. Padded groups round the cached keys
# and values of float32 runs differently, so tokens decoded after them can change their last bits.
TORCH = TorchFamily(
    config_type=GPT2Config, check_weights=check_weights, cache_shape=cache_shape, build=GPT2Torch, prefill_tokens=1
)
run_decode = decoder(TORCH)
run_score = scorer(TORCH)
