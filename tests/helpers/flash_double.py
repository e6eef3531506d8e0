"""A CPU stand-in for ``aten._flash_attention_forward``'s variable-length form, written from flash
attention's documented semantics (not from ``drivers/torch_attention.py``), so the arguments
``flash_decode`` builds (sequence offsets, used key counts, the window) are checked without CUDA.

Sequence ``b``: queries ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]``, keys from ``cu_seqlens_k[b]``,
``seqused_k[b]`` of them (else up to ``cu_seqlens_k[b + 1]``). Query ``i`` of ``q_len`` over
``k_len`` keys attends to keys ``j`` in ``[i + k_len - q_len - window_size_left, i + k_len - q_len
+ window_size_right]`` (the window aligned at the bottom right; ``None`` or a negative size:
unbounded on that side; ``is_causal``: right 0). Grouped query heads: head ``h`` reads KV head
``h // (heads // kv_heads)``. Float64 inside; the output in the query's dtype.
"""

from __future__ import annotations

import torch


def flash_varlen_forward(
    query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
    scale=None, window_size_left=None, window_size_right=None, seqused_k=None, **unused,
):  # fmt: skip
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("seqused_k", seqused_k)):
        assert t is None or t.dtype == torch.int32, f"{name} must be int32 (got {t.dtype})"
    assert dropout_p == 0.0 and not return_debug_mask and not any(v is not None for v in unused.values())
    heads, kv_heads, d = query.shape[1], key.shape[1], query.shape[2]
    scale = d**-0.5 if scale is None else scale
    right = 0 if is_causal else window_size_right
    out = torch.empty_like(query)
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        k_len = int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1]) - k0
        assert q1 - q0 <= max_q and k_len <= max_k
        k, v = (t[k0 : k0 + k_len].double().repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k) * scale
        i = torch.arange(q1 - q0)[:, None] + (k_len - (q1 - q0))  # each query's aligned key position
        j = torch.arange(k_len)[None, :]
        visible = torch.ones(i.shape[0], k_len, dtype=torch.bool)
        if window_size_left is not None and window_size_left >= 0:
            visible &= j >= i - window_size_left
        if right is not None and right >= 0:
            visible &= j <= i + right
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return (out,)
