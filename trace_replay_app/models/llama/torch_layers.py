"""The Llama family's layer math in PyTorch, as functions of tensors (no model state): RMSNorm in
each ``LlamaConfig.norm_style``, the gate activation, rotary embeddings, a layer's work before
its attention (norm, q/k/v projection, q/k norms, rotation) and after it (output projection,
MLP, residual adds, with the norms of ``norm_placement``), and the two through
``torch.compile`` (the fused decode step's pieces). :mod:`.torch_loop` holds the model."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["rms", "softcap", "attention_inputs", "after_attention", "compiled_pieces"]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
    """RMSNorm as transformers computes it for ``style`` (``LlamaConfig.norm_style`` says how)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "llama":
        return weight * h.to(x.dtype)
    return (h * (weight.float() + 1.0 if style == "gemma" else weight.float())).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in ``x``'s dtype, as transformers soft-caps (``cap`` 0: ``x``)."""
    return torch.tanh(x / cap) * cap if cap else x


def _act(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` (halves rotated, as transformers)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


_LLAMA_FORM = ("llama", "pre", "silu")


def attention_inputs(
    x, w, cos, sin, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool, form=_LLAMA_FORM
):
    """A layer's input norm (none when ``form``'s placement is ``"post"``) and q/k/v projection:
    rotated ``q`` ``[tokens, heads, head_dim]``, rotated ``k`` and ``v`` ``[tokens, kv_heads,
    head_dim]``; q/k norms per head (with the ``"olmo"`` style over the whole projections).
    ``form``: the config's ``(norm_style, norm_placement, hidden_act)``."""
    style, placement, _ = form
    n = x.shape[0]
    h = x if placement == "post" else rms(x, w["attention_in"], eps, style)
    q, k, v = F.linear(h, w["qkv_w"], w["qkv_b"]).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
    )
    whole = qk_norm and style == "olmo"
    if whole:
        q, k = rms(q, w["q_norm"], eps, style), rms(k, w["k_norm"], eps, style)
    q, k = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim)
    if qk_norm and not whole:
        q, k = rms(q, w["q_norm"], eps, style), rms(k, w["k_norm"], eps, style)
    if cos is not None:  # None: a layer without rotary embeddings
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return q, k, v.reshape(n, kv_heads, head_dim)


def after_attention(x, a, w, eps: float, row_parallel: Callable = F.linear, form=_LLAMA_FORM):
    """A layer's output projection of the attention ``a`` and its MLP, each added to the
    residual stream ``x``, with the norms of ``form``'s placement (on each sublayer's input, its
    output, or both); ``row_parallel(input, weight, bias)`` runs the two row-parallel products."""
    style, placement, act = form
    out = row_parallel(a, w["o_w"], w["o_b"])
    x = x + (out if placement == "pre" else rms(out, w["attention_out"], eps, style))
    h = x if placement == "post" else rms(x, w["mlp_in"], eps, style)
    gate, up = F.linear(h, w["gu_w"], w["gu_b"]).chunk(2, dim=-1)
    out = row_parallel(_act(gate, act) * up, w["down_w"], w["down_b"])
    return x + (out if placement == "pre" else rms(out, w["mlp_out"], eps, style))


@functools.cache
def compiled_pieces() -> tuple[Callable, Callable]:
    """:func:`attention_inputs` and :func:`after_attention` through ``torch.compile`` (made
    once per process; Dynamo guards on shapes and the int/float arguments, so every layer and
    every model of one shape share a compilation)."""
    return torch.compile(attention_inputs, dynamic=False), torch.compile(after_attention, dynamic=False)
