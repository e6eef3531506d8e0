"""The JAX decode driver every model family runs on: one jitted program per step, replay inside it.

A family supplies a :class:`JaxFamily`: its config class and weight check, its parameter
pytree, its empty KV cache, and its prefill/write/decode math. :func:`decoder` binds the driver
to it and returns the family's ``run_decode`` (the contract of
:mod:`trace_replay_app.models.family`). The driver owns the rest, once for every family: the
argument checks and the schedule (:func:`trace_replay_app.schedule.check_decode`), the memory
estimate against the device's memory stats before anything is allocated there, admission (the
prefill of the prompt padded to a bucket, then its keys and values into the slot with its
lengths and first token), and the jitted step (logits, sampling by Gumbel-max with the noise of
step ``t`` from ``fold_in(key(seed), t)``, :func:`trace_replay_jax.replay` with the state's tables
passed in, logprob/rank/argmax in one read of the unmodified logits, outputs appended to
fixed chunks, :mod:`.jax_chunks`), and one copy of the outputs to the host at the end.

With ``mesh=`` (a ``jax.sharding.Mesh``), the same run spans the mesh's devices: the output
projection (``[hidden, vocab]``) is sharded along the vocabulary over ``vocab_axis``, every other
weight, the KV cache, the lengths and the outputs are replicated; the argmax (and the Gumbel-max
draw) over the sharded logits merges each block's maximum in block order (ties: the lowest
id), replay runs on a :class:`trace_replay_jax.TraceReplayState` over the mesh, and logprob and
rank come from :func:`trace_replay_jax.token_logprob_rank_sharded`. Tokens equal the one-device
run's; logprobs agree to float32 rounding (the order of the sum of exponentials differs), ranks
exactly. Matrix products of float32 run at full precision (``precision="highest"``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_replay_jax import (
    ReplayTables,
    TraceReplayState,
    replay,
    resolve_device,
    token_logprob_rank,
    token_logprob_rank_sharded,
)

from ..records import RequestResult, TraceRequest
from ..schedule import DecodeCall, check_decode, collect_results
from . import jax_chunks
from .jax_chunks import bucket, fresh_outputs, prompt_prefix, run_chunks
from .memory import check_fits, estimate_bytes

__all__ = ["JaxFamily", "Carry", "decoder", "free_bytes", "placed_params", "sharded_argmax"]


@dataclasses.dataclass(frozen=True)
class JaxFamily:
    """What a family gives the JAX driver (pure functions; ``config`` is a static, hashable value).

    ``config_type``, ``check_weights``: its config class and weight check.
    ``params(config, weights, head)``: host pytree of float32 numpy arrays from the caller's
    weights (copies); with ``head=True`` it holds the output projection as ``"head"``
    ``[hidden, vocab]`` (the mesh shards it). ``new_cache(config, slots, kv_len, dtype)``: the
    zero KV cache pytree. ``prefill(params, config, tokens)``: the keys and values of one prompt
    ``tokens`` ``[bucket]`` (positions ``0 ..``) in the layout ``write`` takes.
    ``write(cache, kv, slot)``: the cache with ``kv`` at positions ``0 ..`` of ``slot``.
    ``decode(params, config, cache, tokens, positions)``: one token per row, row ``b`` feeding
    ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache; returns ``(logits [rows, vocab],
    cache)`` with the step's keys and values stored. For ``score``
    (:mod:`~trace_replay_app.drivers.jax_score`): ``hidden(params, config, tokens)``, the
    final-norm hidden states ``[requests, n, hidden]`` of right-padded ``tokens``
    ``[requests, n]`` (causal, no cache), and ``logits(params, hidden)``, the output projection
    of ``[rows, hidden]``."""

    config_type: type
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None]
    params: Callable[[Any, Mapping[str, np.ndarray], bool], Any]
    new_cache: Callable[[Any, int, int, Any], Any]
    prefill: Callable[..., Any]
    write: Callable[[Any, Any, Any], Any]
    decode: Callable[..., tuple[jax.Array, Any]]
    hidden: Callable[..., jax.Array]
    logits: Callable[[Any, jax.Array], jax.Array]


class Carry(NamedTuple):
    """Decode state that lives on the device between steps (donated to each step).

    ``cache``: the family's KV cache pytree. ``prompt_len``/``total_len``: per slot, int32
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


@functools.partial(jax.jit, static_argnames=("family", "config"))
def _prefill(params, prefix, *, family: JaxFamily, config):
    """The keys and values of one prompt prefix (``[bucket]``): one program per bucket,
    independent of the slots (jitted apart from :func:`_admit`: fused with the cache update,
    XLA rounds some float32 keys differently)."""
    return family.prefill(params, config, prefix)


@functools.partial(jax.jit, static_argnames=("family",), donate_argnames=("carry",))
def _admit(carry: Carry, kv, slot, prompt_len, last, *, family: JaxFamily) -> Carry:
    """A request joins ``slot``: its prefilled keys and values (``kv``) into the slot, its
    lengths and the token it feeds first. Positions past the real prompt hold padding; a decode
    step overwrites each before any query reads it (a step writes its own position first and
    attends to no later one)."""
    return carry._replace(
        cache=family.write(carry.cache, kv, slot),
        prompt_len=carry.prompt_len.at[slot].set(prompt_len),
        total_len=carry.total_len.at[slot].set(prompt_len),
        last=carry.last.at[slot].set(last),
    )


@functools.partial(
    jax.jit, static_argnames=("family", "config", "sample", "mesh", "vocab_axis"), donate_argnames=("carry",)
)
def _step(
    params,
    tables: ReplayTables,
    idx_chunk,
    carry: Carry,
    key,
    temperature,
    *,
    family: JaxFamily,
    config,
    sample: bool,
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
    logits, cache = family.decode(params, config, carry.cache, carry.last, positions)
    noise = jax.random.gumbel(jax.random.fold_in(key, carry.t), logits.shape, jnp.float32) if sample else None
    if mesh is None:
        drawn = jnp.full(idx_mapping.shape, -1, jnp.int32)  # greedy: the argmax, chosen below
        if noise is not None:  # Gumbel-max over logits / temperature
            drawn = jnp.argmax(logits.astype(jnp.float32) / temperature + noise, axis=-1).astype(jnp.int32)
        sampled = replay(tables, drawn, idx_mapping, carry.total_len, carry.prompt_len)  # -1 rows stay -1
        logprobs, ranks, argmax = cast(tuple, token_logprob_rank(logits, sampled, argmax=True))
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


def free_bytes(device: Any) -> int | None:
    """Free bytes on a JAX ``device`` (``bytes_limit - bytes_in_use`` of its memory stats);
    ``None`` where the device reports none (the CPU): nothing is checked."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def placed_params(family: JaxFamily, config, weights: Mapping[str, np.ndarray], mesh: Mesh, vocab_axis: str, dtype):
    """The parameter pytree on ``mesh`` in ``dtype``: ``head`` (``[hidden, vocab]``) sharded
    along the vocabulary over ``vocab_axis``, everything else replicated. Copies; the caller's
    arrays are not changed."""
    host = family.params(config, weights, True)
    head = host.pop("head")
    params = jax.tree.map(lambda w: jax.device_put(w, NamedSharding(mesh, P())).astype(dtype), host)
    params["head"] = jax.device_put(head, NamedSharding(mesh, P(None, vocab_axis))).astype(dtype)
    return params


def decoder(family: JaxFamily) -> Callable[..., list[RequestResult]]:
    """The ``run_decode`` of ``family`` on this driver (see :func:`_run` for the contract)."""

    def run_decode(
        config: Any,
        weights: Mapping[str, np.ndarray],
        requests: Sequence[TraceRequest],
        *,
        device: str = "cpu",
        max_batch: int = 8,
        on_step: Callable[[int], None] | None = None,
        dtype: str = "float32",
        temperature: float = 0.0,
        seed: int = 0,
        mesh: Mesh | None = None,
        vocab_axis: str = "vocab",
    ) -> list[RequestResult]:
        return _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed,
                    mesh, vocab_axis)  # fmt: skip

    run_decode.__doc__ = _run.__doc__
    return run_decode


def _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed, mesh, vocab_axis):
    """Decode ``requests`` with the model ``config``/``weights``, replaying their traces.

    Arguments and results as in the torch driver's ``run_decode`` (the family contract of
    :mod:`trace_replay_app.models.family`), except the sampling noise: with ``temperature``
    above 0, untraced rows sample by Gumbel-max, the noise of step ``t`` drawn from
    ``jax.random.fold_in(jax.random.key(seed), t)`` (the same arguments give the same tokens,
    not the torch loop's). ``max_batch``: the most slots; the run uses ``min(max_batch,
    requests that decode)`` and buffers sized by the requests' real lengths (padded to
    power-of-two buckets). ``mesh``: run on the devices of a ``jax.sharding.Mesh`` instead of
    ``device`` (which must then be left at ``"cpu"``, its default), the logits sharded over
    ``vocab_axis`` (``vocab_size`` a multiple of its size; other axes hold replicas). Token ids
    are int32 on the device and int64 in the results. Nothing waits for the device between
    steps; outputs are copied to the host once at the end. Arguments are checked before
    anything runs (``TypeError`` / ``ValueError`` naming the argument); a run that would not fit
    in a device's free memory (where JAX reports it) raises
    :class:`~trace_replay_app.records.DeviceMemoryError` before anything is allocated there.
    """
    call = check_decode(
        config,
        weights,
        requests,
        max_batch=max_batch,
        on_step=on_step,
        dtype=dtype,
        temperature=temperature,
        seed=seed,
        config_type=family.config_type,
        check_weights=family.check_weights,
        device=device,
    )
    if mesh is None:
        devices = [resolve_device(device)]  # ValueError when JAX has no such device
    else:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None (got {type(mesh).__name__})")
        if device != "cpu":
            raise ValueError(f"device must be left at 'cpu' when a mesh is given (got device={device!r})")
        if vocab_axis not in mesh.axis_names:
            raise ValueError(f"vocab_axis must be one of the mesh's axes {mesh.axis_names} (got {vocab_axis!r})")
        shards = mesh.shape[vocab_axis]
        if config.vocab_size % shards:
            raise ValueError(
                f"config.vocab_size={config.vocab_size} does not split evenly over the {shards} devices "
                f"of vocab_axis {vocab_axis!r}"
            )
        devices = list(mesh.devices.flat)
    outputs = None
    if call.schedule.n_steps:
        jdtype = jnp.dtype(call.dtype)
        kv_len = bucket(call.kv_positions, config.n_positions)
        slots = call.schedule.slots
        cache = jax.eval_shape(lambda: family.new_cache(config, slots, kv_len, jdtype))
        needed = estimate_bytes(
            weights=weights,
            itemsize=jdtype.itemsize,
            cache_elements=sum(int(np.prod(a.shape)) for a in jax.tree.leaves(cache)),
            slots=slots,
            steps=min(call.schedule.n_steps, 2 * jax_chunks.CHUNK),  # the chunk being written and the one set aside
            vocab_size=config.vocab_size,
            longest_trace=bucket(call.longest_trace, config.n_positions),
            sampling=call.temperature > 0,
        )
        for dev in devices:  # the caller's name of its device, or each device of the mesh
            check_fits(device if mesh is None else str(dev), needed, free_bytes(dev))
        outputs = _decode_all(family, config, weights, call, devices[0], jdtype, kv_len, mesh, vocab_axis)
    return collect_results(requests, call.schedule, outputs)


def _decode_all(family: JaxFamily, config, weights, call: DecodeCall, dev, dtype, kv_len, mesh, vocab_axis):
    """Every step of ``call.schedule``; the per-step outputs ``[n_steps, slots]`` on the host."""
    rows = call.schedule.slots
    if mesh is None:
        put = functools.partial(jax.device_put, device=dev)
        params = jax.tree.map(lambda w: put(w).astype(dtype), family.params(config, weights, False))
        with jax.default_device(dev):
            cache = family.new_cache(config, rows, kv_len, dtype)
    else:
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, P()))
        params = placed_params(family, config, weights, mesh, vocab_axis, dtype)
        cache = put(family.new_cache(config, rows, kv_len, dtype))
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

    def admit(carry: Carry, slot: int, prompt) -> Carry:
        kv = _prefill(params, put(prompt_prefix(prompt, kv_len)), family=family, config=config)
        slot_len_last = put(np.int32(slot)), put(np.int32(len(prompt))), put(np.int32(prompt[-1]))
        return _admit(carry, kv, *slot_len_last, family=family)

    def step(carry: Carry, tables: ReplayTables, idx_chunk) -> Carry:
        return _step(params, tables, idx_chunk, carry, key, temp, family=family, config=config,
                     sample=call.temperature > 0, mesh=mesh, vocab_axis=vocab_axis)  # fmt: skip

    # The table's shape is part of the step program's signature: bucket its row length too.
    max_trace = bucket(call.longest_trace, config.n_positions)
    where = {"device": dev} if mesh is None else {"mesh": mesh}
    with TraceReplayState(rows, max_trace, vocab_size=config.vocab_size, **where) as state:
        return run_chunks(call.schedule, call.prompts, call.traces, state, carry, put=put, fetch=jax.device_get,
                          admit=admit, step=step, on_step=call.on_step)  # fmt: skip
