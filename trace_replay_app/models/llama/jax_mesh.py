"""The Llama-family JAX decode loop over a ``jax.sharding.Mesh``, the logits sharded over the vocabulary.

:func:`run_decode_mesh` runs :func:`.jax_loop.run_decode`'s schedule, model and jitted step
on the devices of ``mesh``: the output projection (``lm_head``, or a copy of the tied
embedding, ``[hidden, vocab]``) is sharded along the vocabulary over ``vocab_axis``, so each
device computes its block of columns of every row's logits; every other weight, the KV
caches, the per-slot lengths and the outputs are replicated. Inside the one jitted step:

- the greedy argmax (and the Gumbel-max draw when sampling, the same noise as the one-device
  loop: ``jax.random`` values do not depend on the sharding) over the sharded logits, in a
  ``shard_map``: each block's maximum and its position gathered and merged in block order
  (the first block holding the maximum wins, so ties go to the lowest id, as ``jnp.argmax``);
- replay with :func:`trace_replay_jax.replay` on the tables of a
  :class:`trace_replay_jax.TraceReplayState` over ``mesh`` (one table per device, replicated);
- logprob and rank with :func:`trace_replay_jax.token_logprob_rank_sharded` on the
  vocabulary-sharded logits (each block's maximum, sum of exponentials, count and chosen
  logit, merged in shard order), so only a few values per row cross devices.

Tokens equal the one-device loop's; logprobs agree with it to float32 rounding (only the
order of the sum of exponentials differs), ranks exactly. ``vocab_size`` must be a multiple of
the size of ``vocab_axis``.

Example (CPU with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` set before JAX starts)::

    import jax, numpy as np
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:2]), ("vocab",))
    results = run_decode_mesh(config, weights, requests, mesh=mesh)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_replay_jax import ReplayTables, TraceReplayState, replay, token_logprob_rank_sharded

from ...records import RequestResult, TraceRequest
from ...schedule import check_run, check_sampling, collect_results, plan
from ..decode_buffers import bucket, fresh_outputs, prompt_prefix, run_chunks
from .config import LlamaConfig, check_weights
from .jax_loop import _admit, _Carry, _decode, _params, _prefill

__all__ = ["run_decode_mesh", "placed_params"]


def _sharded_argmax(x, mesh: Mesh, vocab_axis: str):
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


@functools.partial(jax.jit, static_argnames=("config", "sample", "mesh", "vocab_axis"), donate_argnames=("carry",))
def _step(
    params,
    tables: ReplayTables,
    idx_chunk,
    carry: _Carry,
    key,
    temperature,
    *,
    config: LlamaConfig,
    sample: bool,
    mesh: Mesh,
    vocab_axis: str,
) -> _Carry:
    """:func:`.jax_loop._step` with the logits sharded over ``vocab_axis`` and the sharded
    logprob/rank."""
    k = carry.step
    idx_mapping = idx_chunk[k]
    active = idx_mapping >= 0
    positions = jnp.where(active, carry.total_len - 1, 0)
    logits, keys, values = _decode(params, config, carry, positions)
    by_vocab = NamedSharding(mesh, P(None, vocab_axis))
    logits = jax.lax.with_sharding_constraint(logits, by_vocab)
    argmax = _sharded_argmax(logits, mesh, vocab_axis)  # ties: the lowest id
    drawn = argmax
    if sample:  # the one-device loop's noise, sharded
        noise = jax.lax.with_sharding_constraint(
            jax.random.gumbel(jax.random.fold_in(key, carry.t), logits.shape, jnp.float32), by_vocab
        )
        drawn = _sharded_argmax(logits.astype(jnp.float32) / temperature + noise, mesh, vocab_axis)
    sampled = replay(tables, drawn, idx_mapping, carry.total_len, carry.prompt_len)
    logprobs, ranks = token_logprob_rank_sharded(logits, sampled, mesh=mesh, vocab_axis=vocab_axis)
    return _Carry(
        keys=keys,
        values=values,
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


def run_decode_mesh(
    config: LlamaConfig,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    *,
    mesh: Mesh,
    vocab_axis: str = "vocab",
    max_batch: int = 8,
    on_step: Callable[[int], None] | None = None,
    dtype: str = "float32",
    temperature: float = 0.0,
    seed: int = 0,
) -> list[RequestResult]:
    """Decode ``requests`` on the devices of ``mesh``, the logits sharded over ``vocab_axis``.

    Arguments and results as in :func:`.jax_loop.run_decode` (its sampling noise too), with
    ``mesh`` (a ``jax.sharding.Mesh`` of this process's devices) in place of ``device``;
    axes other than ``vocab_axis`` hold replicas. Each device holds every weight but its block
    of the output projection (copies of the caller's arrays, which are not changed). Nothing
    waits for the devices between steps; outputs are copied to the host once at the end.
    Arguments are checked before anything runs (``TypeError`` / ``ValueError`` naming the
    argument); a rejected call does nothing.
    """
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=LlamaConfig, check_weights=check_weights
    )
    temperature = check_sampling(dtype, temperature, seed)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (got {type(mesh).__name__})")
    if vocab_axis not in mesh.axis_names:
        raise ValueError(f"vocab_axis must be one of the mesh's axes {mesh.axis_names} (got {vocab_axis!r})")
    shards = mesh.shape[vocab_axis]
    if config.vocab_size % shards:
        raise ValueError(
            f"config.vocab_size={config.vocab_size} does not split evenly over the {shards} devices "
            f"of vocab_axis {vocab_axis!r}"
        )
    schedule = plan([r.new_tokens for r in requests], max_batch)
    outputs = None
    if schedule.n_steps:
        outputs = _decode_all(
            config,
            weights,
            prompts,
            traces,
            schedule,
            mesh,
            vocab_axis,
            on_step,
            getattr(jnp, dtype),
            temperature,
            seed,
        )
    return collect_results(requests, schedule, outputs)


def placed_params(config: LlamaConfig, weights: Mapping[str, np.ndarray], mesh: Mesh, vocab_axis: str, dtype):
    """The loop's parameter pytree on ``mesh`` in ``dtype``: ``head`` (``[hidden, vocab]``, the
    tied embedding's transpose when tied) sharded along the vocabulary over ``vocab_axis``,
    everything else replicated. Copies; the caller's arrays are not changed."""
    host = _params(config, weights)
    head = host.pop("head", None)
    if head is None:  # tied: a vocabulary-sharded copy of the embedding
        head = np.ascontiguousarray(host["embed"].T)
    params = jax.tree.map(lambda w: jax.device_put(w, NamedSharding(mesh, P())).astype(dtype), host)
    params["head"] = jax.device_put(head, NamedSharding(mesh, P(None, vocab_axis))).astype(dtype)
    return params


def _decode_all(
    config, weights, prompts, traces, schedule, mesh, vocab_axis, on_step, dtype, temperature, seed
) -> dict[str, np.ndarray]:
    """Run every step of ``schedule`` on ``mesh``; the per-step outputs ``[n_steps, max_batch]`` on the host."""
    c = config
    rows = schedule.max_batch
    kv_len = bucket(schedule.kv_positions([len(p) for p in prompts]), c.n_positions)
    everywhere = NamedSharding(mesh, P())
    put = functools.partial(jax.device_put, device=everywhere)
    params = placed_params(c, weights, mesh, vocab_axis, dtype)
    key = put(jax.random.key(seed))
    temp = put(np.float32(temperature if temperature > 0 else 1.0))
    cache_shape = (rows, c.num_key_value_heads, kv_len, c.head_dim)
    empty = [jnp.zeros(cache_shape, dtype, device=everywhere) for _ in range(2 * c.num_hidden_layers)]
    carry = _Carry(
        keys=tuple(empty[: c.num_hidden_layers]),
        values=tuple(empty[c.num_hidden_layers :]),
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

    def admit(carry: _Carry, slot: int, prompt) -> _Carry:
        kv = _prefill(params, put(prompt_prefix(prompt, kv_len)), config=c)
        return _admit(carry, kv, put(np.int32(slot)), put(np.int32(len(prompt))), put(np.int32(prompt[-1])))

    def step(carry: _Carry, tables, idx_chunk) -> _Carry:
        return _step(
            params,
            tables,
            idx_chunk,
            carry,
            key,
            temp,
            config=c,
            sample=temperature > 0,
            mesh=mesh,
            vocab_axis=vocab_axis,
        )

    max_trace = bucket(max((len(t) for t in traces if t is not None), default=1), c.n_positions)
    with TraceReplayState(rows, max_trace, mesh=mesh, vocab_size=c.vocab_size) as state:
        return run_chunks(
            schedule,
            prompts,
            traces,
            state,
            carry,
            put=put,
            fetch=jax.device_get,
            admit=admit,
            step=step,
            on_step=on_step,
        )
