"""The Llama family's math in PyTorch, and its ``run_decode`` on the shared torch driver.

:class:`LlamaTorch` is the family's :class:`~trace_replay_app.drivers.torch_driver.TorchModel`
(prefill and decode over a slot-indexed KV cache; under tensor parallelism, a rank's share of
the heads and MLP units and its block of the output projection). :data:`TORCH` tells the driver
about it and :func:`run_decode` is the driver bound to it
(:func:`trace_replay_app.drivers.torch_driver.decoder`: slots, schedule, replay, logprob/rank,
recording, a CUDA graph per step on CUDA, and ``tensor_parallel=`` over a
``torch.distributed`` job).

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.llama.config import default_config, seeded_weights
    from trace_replay_app.models.llama.torch_loop import run_decode
    from trace_replay_app.records import TraceRequest

    config = default_config("llama")
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...drivers.torch_attention import flash_decode, flash_decode_supported, store_step_kv
from ...drivers.torch_driver import TorchFamily, decoder
from ...drivers.torch_parallel import Shard
from ...drivers.torch_score import scorer
from .config import LlamaConfig, check_weights, inv_freq, layer_norm_names
from .torch_layers import after_attention, attention_inputs, compiled_pieces, rms, softcap

__all__ = ["LlamaTorch", "TORCH", "run_decode", "run_score", "splits_layers"]


def cache_shape(config: LlamaConfig, slots: int, kv_len: int) -> tuple[int, ...]:
    """``[layers, 2 (keys, values), slots, kv_len, kv_heads, head_dim]`` (each slot's keys one
    contiguous ``[kv_len, kv_heads, head_dim]`` block, the layout flash attention reads)."""
    return (config.num_hidden_layers, 2, slots, kv_len, config.num_key_value_heads, config.head_dim)


def splits_layers(config: LlamaConfig, world_size: int) -> bool:
    """Whether attention and MLP split evenly over ``world_size`` ranks (key/value heads and MLP
    hidden units multiples of it; never with q/k norms over whole projections, which would need
    every rank's heads)."""
    if config.qk_norm and config.norm_style == "olmo":
        return False
    return config.num_key_value_heads % world_size == 0 and config.intermediate_size % world_size == 0


def _shard(config: LlamaConfig, weights: Mapping[str, np.ndarray], shard: Shard):
    """``(local config, local weights)`` of ``shard``: with ``shard.layers``, its key/value heads
    (and their query heads) and MLP units; its block of ``lm_head``. The caller's arrays are
    sliced, never changed."""
    out = dict(weights)
    if not config.tie_word_embeddings:  # only this rank's rows reach the device
        out["lm_head.weight"] = weights["lm_head.weight"][shard.start : shard.end]
    if not shard.layers:
        return config, out
    c, d, rank, world = config, config.head_dim, shard.rank, shard.world
    kv, inter = c.num_key_value_heads // world, c.intermediate_size // world
    q = kv * c.kv_groups
    local = dataclasses.replace(c, num_attention_heads=q, num_key_value_heads=kv, intermediate_size=inter, head_dim=d)
    rows = {
        "q_proj": slice(rank * q * d, (rank + 1) * q * d),
        "k_proj": slice(rank * kv * d, (rank + 1) * kv * d),
        "gate_proj": slice(rank * inter, (rank + 1) * inter),
    }
    rows["v_proj"], rows["up_proj"] = rows["k_proj"], rows["gate_proj"]
    cols = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}
    for name, w in weights.items():
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj in rows:  # column-parallel: output rows (and bias)
            out[name] = w[rows[proj]]
        elif proj in cols and parts[-1] == "weight":  # row-parallel: input columns; bias after the sum
            out[name] = w[:, cols[proj]]
    return local, out


def _tensor(w: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(device=device, dtype=dtype)


class LlamaTorch:
    """The model's forward passes on ``device`` in ``dtype`` over a :func:`cache_shape` KV cache
    (a :class:`~trace_replay_app.drivers.torch_driver.TorchDecodeModel`).

    The q/k/v and gate/up projections are concatenated once here (one matrix product each per
    layer). With a ``shard``: the rank's share of the layers (when ``shard.layers``; the
    row-parallel products summed with ``shard.reduce``) and its block of the output projection;
    ``config`` is then the rank's local config.

    ``fused`` (default: on CUDA in bfloat16 or float16, without split layers) picks the decode
    step's form. Fused: each layer's norms, projections and rotary embedding run as two
    ``torch.compile`` pieces around the attention, and the attention is flash attention over
    each row's own length (``aten._flash_attention_forward`` with ``seqused_k``), so its cost
    follows the rows' lengths, not the cache's capacity
    (:mod:`~trace_replay_app.drivers.torch_attention`). Else: the eager layers and masked
    attention over the whole capacity in float32 softmax, as transformers' eager attention (the
    numerics reference, and the only form on the CPU and in float32). Why fused: the eager step
    is hundreds of small kernels, and the fused one is the faster step measured on the GPU
    (ARCHITECTURE.md, "Decode attention", holds the measurement).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: Mapping[str, np.ndarray],
        device: torch.device,
        dtype: torch.dtype,
        shard: Shard | None = None,
        fused: bool | None = None,
    ):
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None, True or False (got {fused!r})")
        if shard is not None:
            config, weights = _shard(config, weights, shard)
        self.shard, self.device = shard, device
        c, self.config, self.dtype = config, config, dtype
        can_fuse = flash_decode_supported(device, dtype, c.head_dim) and (shard is None or not shard.layers)
        can_fuse = can_fuse and not c.attn_logit_softcapping  # flash attention takes no soft cap here
        if fused and not can_fuse:
            raise ValueError(
                "fused=True needs a CUDA device, bfloat16 or float16, head_dim <= 256, unsplit layers, no soft cap "
                f"(got device={device}, dtype={dtype}, head_dim={c.head_dim}, split layers="
                f"{shard is not None and shard.layers})"
            )
        self.fused = can_fuse if fused is None else fused

        def get(name):
            return _tensor(weights[name], device, dtype) if name in weights else None

        def cat(names):
            parts = [get(n) for n in names]
            return None if parts[0] is None else torch.cat(parts)

        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(
                {
                    "qkv_w": cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                    "qkv_b": cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                    "o_w": get(a + "o_proj.weight"),
                    "o_b": get(a + "o_proj.bias"),
                    "q_norm": get(a + "q_norm.weight"),
                    "k_norm": get(a + "k_norm.weight"),
                    "gu_w": cat([m + "gate_proj.weight", m + "up_proj.weight"]),
                    "gu_b": cat([m + "gate_proj.bias", m + "up_proj.bias"]),
                    "down_w": get(m + "down_proj.weight"),
                    "down_b": get(m + "down_proj.bias"),
                    **{role: get(p + name + ".weight") for role, name in layer_norm_names(c).items()},
                }
            )
        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        if shard is not None and c.tie_word_embeddings:
            self.head = self.embed[shard.start : shard.end]  # a view of the replicated embedding
        self.inv_freq = torch.from_numpy(inv_freq(c)).to(device)
        self.inv_freq_sliding = torch.from_numpy(inv_freq(c, sliding=True)).to(device)
        self.scale = c.attention_scale
        # Gemma: sqrt(hidden_size) as transformers' float32 buffer, rounded to the compute dtype
        self.embed_mult = float(torch.tensor(c.hidden_size**0.5).to(dtype)) if c.embed_scale else 1.0
        self._index = torch.arange(max(2, c.num_hidden_layers), device=device)  # store_step_kv's

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def n_positions(self) -> int:
        return self.config.n_positions

    def new_cache(self, slots: int, kv_len: int) -> torch.Tensor:
        """A zero :func:`cache_shape` KV cache (of this rank's heads) on the model's device in its dtype."""
        return torch.zeros(cache_shape(self.config, slots, kv_len), dtype=self.dtype, device=self.device)

    def _cos_sin(self, positions: torch.Tensor, inv: torch.Tensor, factor: float):
        """The rotary cos and sin of ``positions`` in the model's dtype: the angles in float32, cos
        and sin scaled by ``factor`` (YaRN) before rounding, as transformers."""
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1:
            cos, sin = cos * factor, sin * factor
        return cos.to(self.dtype), sin.to(self.dtype)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Callable, compiled: bool = False):
        """Hidden states after the final norm, ``[tokens, hidden]``; ``attend(layer, q, k, v)``
        (``[tokens, heads or kv_heads, head_dim]``, rotated) stores keys/values and returns the
        attention output ``[tokens, heads * head_dim]``. ``compiled``: the layer pieces through
        ``torch.compile`` (fixed shapes: the decode step)."""
        c, eps = self.config, self.config.rms_norm_eps
        rope = self._cos_sin(positions, self.inv_freq, c.rope_attention_factor)
        local = self._cos_sin(positions, self.inv_freq_sliding, 1.0) if c.sliding_rope_theta else rope
        form = (c.norm_style, c.norm_placement, c.hidden_act)
        options: dict[str, Any]
        if compiled:
            inputs, after = compiled_pieces()
            options = {"form": form}
        else:
            inputs, after = attention_inputs, after_attention
            options = {"row_parallel": self._row_parallel, "form": form}
        shape = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, eps, c.qk_norm, form)
        x = self.embed[tokens]
        if self.embed_mult != 1.0:
            x = x * self.embed_mult
        for i, w in enumerate(self.layers):
            cos, sin = (None, None) if i in c.nope_layers else local if c.window(i) else rope
            q, k, v = inputs(x, w, cos, sin, *shape)
            x = after(x, attend(i, q, k, v), w, eps, **options)
        return rms(x, self.norm, eps, c.norm_style)

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The output and down projections, ``x @ w.T + b``; with split layers this rank's share,
        summed over the ranks (one ``all_reduce``), the bias added after the sum."""
        if self.shard is None or not self.shard.layers:
            return F.linear(x, w, b)
        y = F.linear(x, w)
        self.shard.reduce(y)  # in place, the sum over the ranks
        return y if b is None else y + b

    def prefill(self, cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store the keys and values of ``tokens`` ``[requests, n]`` (positions ``0 .. n-1``,
        right-padded) in the caches of ``slots`` ``[requests]``. Padding positions hold
        garbage that a decode step overwrites before any query reads it."""
        self._causal(tokens, cache, slots)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: the final-norm hidden states ``[requests, n, hidden]`` of ``tokens``
        ``[requests, n]`` (positions ``0 .. n-1``, causal; right padding changes no earlier row)."""
        return self._causal(tokens, None, None).reshape(*tokens.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection of ``hidden`` ``[rows, hidden]``: logits in the compute dtype."""
        return softcap(F.linear(hidden, self.head), self.config.final_logit_softcapping)

    def _causal(self, tokens: torch.Tensor, cache: torch.Tensor | None, slots: torch.Tensor | None) -> torch.Tensor:
        """Causal attention over each row of ``tokens`` ``[requests, n]``, storing keys and values
        in ``cache`` at ``slots`` when given; the final-norm hidden states ``[requests * n, hidden]``."""
        c = self.config
        r, n = tokens.shape
        pos = torch.arange(n, device=tokens.device)
        causal = pos[None, :] <= pos[:, None]  # [query, key]

        def attend(layer, q, k, v):
            q, k, v = (t.reshape(r, n, -1, c.head_dim) for t in (q, k, v))
            if cache is not None:
                cache[layer, 0, slots, :n] = k
                cache[layer, 1, slots, :n] = v
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k, v = k.repeat_interleave(c.kv_groups, dim=1), v.repeat_interleave(c.kv_groups, dim=1)
            window = c.window(layer)
            if c.attn_logit_softcapping:  # SDPA takes no soft cap: transformers' eager attention
                mask = causal & (pos[None, :] > pos[:, None] - window) if window else causal
                scores = softcap(torch.matmul(q, k.transpose(2, 3)) * self.scale, c.attn_logit_softcapping)
                probs = scores.float().masked_fill(~mask, float("-inf")).softmax(dim=-1)
                return torch.matmul(probs.to(q.dtype), v).transpose(1, 2).reshape(r * n, -1)
            mask = causal & (pos[None, :] > pos[:, None] - window) if window else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
            return out.transpose(1, 2).reshape(r * n, -1)

        return self._layers(tokens.reshape(-1), pos.repeat(r), attend)

    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache.

        Returns logits ``[rows, vocab]`` in the compute dtype. Rows attend to cache positions
        ``<= positions[b]`` (and inside the layer's window); an empty row computes garbage
        that no one reads. Fixed shapes, no host sync: capturable in a CUDA graph (the fused
        form compiles its layer pieces on its first call; capture after one call).
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        attention = self._flash_attention(cache, positions) if self.fused else self._masked_attention(cache, positions)

        def attend(layer, q, k, v):
            store_step_kv(cache, self._index, layer, rows, positions, k, v)
            return attention(layer, q)

        return self.logits(self._layers(tokens, positions, attend, compiled=self.fused))

    def _masked_attention(self, cache: torch.Tensor, positions: torch.Tensor) -> Callable:
        """``attend(layer, q)`` for :meth:`decode` over the whole capacity: scores in the compute
        dtype, softmax in float32 over the visible keys (transformers' eager attention)."""
        c = self.config
        kpos = torch.arange(cache.shape[3], device=positions.device)
        masks = {}
        for layer in range(c.num_hidden_layers):
            w = c.window(layer)
            if w not in masks:
                hidden = kpos[None, :] > positions[:, None]
                if w:
                    hidden = hidden | (kpos[None, :] <= positions[:, None] - w)
                masks[w] = hidden[:, None, None, :]  # [rows, 1, 1, kv_len]

        def attention(layer, q):
            keys, values = cache[layer, 0], cache[layer, 1]  # [rows, kv_len, kv_heads, head_dim]
            qg = q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim)
            scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * self.scale  # [rows, kv_heads, groups, kv_len]
            scores = softcap(scores, c.attn_logit_softcapping)
            probs = scores.float().masked_fill(masks[c.window(layer)], float("-inf")).softmax(dim=-1)
            return torch.matmul(probs.to(self.dtype), values.transpose(1, 2)).reshape(q.shape[0], -1)

        return attention

    def _flash_attention(self, cache: torch.Tensor, positions: torch.Tensor) -> Callable:
        """``attend(layer, q)`` for :meth:`decode` by flash attention over each row's keys
        ``0 .. positions[b]`` only (:func:`~trace_replay_app.drivers.torch_attention.flash_decode`),
        a sliding window as flash attention's left window."""
        c = self.config
        attend = flash_decode(positions, cache.shape[3], self.scale)

        def attention(layer, q):
            return attend(cache[layer, 0], cache[layer, 1], q, c.window(layer)).reshape(q.shape[0], -1)

        return attention


TORCH = TorchFamily(
    config_type=LlamaConfig,
    check_weights=check_weights,
    cache_shape=cache_shape,
    build=LlamaTorch,
    splits_layers=splits_layers,
)
run_decode = decoder(TORCH)
run_score = scorer(TORCH)
