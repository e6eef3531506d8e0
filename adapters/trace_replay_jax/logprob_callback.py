"""``method="kernel"`` of :func:`~trace_replay_jax.token_logprob_rank`: the core's Triton
kernels run inside XLA's program through ``jax.experimental.buffer_callback``.

One op per signature (batch, vocabulary, dtypes, ``top_k``, temperature or not, ``argmax``,
``entropy``),
built once per process and cached. XLA hands the callback its input and output buffers; on a
GPU it passes them to the core over DLPack and queues the kernels on ``ctx.stream`` (XLA's own
stream; nothing waits for the device). Each set of buffer addresses is bound once (validated,
parameters packed) and only launched afterwards; an entry holds addresses, never the buffers,
which belong to XLA. The op is a pure function of its buffers, so it is marked command-buffer
compatible: where XLA records it into a CUDA graph, the callback runs when XLA records (again
whenever the buffers move) instead of on every call. On the CPU the same callback runs the
core's numpy backend on XLA's host buffers. Its gradient and its vmap rule: :mod:`.logprob_grad`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

from trace_replay_core import BoundCache, bind_logprob_rank, logprob_rank_workspace_bytes
from trace_replay_core import token_logprob_rank as _core_token_logprob_rank

from .logprob_results import LogprobResult, named_result

__all__ = ["forward_op", "empty_result"]

_BOUND_CACHE_SIZE = 64


class _KernelCallback:
    """The buffer callback of one (batch, vocab, dtypes, top_k, temperature, argmax, entropy) signature.

    XLA hands it its buffers; on a GPU it queues the core's kernels on ``ctx.stream``. A call is
    bound (validated over DLPack, parameters packed) once per set of buffer addresses and then
    only launched: XLA's allocator gives a program the same few addresses call after call.
    A bound entry holds addresses, never the buffers (they belong to XLA).
    """

    def __init__(self, top_k: int, argmax: bool, entropy: bool = False):
        self._bound = BoundCache(_BOUND_CACHE_SIZE)
        self._top_k = top_k
        self._argmax = argmax
        self._entropy = entropy

    def __call__(self, ctx, outs, logits, ids, *temperature) -> None:
        if ctx.stage != ExecutionStage.EXECUTE:
            return
        top_k = self._top_k
        logprobs, ranks = outs[0], outs[1]
        top_lp, top_ids = (outs[2], outs[3]) if top_k else (None, None)
        extra = list(outs[4:-1] if top_k else outs[2:-1])  # [argmax][, entropy]
        greedy = extra.pop(0) if self._argmax else None
        ent = extra.pop(0) if self._entropy else None
        workspace = outs[-1]
        temp = temperature[0] if temperature else None
        if logits.__dlpack_device__()[0] == 1:  # host buffers: the core computes them in numpy
            _core_token_logprob_rank(
                logits,
                ids,
                out_logprobs=logprobs,
                out_ranks=ranks,
                stream=0,
                workspace=workspace,
                temperature=temp,
                top_k=top_k,
                out_topk_logprobs=top_lp,
                out_topk_ids=top_ids,
                out_argmax=greedy,
                out_entropy=ent,
            )
            return
        stream = int(ctx.stream)
        buffers = [
            b for b in (logits, ids, logprobs, ranks, workspace, temp, top_lp, top_ids, greedy, ent) if b is not None
        ]
        key = tuple(b.__cuda_array_interface__["data"][0] for b in buffers)
        bound = self._bound.bind(
            key,
            lambda: bind_logprob_rank(
                logits,
                ids,
                out_logprobs=logprobs,
                out_ranks=ranks,
                stream=stream,
                workspace=workspace,
                temperature=temp,
                top_k=top_k,
                out_topk_logprobs=top_lp,
                out_topk_ids=top_ids,
                out_argmax=greedy,
                out_entropy=ent,
            ),
        )
        bound(stream=stream)


@functools.cache
def forward_op(
    batch: int, vocab: int, logits_dtype: str, ids_dtype: str, top_k: int, has_temp: bool, argmax: bool, entropy: bool
):
    """The op of one signature: ``op(logits, ids[, temperature])`` returns ``logprobs, ranks[,
    topk_logprobs, topk_ids][, argmax][, entropy]`` (a tuple; the workspace, scratch, is dropped).
    :mod:`.logprob_grad` makes it differentiable and vmappable."""
    outs = [jax.ShapeDtypeStruct((batch,), jnp.float32), jax.ShapeDtypeStruct((batch,), jnp.int32)]
    if top_k:
        outs += [jax.ShapeDtypeStruct((batch, top_k), jnp.float32), jax.ShapeDtypeStruct((batch, top_k), jnp.int32)]
    if argmax:
        outs.append(jax.ShapeDtypeStruct((batch,), jnp.int32))
    if entropy:
        outs.append(jax.ShapeDtypeStruct((batch,), jnp.float32))
    outs.append(jax.ShapeDtypeStruct((max(16, logprob_rank_workspace_bytes(batch, vocab, top_k)),), jnp.uint8))
    op = buffer_callback(_KernelCallback(top_k, argmax, entropy), outs, command_buffer_compatible=True)

    def run(logits, ids, *temperature):
        return tuple(op(logits, ids, *temperature)[:-1])

    return run


def empty_result(top_k: int, argmax: bool, entropy: bool) -> LogprobResult:
    """The result of an empty batch."""
    empty = [jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)]
    if top_k:
        empty += [jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)]
    if argmax:
        empty.append(jnp.zeros((0,), jnp.int32))
    if entropy:
        empty.append(jnp.zeros((0,), jnp.float32))
    return named_result(empty, top_k, argmax, entropy)
