"""``token_logprob_rank`` on logits sharded over the vocabulary axis of a mesh.

A model with a vocabulary-parallel output projection leaves each device with a block of
columns of every row. Each block yields four partials per row: its maximum, its sum of
``exp(x - M)``, its count of ``x >= chosen`` and, on the block that holds the row's token,
the chosen logit. They are merged across the vocabulary axis in a fixed order:

1. every block's maximum and chosen-logit candidate are gathered (``all_gather``: each device
   gets all of them, indexed by shard); ``M`` = their maximum, the chosen logit = the one
   from the shard that owns the token (a selection, no arithmetic);
2. every block's sum of ``exp(x - M)`` and count are gathered the same way, then added in
   shard order 0, 1, 2, ... by explicit additions.

So the bits depend on the logits and the number of vocabulary shards only: not on the order
in which a collective happens to combine values (a ``psum`` may add in any order), not on the
batch or the batch sharding. The arithmetic is the unsharded ``method="jnp"`` formula
(float32, ``M + log(sum(exp(x - M)))``, rank = 1-based count of ``>=``); only the sum's order
differs, so logprobs agree with the unsharded result to float32 rounding and ranks exactly.
Special values follow :func:`trace_replay_jax.token_logprob_rank`: a row holding NaN or
``+inf``, or only ``-inf``, has logprob NaN; a token id outside ``[0, vocab)`` gives NaN and -1.

Cost per row: two ``all_gather`` of two float32/int32 values per shard, on top of one read
of the local block.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from trace_replay_core import LOGITS_DTYPES, TOKEN_DTYPES

from .guards import check_fits_int32
from .logprob_results import LogprobRank

__all__ = ["token_logprob_rank_sharded", "token_logprob_rank_in_shard_map"]

_TOKEN_DTYPES = tuple(np.dtype(d) for d in TOKEN_DTYPES)


def _check_block(logits: Any, token_ids: Any) -> None:
    for name, x in (("logits", logits), ("token_ids", token_ids)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX array (got {type(x).__name__})")
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(logits.shape)})")
    if np.dtype(logits.dtype).name not in LOGITS_DTYPES:
        raise TypeError(f"logits must have dtype {' or '.join(LOGITS_DTYPES)} (got {np.dtype(logits.dtype).name})")
    batch = logits.shape[0]
    if tuple(token_ids.shape) not in ((batch,), (batch, 1)):
        raise ValueError(
            f"token_ids must be [batch] or [batch, 1] with batch = {batch}, one token per row "
            f"(got shape {list(token_ids.shape)})"
        )
    if np.dtype(token_ids.dtype) not in _TOKEN_DTYPES:
        raise TypeError(f"token_ids must have dtype int32 or int64 (got {np.dtype(token_ids.dtype).name})")
    check_fits_int32(token_ids, "token_ids")  # an int64 numpy id JAX would wrap without x64


_COMPUTED_ELSEWHERE = (
    "token_logprob_rank_sharded does not compute {name} (got {value!r}): it merges logprobs and ranks "
    "only; for top_k, argmax or entropy call trace_replay_jax.token_logprob_rank on logits "
    "replicated over vocab_axis"
)


def _refuse_options(top_k: Any, temperature: Any, argmax: Any, entropy: Any) -> None:
    """Refuse the options of :func:`trace_replay_jax.token_logprob_rank` that the merge does not
    compute, naming the option and what to do instead."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k != 0:
        raise ValueError(_COMPUTED_ELSEWHERE.format(name="top_k", value=top_k))
    for name, flag in (("argmax", argmax), ("entropy", entropy)):
        if flag is not False:
            raise ValueError(_COMPUTED_ELSEWHERE.format(name=name, value=flag))
    if temperature is not None:
        raise ValueError(
            f"token_logprob_rank_sharded does not take temperature (got {temperature!r}): pass the "
            f"logits divided by it (logits / T, or logits / T[:, None] for one T per row): the "
            f"results of temperature=T are those of logits / T"
        )


def _in_order(parts: jax.Array) -> jax.Array:
    """``parts[0] + parts[1] + ...`` along axis 0, added in that order."""
    total = parts[0]
    for k in range(1, parts.shape[0]):
        total = total + parts[k]
    return total


def token_logprob_rank_in_shard_map(
    logits: jax.Array, token_ids: jax.Array, *, vocab_axis: str
) -> tuple[jax.Array, jax.Array]:
    """The merge, called inside ``shard_map`` on each device's block.

    ``logits``: this device's ``[batch, vocab / n]`` block of columns (shard ``k`` of the
    ``vocab_axis`` holds columns ``[k * vocab / n, (k + 1) * vocab / n)``), float32, bfloat16
    or float16. ``token_ids``: ``[batch]`` or ``[batch, 1]`` global token ids of the same rows
    (replicated over ``vocab_axis``). Returns ``(logprobs, ranks)`` of those rows (float32,
    int32), the same on every device of the ``vocab_axis``: a plain tuple, so that the caller's
    ``shard_map`` names its outputs with a tuple of two specs (``out_specs=(P(...), P(...))``;
    :func:`token_logprob_rank_sharded` returns the named :class:`~trace_replay_jax.LogprobRank`).
    Stream-ordered like any JAX op.
    """
    _check_block(logits, token_ids)
    block = logits.shape[1]
    shard = jax.lax.axis_index(vocab_axis)
    x = logits.astype(jnp.float32)
    ids = token_ids.reshape(-1)
    local = ids - (shard * block).astype(ids.dtype)  # column in this block
    here = (local >= 0) & (local < block)
    picked = jnp.take_along_axis(x, jnp.where(here, local, 0).astype(jnp.int32)[:, None], axis=1)[:, 0]
    # Round 1: maxima and the chosen logit's candidates, by shard.
    maxima = jax.lax.all_gather(jnp.max(x, axis=1), vocab_axis)  # [n, batch]
    candidates = jax.lax.all_gather(picked, vocab_axis)  # [n, batch]
    n = maxima.shape[0]
    vocab = n * block
    valid = (ids >= 0) & (ids < vocab)
    owner = jnp.where(valid, ids // block, 0).astype(jnp.int32)
    chosen = jnp.take_along_axis(candidates, owner[None, :], axis=0)[0]
    chosen = jnp.where(valid, chosen, jnp.nan)
    m = jnp.max(maxima, axis=0)  # exact in any order
    # Round 2: each block's sum of exponentials and count, added in shard order.
    sums = jax.lax.all_gather(jnp.sum(jnp.exp(x - m[:, None]), axis=1), vocab_axis)
    counts = jax.lax.all_gather(jnp.sum(x >= chosen[:, None], axis=1, dtype=jnp.int32), vocab_axis)
    lse = m + jnp.log(_in_order(sums))
    logprob = jnp.where(valid, chosen - lse, jnp.nan)
    rank = jnp.where(valid, _in_order(counts), -1).astype(jnp.int32)
    return logprob, rank


def token_logprob_rank_sharded(
    logits: jax.Array,
    token_ids: jax.Array,
    *,
    mesh: Mesh,
    vocab_axis: str,
    batch_axis: str | None = None,
    top_k: int = 0,
    temperature: None = None,
    argmax: bool = False,
    entropy: bool = False,
) -> LogprobRank:
    """Log-probability and rank of ``token_ids[b]`` under row ``b`` of vocabulary-sharded ``logits``.

    ``logits``: global ``[batch, vocab]`` array, columns split evenly over ``vocab_axis`` of
    ``mesh`` (rows optionally over ``batch_axis``), never modified. ``token_ids``: global
    ``[batch]`` or ``[batch, 1]`` int32/int64 (an int64 numpy array must fit int32 while
    ``jax_enable_x64`` is off, as for :func:`trace_replay_jax.token_logprob_rank`). Returns
    :class:`~trace_replay_jax.LogprobRank` ``(logprobs, ranks)``: float32 and int32 ``[batch]``,
    sharded over ``batch_axis`` (replicated when it is ``None``), with
    :func:`trace_replay_jax.token_logprob_rank`'s contract and definitions. Eager or inside
    ``jax.jit``; a ``shard_map`` over ``mesh`` around :func:`token_logprob_rank_in_shard_map`.

    Not computed here: ``top_k``, ``argmax`` and ``entropy`` (call
    :func:`trace_replay_jax.token_logprob_rank` on logits replicated over ``vocab_axis``), and
    ``temperature`` (pass ``logits / T``: the results of ``temperature=T`` are those of
    ``logits / T``); each is refused with a ``ValueError`` naming it when given a value other
    than its default. There is no ``method=``: the merge is the ``method="jnp"`` arithmetic.
    """
    _refuse_options(top_k, temperature, argmax, entropy)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (got {type(mesh).__name__})")
    for name, axis in (("vocab_axis", vocab_axis), ("batch_axis", batch_axis)):
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(f"{name} must be one of the mesh's axes {mesh.axis_names} (got {axis!r})")
    if batch_axis == vocab_axis:
        raise ValueError(f"batch_axis and vocab_axis must differ (got {vocab_axis!r} for both)")
    _check_block(logits, token_ids)
    batch, vocab = logits.shape
    shards = mesh.shape[vocab_axis]
    if vocab % shards:
        raise ValueError(
            f"logits has {vocab} columns, which {shards} shards of vocab_axis {vocab_axis!r} do not "
            f"split evenly: pad the vocabulary to a multiple of {shards}"
        )
    rows = mesh.shape[batch_axis] if batch_axis is not None else 1
    if batch % rows:
        raise ValueError(
            f"logits has {batch} rows, which {rows} shards of batch_axis {batch_axis!r} do not split evenly"
        )
    return LogprobRank(*_sharded(mesh, vocab_axis, batch_axis, len(token_ids.shape))(logits, token_ids))


@functools.lru_cache(maxsize=64)
def _sharded(mesh: Mesh, vocab_axis: str, batch_axis: str | None, ids_ndim: int):
    """The ``shard_map`` of one layout, jitted: eagerly one dispatch; under a trace, inlined."""
    ids_spec = PartitionSpec(batch_axis) if ids_ndim == 1 else PartitionSpec(batch_axis, None)
    return jax.jit(
        jax.shard_map(
            lambda lg, ids: token_logprob_rank_in_shard_map(lg, ids, vocab_axis=vocab_axis),
            mesh=mesh,
            in_specs=(PartitionSpec(batch_axis, vocab_axis), ids_spec),
            out_specs=(PartitionSpec(batch_axis), PartitionSpec(batch_axis)),
            check_vma=False,
        )
    )
