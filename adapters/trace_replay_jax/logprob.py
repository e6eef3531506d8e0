"""``token_logprob_rank`` for JAX arrays: logprob and rank of one token per row, eager or inside ``jax.jit``.

Two implementations of one contract (the core's, see
:func:`trace_replay_core.token_logprob_rank`):

- ``method="kernel"`` (the default): the core's Triton kernel, which reads each logit once,
  run through ``jax.experimental.buffer_callback`` on XLA's own stream: the callback hands
  XLA's input and output buffers to the core over DLPack and queues the kernel on
  ``ctx.stream``; nothing waits for the device. Each set of buffer addresses is bound once
  (validated, parameters packed); later calls on the same addresses only launch. The op is a
  pure function of its buffers, so
  it is marked command-buffer compatible: where XLA records it into a CUDA graph, the Python
  callback runs when XLA records (again whenever the buffers move) instead of on every call.
  On the CPU the same callback runs the core's numpy backend on XLA's host buffers.
- ``method="jnp"``: the same arithmetic in ``jax.numpy`` (a max, a sum of exponentials, a
  gather and a count), fused by XLA into the surrounding program; it reads the logits more than
  once, but needs no callback and is differentiable in ``logits``.

``bench/logprob_rank.py`` measures both inside ``jax.jit`` next to the torch versions.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

from trace_replay_core import bind_logprob_rank
from trace_replay_core import token_logprob_rank as _core_token_logprob_rank
from trace_replay_core._bound_cache import BoundCache
from trace_replay_core._logprob import LOGITS_DTYPES, MAX_VOCAB, logprob_rank_workspace_bytes

from .jnp_replay import is_vmap_tracer

__all__ = ["token_logprob_rank", "METHODS"]

METHODS = ("kernel", "jnp")
_TOKEN_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))

_VMAP_MESSAGE = ("trace_replay_jax.token_logprob_rank does not support jax.vmap: it already takes a whole "
                 "batch. Call it on the batched arrays instead (fold the mapped axis into the batch axis: "
                 "logits as [n * batch, vocab], token_ids as [n * batch]), without vmap")
_GRAD_MESSAGE = ("token_logprob_rank(method='kernel') has no gradient: use method='jnp', which is "
                 "differentiable in logits (ranks are integers and have none), or jax.nn.log_softmax")


def _check(logits: Any, token_ids: Any, method: Any) -> Tuple[int, int]:
    """Argument checks on shapes and dtypes (trace time); returns (batch, vocab)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (got {method!r})")
    for name, x in (("logits", logits), ("token_ids", token_ids)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX or numpy array (got {type(x).__name__})")
    shape = tuple(logits.shape)
    if len(shape) != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(shape)})")
    if np.dtype(logits.dtype).name not in LOGITS_DTYPES:
        raise ValueError(f"logits must be one of {LOGITS_DTYPES} (got {np.dtype(logits.dtype).name})")
    batch, vocab = shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"logits must have between 1 and {MAX_VOCAB} columns (the vocabulary) "
                         f"(got shape {list(shape)})")
    ids_shape = tuple(token_ids.shape)
    if ids_shape not in ((batch,), (batch, 1)):
        raise ValueError(f"token_ids must be [batch] or [batch, 1] with batch = {batch}, one token per row "
                         f"(got shape {list(ids_shape)})")
    if np.dtype(token_ids.dtype) not in _TOKEN_DTYPES:
        raise ValueError(f"token_ids must be int32 or int64 (got {np.dtype(token_ids.dtype).name})")
    return batch, vocab


# -- method="jnp" -------------------------------------------------------------------------------

def _jnp_logprob_rank(logits: jax.Array, ids: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """The contract in jnp ops: float32 log-sum-exp with the row maximum subtracted, a count of
    ``x >= x[t]`` (IEEE: NaN never counts), NaN/-1 for an id outside ``[0, vocab)``."""
    vocab = logits.shape[1]
    x = logits.astype(jnp.float32)
    ids = ids.reshape(-1)
    valid = (ids >= 0) & (ids < vocab)
    safe = jnp.where(valid, ids, 0).astype(jnp.int32)
    chosen = jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0]
    chosen = jnp.where(valid, chosen, jnp.nan)
    m = jax.lax.stop_gradient(jnp.max(x, axis=1))             # NaN or +inf in the row -> NaN sum
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=1))
    logprob = jnp.where(valid, chosen - lse, jnp.nan)
    rank = jnp.sum(x >= jax.lax.stop_gradient(chosen)[:, None], axis=1, dtype=jnp.int32)
    return logprob, jnp.where(valid, rank, -1).astype(jnp.int32)


# -- method="kernel" ----------------------------------------------------------------------------

_BOUND_CACHE_SIZE = 64


class _KernelCallback:
    """The buffer callback of one (batch, vocab, dtypes) signature.

    XLA hands it its buffers; on a GPU it queues the core's kernel on ``ctx.stream``. A call is
    bound (validated over DLPack, parameters packed) once per set of buffer addresses and then
    only launched: XLA's allocator gives a program the same few addresses call after call.
    A bound entry holds addresses, never the buffers (they belong to XLA).
    """

    def __init__(self):
        self._bound = BoundCache(_BOUND_CACHE_SIZE)

    def __call__(self, ctx, outs, logits, ids) -> None:
        if ctx.stage != ExecutionStage.EXECUTE:
            return
        logprobs, ranks, *workspace = outs
        workspace = workspace[0] if workspace else None
        if logits.__dlpack_device__()[0] == 1:   # host buffers: the core computes them in numpy
            _core_token_logprob_rank(logits, ids, out_logprobs=logprobs, out_ranks=ranks, stream=0,
                                     workspace=workspace)
            return
        stream = int(ctx.stream)
        buffers = (logits, ids, logprobs, ranks) if workspace is None else (logits, ids, logprobs, ranks, workspace)
        key = tuple(b.__cuda_array_interface__["data"][0] for b in buffers)
        bound = self._bound.bind(key, lambda: bind_logprob_rank(
            logits, ids, out_logprobs=logprobs, out_ranks=ranks, stream=stream, workspace=workspace))
        bound(stream=stream)


@functools.lru_cache(maxsize=None)
def _kernel_op(batch: int, vocab: int, logits_dtype: str, ids_dtype: str):
    outs = [jax.ShapeDtypeStruct((batch,), jnp.float32), jax.ShapeDtypeStruct((batch,), jnp.int32)]
    nbytes = logprob_rank_workspace_bytes(batch, vocab)
    if nbytes:
        outs.append(jax.ShapeDtypeStruct((nbytes,), jnp.uint8))
    op = buffer_callback(_KernelCallback(), outs, command_buffer_compatible=True)

    @jax.custom_jvp
    def run(logits, ids):
        out = op(logits, ids)
        return out[0], out[1]

    @run.defjvp
    def _no_grad(primals, tangents):
        raise TypeError(_GRAD_MESSAGE)

    return run


def _kernel_logprob_rank(logits: jax.Array, ids: jax.Array) -> Tuple[jax.Array, jax.Array]:
    batch, vocab = logits.shape
    if batch == 0:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
    return _kernel_op(batch, vocab, np.dtype(logits.dtype).name, np.dtype(ids.dtype).name)(logits, ids)


_IMPL = {"kernel": _kernel_logprob_rank, "jnp": _jnp_logprob_rank}
_EAGER = {name: jax.jit(impl) for name, impl in _IMPL.items()}


def token_logprob_rank(logits: jax.Array, token_ids: jax.Array, *,
                       method: str = "kernel") -> Tuple[jax.Array, jax.Array]:
    """Log-probability and rank of ``token_ids[b]`` under row ``b`` of ``logits``.

    ``logits``: ``[batch, vocab]`` float32, bfloat16 or float16, never modified.
    ``token_ids``: ``[batch]`` or ``[batch, 1]`` int32/int64 (e.g. the tokens after replay).
    ``method``: ``"kernel"`` (the core's one-pass Triton kernel on XLA's stream; numpy on the
    CPU) or ``"jnp"`` (the same arithmetic in ``jax.numpy``, differentiable in ``logits``).

    Returns ``(logprobs, ranks)``, new arrays: ``logprobs`` float32 ``[batch]`` (natural log of
    the softmax probability, accumulated in float32); ``ranks`` int32 ``[batch]`` = the number
    of vocabulary entries whose logit is greater than or equal to the token's own (vLLM's
    definition: a unique argmax has rank 1; ties count against the token).

    Special values, as the core: a row holding NaN or ``+inf``, or only ``-inf``, has logprob
    NaN (ranks stay IEEE counts: NaN never counts); ``-inf`` logits are otherwise fine; a
    token id outside ``[0, vocab)`` gives logprob NaN and rank -1 (no error: checking would
    need a host sync).

    Works eagerly (one jitted dispatch; never waits for the device) and inside ``jax.jit``,
    ``lax.fori_loop`` and ``lax.while_loop``. ``jax.vmap`` is refused (the function already
    takes a batch); gradients exist only for ``method="jnp"``.
    """
    _check(logits, token_ids, method)
    args = (logits, token_ids)
    traced = [a for a in args if isinstance(a, jax.core.Tracer)]
    if any(is_vmap_tracer(a) for a in traced):
        raise ValueError(_VMAP_MESSAGE)
    if traced:
        return _IMPL[method](logits, token_ids)
    return _EAGER[method](logits, token_ids)
