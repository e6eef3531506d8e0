"""trace_replay_jax: trace replay for JAX decode loops, eager or inside ``jax.jit``.

Example (runs on the CPU; on a GPU leave ``device`` out or pass ``"cuda"``)::

    import jax
    import jax.numpy as jnp
    import trace_replay_jax
    from trace_replay_jax import TraceReplayState

    total_len = jnp.array([4, 0, 11, 0], dtype=jnp.int32)    # per slot: prompt + outputs
    prompt_len = jnp.array([4, 0, 10, 0], dtype=jnp.int32)
    idx_mapping = jnp.array([2, 0], dtype=jnp.int32)         # batch row -> slot
    sampled = jnp.array([9, 9], dtype=jnp.int32)             # what the sampler drew

    with TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(2, [5, 6, 7])                      # slot 2 replays this trace
        state.apply_staged_writes()
        out = state.replay(sampled, idx_mapping, total_len, prompt_len)
        assert out.tolist() == [6, 9]                        # slot 2 is at step 1 of its trace
        assert sampled.tolist() == [9, 9]                    # a new array: the input is unchanged

        @jax.jit
        def step(tables, sampled, total_len):                # inside jit: pass the tables in
            return trace_replay_jax.replay(tables, sampled, idx_mapping, total_len, prompt_len)

        assert step(state.tables, sampled, total_len + 1).tolist() == [7, 9]

Public names: :class:`TraceReplayState` (the state: requests, staged writes, eager replay;
on one device or over a ``jax.sharding.Mesh``), :func:`replay` and :func:`replay_at_step`
(replay given the tables; eager, traced or inside ``shard_map``; ``method="jnp"`` or
``"kernel"``), :class:`ReplayTables` (the committed table as JAX arrays, a pytree),
:func:`token_logprob_rank` (logprob and rank of the chosen token from the unmodified logits,
one read of the logits; with ``argmax=True`` also each row's greedy token, and rows with id -1
scored as it; with ``entropy=True`` each row's entropy) and its results :class:`LogprobRank`,
:class:`LogprobRankTopK`, :class:`LogprobRankArgmax`, :class:`LogprobRankTopKArgmax` and their
``...Entropy`` forms (pytrees),
:func:`token_logprob_rank_sharded` and
:func:`token_logprob_rank_in_shard_map` (the same on logits sharded over a vocabulary axis),
:func:`resolve_device` (the ``jax.Device`` a ``device=`` argument names),
:class:`StagedWritesWarning` (a replay, or a read of ``state.tables``, while writes are staged
but not applied; ``TraceReplayState(strict=True)`` raises instead).

Importing this package loads neither torch nor jax-triton, and changes no environment
variable.
"""

from trace_replay_core import StagedWritesWarning

from .devices import resolve_device
from .jnp_replay import ReplayTables, replay, replay_at_step
from .logprob import (
    LogprobRank,
    LogprobRankArgmax,
    LogprobRankArgmaxEntropy,
    LogprobRankEntropy,
    LogprobRankTopK,
    LogprobRankTopKArgmax,
    LogprobRankTopKArgmaxEntropy,
    LogprobRankTopKEntropy,
    token_logprob_rank,
)
from .sharded import token_logprob_rank_in_shard_map, token_logprob_rank_sharded
from .state import TraceReplayState

__all__ = [
    "TraceReplayState",
    "StagedWritesWarning",
    "ReplayTables",
    "replay",
    "replay_at_step",
    "token_logprob_rank",
    "LogprobRank",
    "LogprobRankTopK",
    "LogprobRankArgmax",
    "LogprobRankTopKArgmax",
    "LogprobRankEntropy",
    "LogprobRankTopKEntropy",
    "LogprobRankArgmaxEntropy",
    "LogprobRankTopKArgmaxEntropy",
    "token_logprob_rank_sharded",
    "token_logprob_rank_in_shard_map",
    "resolve_device",
]
