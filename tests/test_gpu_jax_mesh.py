"""GPU tier: the JAX adapter over a one-device mesh, and pinned host memory over DLPack.

- A state over a ``Mesh`` of the one GPU: views assembled into replicated global arrays,
  commits on the device's stream, replay under ``jax.jit`` and inside ``shard_map`` with both
  methods, against the reference.
- ``token_logprob_rank_sharded`` on that mesh against the unsharded function.
- Whether a host-mapped table's pinned memory reaches JAX without a copy when exported as
  pinned host memory (``kDLCUDAHost``), which JAX imports since 0.10.2 (into its
  ``pinned_host`` memory space).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jax_helpers import jax_gpu  # noqa: E402
from helpers.scenarios import make_scenario, reference_tokens  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trace_replay_jax as trj  # noqa: E402
from trace_replay_core import ArrayView  # noqa: E402
from trace_replay_jax import TraceReplayState  # noqa: E402

# Scenarios replay before applying staged writes on purpose: their StagedWritesWarning is expected.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::trace_replay_core.StagedWritesWarning")]


def _mesh(gpu) -> Mesh:
    return Mesh(np.array([gpu]).reshape(1, 1), ("batch", "vocab"))


@pytest.mark.parametrize("where", ["jit", "shard_map"])
@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_gpu_state_over_a_one_device_mesh(method, where, rng):
    gpu = jax_gpu()
    mesh = _mesh(gpu)
    rows, rep = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    sc = make_scenario(int(rng.integers(2**32)), max_slots=16, max_trace_len=32, batch=24, n_steps=60)

    def replay(t, s, i, tl, pl):
        return trj.replay(t, s, i, tl, pl, method=method)

    fn = jax.jit(
        replay
        if where == "jit"
        else jax.shard_map(replay, mesh=mesh, in_specs=(P(), P("batch"), P("batch"), P(), P()), out_specs=P("batch"))
    )
    got = []
    with TraceReplayState(sc.max_slots, sc.max_trace_len, mesh=mesh, vocab_size=sc.vocab_size) as state:
        assert state.tables.table.sharding.is_fully_replicated
        view, _ = state.table.device_views()
        assert state.tables.table.addressable_shards[0].data.unsafe_buffer_pointer() == view.ptr  # zero-copy
        for step in sc.steps:
            for op in step.ops:
                if op[0] == "stage":
                    state.add_request(op[1], op[2])
                elif op[0] == "clear":
                    state.remove_request(op[1])
                else:
                    state.apply_staged_writes()
            got.append(
                fn(
                    state.tables,
                    jax.device_put(step.sampled.astype(np.int32), rows),
                    jax.device_put(step.idx_mapping, rows),
                    jax.device_put(step.total_len, rep),
                    jax.device_put(step.prompt_len, rep),
                )
            )
        got = [np.asarray(g) for g in got]
    for t, (g, w) in enumerate(zip(got, reference_tokens(sc))):
        assert np.array_equal(g.astype(np.int64), w), f"step {t}: rows {np.nonzero(g != w)[0].tolist()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_sharded_logprob_on_a_one_device_mesh_equals_unsharded(dtype, rng):
    gpu = jax_gpu()
    mesh = _mesh(gpu)
    batch, vocab = 64, 32_000
    x = rng.normal(0, 4, (batch, vocab)).astype(np.float32)
    x[0, :100] = -np.inf
    ids = rng.integers(0, vocab, batch).astype(np.int32)
    ids[1], ids[2] = -1, vocab
    logits = jax.device_put(jnp.asarray(x).astype(getattr(jnp, dtype)), NamedSharding(mesh, P("batch", "vocab")))
    ids_dev = jax.device_put(ids, NamedSharding(mesh, P("batch")))
    lp, rank = trj.token_logprob_rank_sharded(logits, ids_dev, mesh=mesh, vocab_axis="vocab", batch_axis="batch")
    for method in ("jnp", "kernel"):
        want_lp, want_rank = trj.token_logprob_rank(
            jax.device_put(logits, gpu), jax.device_put(ids, gpu), method=method
        )
        np.testing.assert_array_equal(np.asarray(rank), np.asarray(want_rank), err_msg=method)
        np.testing.assert_allclose(
            np.asarray(lp), np.asarray(want_lp), rtol=2e-6, atol=2e-6, equal_nan=True, err_msg=method
        )
    same = (
        np.asarray(lp)[~np.isnan(np.asarray(lp))].tobytes()
        == np.asarray(want_lp)[~np.isnan(np.asarray(want_lp))].tobytes()
    )
    print(f"one-device mesh, {dtype}: bit-identical to the unsharded kernel: {same}")


class _PinnedHostView(ArrayView):
    """The same memory, exported over DLPack as pinned host memory (kDLCUDAHost) instead of as
    the device address the core's views use."""

    def __dlpack_device__(self):
        return (3, self.device_id)


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:3]) < (0, 10, 2),
    reason="JAX imports pinned host memory over DLPack from 0.10.2 on",
)
def test_gpu_pinned_host_memory_of_a_host_mapped_table_reaches_jax_without_a_copy(rng):
    """A host-mapped table is pinned host memory; its device address equals its host address
    (unified addressing). Exported as kDLCUDAHost, JAX 0.10.2+ makes it a ``pinned_host``
    array over the same bytes: later commits show through it, so it is not a copy."""
    gpu = jax_gpu()
    with TraceReplayState(8, 64, device=gpu, placement="host_mapped") as state:
        state.add_request(3, rng.integers(0, 1000, 40))
        state.apply_staged_writes()
        view, _ = state.table.device_views()
        pinned = _PinnedHostView(view.ptr, view.shape, view.strides, view.dtype, view.device_type, view.device_id)
        arr = jax.dlpack.from_dlpack(pinned, copy=False)
        kind = arr.sharding.memory_kind
        print(
            f"jax {jax.__version__}: pinned host import -> memory_kind={kind!r}, "
            f"same address: {arr.unsafe_buffer_pointer() == view.ptr}"
        )
        assert kind == "pinned_host", kind
        assert arr.unsafe_buffer_pointer() == view.ptr
        table, _ = state.snapshot()
        np.testing.assert_array_equal(np.asarray(arr), table)
        trace = rng.integers(0, 1000, 64)
        state.add_request(5, trace)
        state.apply_staged_writes()
        state.snapshot()  # the commit has landed
        np.testing.assert_array_equal(np.asarray(arr)[5], trace)  # seen through the same bytes
        del arr
