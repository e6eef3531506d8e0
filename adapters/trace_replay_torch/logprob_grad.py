"""Gradients and ``torch.vmap`` for the logprob ops of :mod:`.ops`.

- ``trace_replay::token_logprob_rank_backward``: a custom op that runs the core's backward
  (:func:`trace_replay_core.token_logprob_rank_backward`: one read of the logits, one write of the
  gradient, batch-invariant) on torch's current stream (numpy for CPU tensors)::

      token_logprob_rank_backward(Tensor logits, Tensor token_ids, Tensor? temperature,
          Tensor? argmax, Tensor logprobs, Tensor? grad_logprobs, Tensor? topk_ids,
          Tensor? topk_logprobs, Tensor? grad_topk_logprobs, Tensor? entropy,
          Tensor? grad_entropy, bool grad_temperature) -> (Tensor grad_logits, Tensor grad_temperature)

  ``grad_logits`` has the logits' shape and dtype (contiguous); ``grad_temperature`` is float32
  ``[batch]``, or empty when not asked for.
- ``torch.library.register_autograd`` on each forward op: the gradient of the logprobs, top-k
  logprobs and entropy with respect to ``logits`` and a tensor ``temperature`` (ranks, ids and
  argmax are integers: no gradient). Being an op, the backward works under ``torch.compile``.
- ``torch.library.register_vmap`` on every logprob op, the backward included: the mapped axes
  are folded into the batch axis (``[n, batch, vocab]`` runs as ``[n * batch, vocab]``; an
  unmapped argument is expanded), so ``torch.vmap`` and ``torch.func`` transforms over the op work.

Double backward is not supported (the backward op has no gradient of its own).
"""

from __future__ import annotations

import torch

from trace_replay_core import (
    BoundCache,
    bind_logprob_rank_backward,
    logprob_backward_workspace_bytes,
    token_logprob_rank_backward,
)

from .views import layout_key, raw_stream

__all__ = ["register_logprob_grads", "differentiable"]

_LIB = torch.library.Library("trace_replay", "FRAGMENT")  # kept alive: dropping it deregisters the op
_LIB.define(
    "token_logprob_rank_backward(Tensor logits, Tensor token_ids, Tensor? temperature, Tensor? argmax, "
    "Tensor logprobs, Tensor? grad_logprobs, Tensor? topk_ids, Tensor? topk_logprobs, Tensor? grad_topk_logprobs, "
    "Tensor? entropy, Tensor? grad_entropy, bool grad_temperature) -> (Tensor, Tensor)"
)


_BOUND = BoundCache(64)  # bound backward calls by tensor layout (CUDA)


def _backward_kernel(logits, token_ids, temperature, argmax, logprobs, glp, tk_ids, tk_lp, gtk, ent, gent, grad_t):
    batch, vocab = logits.shape
    device = logits.device
    grad = torch.empty((batch, vocab), dtype=logits.dtype, device=device)
    grad_temp = torch.empty((batch if grad_t else 0,), dtype=torch.float32, device=device)
    nbytes = logprob_backward_workspace_bytes(batch, vocab, grad_t)
    workspace = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=device) if nbytes else None
    tensors = [logits, token_ids, logprobs, grad, glp, temperature, grad_temp if grad_t else None, argmax]
    tensors += [tk_ids, tk_lp, gtk, ent, gent, workspace]
    t = [None if x is None else x.detach() for x in tensors]

    def call(bind: bool):
        fn = bind_logprob_rank_backward if bind else token_logprob_rank_backward
        return fn(
            t[0], t[1], t[2], out_grad_logits=t[3], stream=stream, grad_logprobs=t[4], temperature=t[5],
            out_grad_temperature=t[6], argmax=t[7], topk_ids=t[8], topk_logprobs=t[9], grad_topk_logprobs=t[10],
            entropy=t[11], grad_entropy=t[12], workspace=t[13],
        )  # fmt: skip

    if device.type == "cpu":
        stream = 0
        call(False)
    else:  # bound once per layout of the tensors (torch's allocator hands out the same few)
        stream = raw_stream(device.index)
        key = tuple(None if x is None else layout_key(x) for x in tensors)
        _BOUND.bind(key, lambda: call(True))(stream=stream)
    return grad, grad_temp


for _key in ("CPU", "CUDA"):
    _LIB.impl("token_logprob_rank_backward", _backward_kernel, _key)


@torch.library.register_fake("trace_replay::token_logprob_rank_backward", lib=_LIB)
def _backward_fake(logits, token_ids, temperature, argmax, logprobs, glp, tk_ids, tk_lp, gtk, ent, gent, grad_t):
    batch = logits.shape[0]
    return torch.empty_like(logits, memory_format=torch.contiguous_format), logits.new_empty(
        (batch if grad_t else 0,), dtype=torch.float32
    )


def _contiguous(t):
    return None if t is None else t.contiguous()


def _autograd_for(top_k: bool, argmax: bool, entropy: bool):
    """``(setup_context, backward)`` of a forward op whose arguments are ``logits, token_ids[,
    top_k], temperature`` and whose outputs are ``logprobs, ranks[, topk_logprobs, topk_ids][,
    argmax][, entropy]``."""

    def setup_context(ctx, inputs, output):
        logits, token_ids, temperature = inputs[0], inputs[1], inputs[-1]
        outs = list(output)
        lp = outs[0]
        tk_lp, tk_ids = (outs[2], outs[3]) if top_k else (None, None)
        am = outs[4 if top_k else 2] if argmax else None
        ctx.mark_non_differentiable(*(t for t in (outs[1], tk_ids, am) if t is not None))
        ent = outs[-1] if entropy else None
        ctx.has = (temperature is not None, tk_ids is not None, am is not None, ent is not None)
        saved = [t for t in (logits, token_ids, temperature, lp, tk_ids, tk_lp, am, ent) if t is not None]
        ctx.save_for_backward(*saved)

    def backward(ctx, *grads):
        has_t, has_k, has_am, has_ent = ctx.has
        it = iter(ctx.saved_tensors)
        logits, token_ids = next(it), next(it)
        temperature = next(it) if has_t else None
        lp = next(it)
        tk_ids, tk_lp = (next(it), next(it)) if has_k else (None, None)
        am = next(it) if has_am else None
        ent = next(it) if has_ent else None
        g_lp = grads[0]
        g_tk = grads[2] if has_k else None
        g_ent = grads[-1] if has_ent else None
        grad_t = bool(has_t and ctx.needs_input_grad[-1])
        grad_logits, grad_temp = torch.ops.trace_replay.token_logprob_rank_backward(
            logits, token_ids, temperature, am, lp, _contiguous(g_lp), tk_ids, tk_lp, _contiguous(g_tk), ent,
            _contiguous(g_ent), grad_t,
        )  # fmt: skip
        rest = (None, None) if top_k else (None,)
        return (grad_logits if ctx.needs_input_grad[0] else None, *rest, grad_temp if grad_t else None)

    return setup_context, backward


def _fold(t, dim, size):
    """``t`` with its mapped axis ``dim`` (None: not mapped, expanded) folded into axis 0."""
    t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _vmap_rule(op_name: str):
    """A ``register_vmap`` rule of ``trace_replay::<op_name>`` that folds the mapped axis into the
    batch axis, calls the op once and unfolds its outputs."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        logits, dim = args[0], in_dims[0]
        batch = logits.shape[0] if dim is None else logits.movedim(dim, 0).shape[1]
        folded = [_fold(a, d, size) if isinstance(a, torch.Tensor) else a for a, d in zip(args, in_dims)]
        outs = getattr(torch.ops.trace_replay, op_name)(*folded)
        # [n * batch, ...] -> [n, batch, ...]; an empty output (no temperature gradient) stays empty
        unfolded = tuple(o.reshape(size, batch if o.shape[0] else 0, *o.shape[1:]) for o in outs)
        return unfolded, tuple(0 for _ in unfolded)

    return rule


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}


def _forward_of(name: str):
    # The op's no-gradient twin: the same kernels and bits, without the Python autograd layer that
    # the differentiable op pays on every call (the Function records the graph itself).
    op = getattr(torch.ops.trace_replay, f"{name}_nograd")

    def forward(*args):
        return op(*args)

    return forward


def differentiable(name: str) -> type[torch.autograd.Function]:
    """The ``torch.autograd.Function`` of forward op ``name``: its ``_nograd`` twin (the same kernels
    and bits) with the same formula as the op's ``register_autograd`` one. The wrappers call it
    when a gradient is wanted, because torch's transforms (``torch.func.grad``, ``jacrev``, and
    ``vmap`` over them) differentiate a Function with ``setup_context`` but not a registered op's
    formula; its vmap rule is generated from the twins' own rules."""
    return _FUNCTIONS[name]


def register_logprob_grads(ops: tuple[str, ...]) -> None:
    """Register the autograd formula and the vmap rule of each forward op in ``ops`` (named
    ``token_logprob_rank[_topk][_argmax][_entropy]``), the vmap rule of its ``_nograd`` twin
    (which must be defined), and the backward op's vmap rule."""
    for name in ops:
        top_k, argmax, entropy = "_topk" in name, "_argmax" in name, "_entropy" in name
        setup_context, backward = _autograd_for(top_k, argmax, entropy)
        torch.library.register_autograd(f"trace_replay::{name}", backward, setup_context=setup_context, lib=_LIB)
        torch.library.register_vmap(f"trace_replay::{name}", _vmap_rule(name), lib=_LIB)
        torch.library.register_vmap(f"trace_replay::{name}_nograd", _vmap_rule(f"{name}_nograd"), lib=_LIB)
        _FUNCTIONS[name] = type(
            f"{name}_function",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(_forward_of(name)),
                "setup_context": staticmethod(setup_context),
                "backward": staticmethod(backward),
                "generate_vmap_rule": True,
            },
        )
    torch.library.register_vmap(
        "trace_replay::token_logprob_rank_backward", _vmap_rule("token_logprob_rank_backward"), lib=_LIB
    )
