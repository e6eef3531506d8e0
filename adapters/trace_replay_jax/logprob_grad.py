"""Gradients and ``jax.vmap`` of ``method="kernel"`` (:mod:`.logprob_callback`).

- ``jax.custom_vjp``: the gradient of the logprobs, top-k logprobs and entropy with respect to the
  logits and the temperature is the core's backward
  (:func:`trace_replay_core.token_logprob_rank_backward`: one read of the logits, one write of the
  gradient, batch-invariant), run like the forward: through a ``buffer_callback`` on XLA's stream
  on a GPU, in numpy on XLA's host buffers on the CPU. Ranks, ids and argmax are integers (no
  cotangent). The residuals are the forward's inputs and outputs, no extra buffer.
- ``jax.custom_batching.custom_vmap`` on the forward and backward ops: a mapped axis is folded into
  the batch axis (``[n, batch, vocab]`` runs as one call of ``[n * batch, vocab]``; an unmapped
  argument is broadcast), so ``jax.vmap`` works over the function, inside or outside ``jax.jit``,
  and over ``jax.grad`` of it.

Higher derivatives are not supported (the backward has no gradient of its own).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

from trace_replay_core import (
    BoundCache,
    bind_logprob_rank_backward,
    logprob_backward_workspace_bytes,
    token_logprob_rank_backward,
)

from .logprob_callback import empty_result, forward_op
from .logprob_results import LogprobResult, named_result

__all__ = ["kernel_logprob_rank"]


def _fold(x, batched: bool, size: int):
    """``x`` with its mapped axis (leading, when ``batched``; else broadcast) folded into axis 0."""
    if not batched:
        x = jnp.broadcast_to(x, (size,) + x.shape)
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _unfold(x, size: int):
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


class _BackwardCallback:
    """The buffer callback of one backward signature: inputs ``logits, ids[, temperature][,
    argmax], logprobs, grad_logprobs[, topk_ids, topk_logprobs, grad_topk][, entropy,
    grad_entropy]``, outputs ``grad_logits[, grad_temperature], workspace``."""

    def __init__(self, has_temp: bool, argmax: bool, top_k: int, entropy: bool):
        self._flags = (has_temp, argmax, top_k, entropy)
        self._bound = BoundCache(64)  # GPU: bound once per set of buffer addresses (XLA's, never kept)

    def __call__(self, ctx, outs, logits, ids, *rest) -> None:
        if ctx.stage != ExecutionStage.EXECUTE:
            return
        has_temp, argmax, top_k, entropy = self._flags
        it = iter(rest)
        temp = next(it) if has_temp else None
        am = next(it) if argmax else None
        lp, g_lp = next(it), next(it)
        tk_ids, tk_lp, g_tk = (next(it), next(it), next(it)) if top_k else (None, None, None)
        ent, g_ent = (next(it), next(it)) if entropy else (None, None)
        host = logits.__dlpack_device__()[0] == 1
        stream = 0 if host else int(ctx.stream)

        def call(fn):
            return fn(
                logits, ids, lp, out_grad_logits=outs[0], stream=stream, grad_logprobs=g_lp, temperature=temp,
                out_grad_temperature=outs[1] if has_temp else None, argmax=am, topk_ids=tk_ids, topk_logprobs=tk_lp,
                grad_topk_logprobs=g_tk, entropy=ent, grad_entropy=g_ent, workspace=outs[-1],
            )  # fmt: skip

        if host:
            call(token_logprob_rank_backward)
            return
        buffers = [b for b in (logits, ids, *rest, *outs) if b is not None]
        key = tuple(b.__cuda_array_interface__["data"][0] for b in buffers)
        self._bound.bind(key, lambda: call(bind_logprob_rank_backward))(stream=stream)


@functools.cache
def _backward_op(batch: int, vocab: int, logits_dtype: str, has_temp: bool, argmax: bool, top_k: int, entropy: bool):
    """The backward of one signature, vmappable (a mapped axis folded into the batch): ``(grad of
    logits[, grad of temperature])``."""
    outs = [jax.ShapeDtypeStruct((batch, vocab), jnp.dtype(logits_dtype))]
    if has_temp:
        outs.append(jax.ShapeDtypeStruct((batch,), jnp.float32))
    nbytes = logprob_backward_workspace_bytes(batch, vocab, has_temp)
    outs.append(jax.ShapeDtypeStruct((max(16, nbytes),), jnp.uint8))
    op = buffer_callback(_BackwardCallback(has_temp, argmax, top_k, entropy), outs, command_buffer_compatible=True)

    @jax.custom_batching.custom_vmap
    def run(*args):
        return tuple(op(*args)[:-1])

    @run.def_vmap
    def _rule(size, in_batched, *args):
        folded = [_fold(a, b, size) for a, b in zip(args, in_batched)]
        inner = _backward_op(size * batch, vocab, logits_dtype, has_temp, argmax, top_k, entropy)
        return tuple(_unfold(o, size) for o in inner(*folded)), tuple(True for _ in outs[:-1])

    return run


@functools.cache
def _differentiable(
    batch: int, vocab: int, logits_dtype: str, ids_dtype: str, top_k: int, has_temp: bool, argmax: bool, entropy: bool
):
    """The kernel method of one signature as ``run(logits, ids[, temperature]) -> result``, with a
    ``custom_vjp`` around a ``custom_vmap`` of the forward op."""
    forward = forward_op(batch, vocab, logits_dtype, ids_dtype, top_k, has_temp, argmax, entropy)

    @jax.custom_batching.custom_vmap
    def primal(logits, ids, *temperature):
        return tuple(forward(logits, ids, *temperature))

    @primal.def_vmap
    def _rule(size, in_batched, logits, ids, *temperature):
        args = [_fold(a, b, size) for a, b in zip((logits, ids, *temperature), in_batched)]
        inner = _differentiable(size * batch, vocab, logits_dtype, ids_dtype, top_k, has_temp, argmax, entropy)
        outs = tuple(_unfold(o, size) for o in inner(*args))
        return outs, tuple(True for _ in outs)

    @jax.custom_vjp
    def run(logits, ids, *temperature):
        return primal(logits, ids, *temperature)

    def fwd(logits, ids, *temperature):
        outs = primal(logits, ids, *temperature)
        return outs, (logits, ids, temperature, outs)

    def bwd(res, cts):
        logits, ids, temperature, outs = res
        named = named_result(outs, top_k, argmax, entropy)
        ct = named_result(cts, top_k, argmax, entropy)
        args = [logits, ids, *temperature]
        if argmax:
            args.append(named.argmax)
        args += [named.logprobs, ct.logprobs.astype(jnp.float32)]
        if top_k:
            args += [named.topk_ids, named.topk_logprobs, ct.topk_logprobs.astype(jnp.float32)]
        if entropy:
            args += [named.entropy, ct.entropy.astype(jnp.float32)]
        grads = _backward_op(logits.shape[0], vocab, logits_dtype, has_temp, argmax, top_k, entropy)(*args)
        return (grads[0], None, *((grads[1],) if has_temp else ()))

    run.defvjp(fwd, bwd)
    return run


def kernel_logprob_rank(
    logits: jax.Array,
    ids: jax.Array,
    temperature: jax.Array | None,
    top_k: int,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobResult:
    """``method="kernel"`` on arguments already checked by the public function (``ids``
    ``[batch]`` or ``[batch, 1]``; ``temperature`` None or ``[batch]``); traceable,
    differentiable in ``logits`` and ``temperature``, vmappable. New arrays."""
    batch, vocab = logits.shape
    if batch == 0:
        return empty_result(top_k, argmax, entropy)
    ids = ids.reshape(-1)
    run = _differentiable(
        batch,
        vocab,
        np.dtype(logits.dtype).name,
        np.dtype(ids.dtype).name,
        top_k,
        temperature is not None,
        argmax,
        entropy,
    )
    args = (logits, ids) if temperature is None else (logits, ids, temperature.astype(jnp.float32))
    return named_result(run(*args), top_k, argmax, entropy)
