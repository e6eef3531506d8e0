"""The decode steps of the JAX driver, on any model that keeps the decode protocol: one jitted
admission and one jitted step, replay inside it.

:func:`run_model` runs a checked call (:class:`~trace_replay_app.schedule.DecodeCall`) on a
model (:class:`~.jax_driver.JaxDecodeModel`, a static argument of the jitted programs: equal
models share compiled programs) and its placed parameters: the prefill of each prompt padded
to a bucket (jitted alone; with the model's ``batched_prefill``, the prompts admitted together
that share a bucket in one vmapped program, :func:`prefill_groups`), its keys and values
written into the slot with its lengths and first token (:func:`_admit`), and the step
(:func:`_step`: logits, sampling by Gumbel-max with the noise of step ``t`` from
``fold_in(key(seed), t)``, :func:`trace_replay_jax.replay` with the state's tables passed in,
logprob/rank/argmax in one read of the unmodified logits, outputs appended to fixed chunks,
:mod:`.jax_chunks`), and one copy of the outputs to the host at the end. With a ``mesh``, the
logits are sharded over ``vocab_axis`` (see :mod:`.jax_driver`). Both entry points of
:mod:`.jax_driver` end here: a registry family's ``run_decode`` and ``decode_model`` on a
user's model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_replay_jax import ReplayTables, TraceReplayState, replay, token_logprob_rank, token_logprob_rank_sharded

from ..schedule import DecodeCall
from .jax_chunks import bucket, fresh_outputs, prompt_prefix, run_chunks

__all__ = ["Carry", "run_model", "sharded_argmax", "prefill_groups", "PREFILL_GROUP", "PREFILL_SCORES"]

#: a batched prefill's most prompts per program (its group is padded to a power of two, at
#: most this), and its most attention scores per head, ``group * bucket ** 2`` (the JAX families
#: store their prefill scores: 4M float32 per head at 16 x 512 or 4 x 1,024 tokens)
PREFILL_GROUP = 64
PREFILL_SCORES = 1 << 22


class Carry(NamedTuple):
    """Decode state that lives on the device between steps (donated to each step).

    ``cache``: the model's KV cache pytree. ``prompt_len``/``total_len``: per slot, int32
    (``total_len`` = prompt + tokens decoded so far). ``last``: the token each row feeds next.
    ``step``: the next step's index within the current chunk; ``t``: its index in the run.
    ``tokens``, ``argmax``, ``logprobs``, ``ranks``: that chunk's outputs ``[CHUNK, slots]``."""

    cache: Any
    prompt_len: jax.Array
    total_len: jax.Array
    last: jax.Array
    step: jax.Array
    t: jax.Array
    tokens: jax.Array
    argmax: jax.Array
    logprobs: jax.Array
    ranks: jax.Array


def sharded_argmax(x, mesh: Mesh, vocab_axis: str):
    """``argmax(x, axis=-1)`` (int32, ties: the lowest id) of ``[rows, vocab]`` ``x`` sharded
    over ``vocab_axis``: each block's maximum and where it is, gathered (two values per row and
    block) and merged in block order, the first block holding the maximum winning."""

    def block(xb):
        n = xb.shape[1]
        local = jnp.argmax(xb, axis=-1).astype(jnp.int32)
        top = jnp.take_along_axis(xb, local[:, None], axis=1)[:, 0]
        tops = jax.lax.all_gather(top, vocab_axis)  # [blocks, rows]
        ids = jax.lax.all_gather(local + jax.lax.axis_index(vocab_axis).astype(jnp.int32) * n, vocab_axis)
        best, best_id = tops[0], ids[0]
        for k in range(1, tops.shape[0]):
            better = tops[k] > best
            best, best_id = jnp.where(better, tops[k], best), jnp.where(better, ids[k], best_id)
        return best_id

    return jax.shard_map(block, mesh=mesh, in_specs=P(None, vocab_axis), out_specs=P(), check_vma=False)(x)


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill(params, prefix, *, model):
    """The keys and values of one prompt prefix (``[bucket]``): one program per bucket,
    independent of the slots (jitted apart from :func:`_admit`: fused with the cache update,
    XLA rounds some float32 keys differently)."""
    return model.prefill(params, prefix)


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill_group(params, prefixes, *, model):
    """The keys and values of ``prefixes`` ``[group, bucket]`` (prompts of one bucket size),
    ``jax.vmap(model.prefill)``: each entry's leading axis is the group's."""
    return jax.vmap(model.prefill, in_axes=(None, 0))(params, prefixes)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("carry",))
def _admit_group(carry: Carry, kv, slots, prompt_lens, lasts, *, model) -> Carry:
    """:func:`_admit` for a group: entry ``j`` of ``kv`` (from :func:`_prefill_group`) into
    ``slots[j]``, one write after another in a ``fori_loop``; a slot given twice gets the same
    entry twice (how a group is padded to its size)."""

    def write(j, cache):
        entry = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), kv)
        return model.write(cache, entry, slots[j])

    return carry._replace(
        cache=jax.lax.fori_loop(0, slots.shape[0], write, carry.cache),
        prompt_len=carry.prompt_len.at[slots].set(prompt_lens),
        total_len=carry.total_len.at[slots].set(prompt_lens),
        last=carry.last.at[slots].set(lasts),
    )


def prefill_groups(buckets: list[int], limit: int = PREFILL_GROUP) -> list[list[int]]:
    """Indices into ``buckets`` (each request's prefill bucket, in admission order) that prefill
    together: the same bucket, at most ``limit`` of them and at most :data:`PREFILL_SCORES`
    attention scores per head (``group * bucket ** 2``; the most a power of two, so padding a
    group to one stays within both), in order of first appearance."""
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(buckets):
        by_bucket.setdefault(n, []).append(i)
    groups = []
    for n, members in by_bucket.items():
        per = 1 << (max(1, min(limit, PREFILL_SCORES // (n * n))).bit_length() - 1)  # a power of two
        groups += [members[k : k + per] for k in range(0, len(members), per)]
    return groups


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("carry",))
def _admit(carry: Carry, kv, slot, prompt_len, last, *, model) -> Carry:
    """A request joins ``slot``: its prefilled keys and values (``kv``) into the slot, its
    lengths and the token it feeds first. Positions past the real prompt hold padding; a decode
    step overwrites each before any query reads it (a step writes its own position first and
    attends to no later one)."""
    return carry._replace(
        cache=model.write(carry.cache, kv, slot),
        prompt_len=carry.prompt_len.at[slot].set(prompt_len),
        total_len=carry.total_len.at[slot].set(prompt_len),
        last=carry.last.at[slot].set(last),
    )


@functools.partial(
    jax.jit, static_argnames=("model", "sample", "processed", "mesh", "vocab_axis"), donate_argnames=("carry",)
)
def _step(
    params,
    tables: ReplayTables,
    idx_chunk,
    carry: Carry,
    key,
    temperature,
    *,
    model,
    sample: bool,
    processed: bool,
    mesh: Mesh | None,
    vocab_axis: str,
) -> Carry:
    """One decode step of every row: logits, (sampling), replay, logprob/rank/argmax, append.
    One device: rows start at -1 ("not drawn"), replay writes the traced rows, the one read of
    the logits (:func:`trace_replay_jax.token_logprob_rank` with ``argmax=True``) scores the -1
    rows as their argmax, and those rows take it. A mesh: the sharded argmax and logprob."""
    k = carry.step
    idx_mapping = idx_chunk[k]  # row -> slot, -1: empty row (this chunk's schedule)
    active = idx_mapping >= 0
    positions = jnp.where(active, carry.total_len - 1, 0)  # empty rows: anywhere in range
    logits, cache = model.decode(params, carry.cache, carry.last, positions)
    noise = jax.random.gumbel(jax.random.fold_in(key, carry.t), logits.shape, jnp.float32) if sample else None
    if mesh is None:
        drawn = jnp.full(idx_mapping.shape, -1, jnp.int32)  # greedy: the argmax, chosen below
        if noise is not None:  # Gumbel-max over logits / temperature
            drawn = jnp.argmax(logits.astype(jnp.float32) / temperature + noise, axis=-1).astype(jnp.int32)
        sampled = replay(tables, drawn, idx_mapping, carry.total_len, carry.prompt_len)  # -1 rows stay -1
        temps = jnp.full(sampled.shape, temperature, jnp.float32) if processed else None  # logprobs of logits / T
        logprobs, ranks, argmax = cast(tuple, token_logprob_rank(logits, sampled, argmax=True, temperature=temps))
        sampled = jnp.where(sampled < 0, argmax, sampled)
    else:
        by_vocab = NamedSharding(mesh, P(None, vocab_axis))
        logits = jax.lax.with_sharding_constraint(logits, by_vocab)
        argmax = sharded_argmax(logits, mesh, vocab_axis)  # ties: the lowest id
        drawn = argmax
        if noise is not None:  # the one-device run's noise, sharded
            noise = jax.lax.with_sharding_constraint(noise, by_vocab)
            drawn = sharded_argmax(logits.astype(jnp.float32) / temperature + noise, mesh, vocab_axis)
        sampled = replay(tables, drawn, idx_mapping, carry.total_len, carry.prompt_len)
        logprobs, ranks = token_logprob_rank_sharded(logits, sampled, mesh=mesh, vocab_axis=vocab_axis)
    return Carry(
        cache=cache,
        prompt_len=carry.prompt_len,
        total_len=carry.total_len + active.astype(jnp.int32),
        last=jnp.where(active, sampled, carry.last),
        step=k + 1,
        t=carry.t + 1,
        tokens=carry.tokens.at[k].set(sampled),
        argmax=carry.argmax.at[k].set(argmax),
        logprobs=carry.logprobs.at[k].set(logprobs),
        ranks=carry.ranks.at[k].set(ranks.astype(jnp.int32)),
    )


def run_model(
    model: Any, params: Any, call: DecodeCall, dev: Any, *, put: Callable, mesh: Mesh | None, vocab_axis: str
) -> dict[str, np.ndarray]:
    """Every step of ``call.schedule`` on ``model`` (a :class:`~.jax_driver.JaxDecodeModel`)
    with ``params`` already placed (on ``dev``, or over ``mesh``); the per-step outputs
    ``[n_steps, slots]`` on the host (one copy at the end: host-blocking there, not per step).

    ``put`` places host arrays where the run lives (``dev``, or replicated over ``mesh``);
    the model's cache (``model.new_cache(slots, kv_len)``, ``kv_len`` the call's KV positions
    padded to a bucket of at most ``model.n_positions``) is made there, donated to each step
    and never read by the driver."""
    rows = call.schedule.slots
    kv_len = bucket(call.kv_positions, model.n_positions)
    if mesh is None:
        with jax.default_device(dev):
            cache = model.new_cache(rows, kv_len)
    else:
        cache = put(model.new_cache(rows, kv_len))
    key = put(jax.random.key(call.seed))
    temp = put(np.float32(call.temperature if call.temperature > 0 else 1.0))
    carry = Carry(
        cache=cache,
        **put(
            dict(
                prompt_len=np.zeros(rows, np.int32),
                total_len=np.zeros(rows, np.int32),
                last=np.zeros(rows, np.int32),
                t=np.zeros((), np.int32),
                **fresh_outputs(rows),
            )
        ),
    )

    batched = bool(getattr(model, "batched_prefill", False))

    def admit(carry: Carry, slots: list[int], prompts: list) -> Carry:
        prefixes = [prompt_prefix(p, kv_len) for p in prompts]
        groups = prefill_groups([len(x) for x in prefixes]) if batched else [[i] for i in range(len(prompts))]
        for group in groups:
            if len(group) == 1:  # one prompt: the program of one prompt (its bits, whatever the batch)
                (i,) = group
                kv = _prefill(params, put(prefixes[i]), model=model)
                slot_len_last = put(np.int32(slots[i])), put(np.int32(len(prompts[i]))), put(np.int32(prompts[i][-1]))
                carry = _admit(carry, kv, *slot_len_last, model=model)
                continue
            size = 1 << (len(group) - 1).bit_length()  # a few compiled sizes: padded with the first entry
            group = group + [group[0]] * (size - len(group))
            kv = _prefill_group(params, put(np.stack([prefixes[i] for i in group])), model=model)
            arrays = ([slots[i] for i in group], [len(prompts[i]) for i in group], [prompts[i][-1] for i in group])
            carry = _admit_group(carry, kv, *(put(np.asarray(a, np.int32)) for a in arrays), model=model)
        return carry

    def step(carry: Carry, tables: ReplayTables, idx_chunk) -> Carry:
        return _step(params, tables, idx_chunk, carry, key, temp, model=model,
                     sample=call.temperature > 0, processed=call.logprob_temperature is not None, mesh=mesh,
                     vocab_axis=vocab_axis)  # fmt: skip

    # The table's shape is part of the step program's signature: bucket its row length too.
    max_trace = bucket(call.longest_trace, model.n_positions)
    where = {"device": dev} if mesh is None else {"mesh": mesh}
    with TraceReplayState(rows, max_trace, vocab_size=model.vocab_size, **where) as state:
        return run_chunks(call.schedule, call.prompts, call.traces, state, carry, put=put, fetch=jax.device_get,
                          admit=admit, step=step, on_step=call.on_step)  # fmt: skip
