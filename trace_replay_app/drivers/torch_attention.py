"""Decode attention over each row's own length for the torch families: flash attention over the
slots' KV caches read as one variable-length key sequence.

A family's cache holds each slot's keys (and values) of a layer as one contiguous ``[kv_len,
kv_heads, head_dim]`` block, ``[slots, kv_len, kv_heads, head_dim]`` per layer; viewed as
``[slots * kv_len, kv_heads, head_dim]``, the slots are the sequences of a variable-length
batch whose ``b``-th starts at ``b * kv_len`` (``cu_seqlens_k``) and holds ``positions[b] + 1``
keys (``seqused_k``): flash attention reads those alone, so a step's cost follows the rows'
lengths, not the capacity. One query per row (``cu_seqlens_q`` = 0, 1, ...); grouped query
heads as flash attention takes them; a sliding window ``w`` is its left window ``w - 1`` (the
query is the row's last position). torch has no public variable-length attention with
``seqused_k``; the call is ``aten._flash_attention_forward``, the op under
``scaled_dot_product_attention``'s flash backend (CUDA, bfloat16 or float16, head_dim up to 256).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["flash_decode_supported", "flash_decode", "store_step_kv"]


def flash_decode_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`flash_decode` runs for a model on ``device`` in ``dtype``."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim <= 256


def flash_decode(positions: torch.Tensor, kv_len: int, scale: float) -> Callable[..., torch.Tensor]:
    """``attend(keys, values, q, window=0)`` for one decode step whose row ``b`` is at
    ``positions[b]`` (int, ``[rows]``, on the device): ``keys``/``values`` a layer's cache
    ``[rows, kv_len, kv_heads, head_dim]`` (contiguous; row ``b`` = slot ``b``), ``q`` ``[rows,
    heads, head_dim]`` (a strided view is copied first: GPT-2's q is a slice of its fused
    projection); returns ``[rows, heads, head_dim]``, each row attending to its keys ``0 ..
    positions[b]`` (the last ``window`` of them when ``window``). The step's sequence offsets
    and lengths are made once here, on the device (stream-ordered; capturable in a CUDA graph)."""
    rows = positions.shape[0]
    cu_q = torch.arange(rows + 1, device=positions.device, dtype=torch.int32)
    cu_k, used = cu_q * kv_len, (positions + 1).to(torch.int32)

    def attend(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, window: int = 0) -> torch.Tensor:
        flat = (keys.shape[0] * kv_len, keys.shape[2], keys.shape[3])
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), keys.view(flat), values.view(flat), cu_q, cu_k, 1, kv_len, 0.0, False, False, scale=scale,
            window_size_left=window - 1 if window else None, window_size_right=0 if window else None, seqused_k=used,
        )[0]  # fmt: skip

    return attend


def store_step_kv(
    cache: torch.Tensor,
    index: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store one decode step's keys ``k`` and values ``v`` (``[rows, heads, head_dim]``) of
    ``layer`` in ``cache`` (``[layers, 2, slots, kv_len, heads, head_dim]``) at ``(rows[b],
    positions[b])``, in place (stream-ordered). ``index``: ``torch.arange(n)`` on the cache's
    device, ``n >= max(layers, 2)`` (made once: a 0-d index costs no copy from the host, so the
    call can be captured in a CUDA graph).

    ``index_put_`` on the cache itself rather than an assignment through ``cache[layer, 0]``:
    the same kernel eagerly, but inside a ``torch.compile``'d step a write through a view the
    graph takes of its input is lowered as a copy of the whole cache, while ``index_put_`` on
    the input writes in place (a 4-layer step on the CPU: 0.23 s against 45 us at 1,024
    positions per row, and the copy grows with the cache)."""
    cache.index_put_((index[layer], index[0], rows, positions), k.to(cache.dtype))
    cache.index_put_((index[layer], index[1], rows, positions), v.to(cache.dtype))
