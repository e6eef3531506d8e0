"""Mesh cases on 8 CPU host devices, run by ``test_jax_mesh.py`` in a subprocess.

JAX fixes its CPU device count when it is first imported, so these run in a process of their
own started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and
``JAX_PLATFORMS=cpu`` (the rest of the suite keeps its one CPU device). Run them directly with::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m pytest -q -p no:cacheprovider tests/jax_mesh_cases.py

Meshes 1x8 and 2x4 (batch x vocabulary): a state over the mesh (one core table per device,
replicated tables), replay under ``jax.jit`` on batch-sharded arrays and inside ``shard_map``
with both methods, and ``token_logprob_rank`` on vocabulary-sharded logits against the
unsharded result.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.replay_oracle import scenario_tokens
from helpers.scenarios import make_scenario
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import trace_replay_jax as trj
from trace_replay_core import token_logprob_rank_reference
from trace_replay_jax.sharded import token_logprob_rank_in_shard_map, token_logprob_rank_sharded

# The scenarios stage writes and replay before applying them on purpose (the reference
# replays the traces of the last apply): the StagedWritesWarning that gives is expected here.
pytestmark = pytest.mark.filterwarnings("ignore::trace_replay_core.StagedWritesWarning")

DEVICES = 8
if len(jax.devices("cpu")) < DEVICES:
    pytest.skip(
        f"needs {DEVICES} CPU host devices: run through tests/test_jax_mesh.py (it sets "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX starts)",
        allow_module_level=True,
    )

SHAPES = [(1, 8), (2, 4)]  # batch x vocabulary
METHODS = ("jnp", "kernel")


def _mesh(shape) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[: shape[0] * shape[1]]).reshape(shape), ("batch", "vocab"))


def _seed(rng) -> int:
    return int(rng.integers(2**32))


def _ops(state, step) -> None:
    for op in step.ops:
        if op[0] == "stage":
            state.add_request(op[1], op[2])
        elif op[0] == "clear":
            state.remove_request(op[1])
        else:
            state.apply_staged_writes()


def _same_bits(a, b) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (XLA may set a NaN's sign bit)."""
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a)
    return bool((nan == np.isnan(b)).all()) and a[~nan].tobytes() == b[~nan].tobytes()


def _compare(name, got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g).reshape(-1).astype(np.int64)
        bad = np.nonzero(g != w)[0]
        assert bad.size == 0, f"{name}: step {t} rows {bad.tolist()}: got {g[bad].tolist()}, want {w[bad].tolist()}"


# -- the state over a mesh ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_state_keeps_one_table_per_device_and_replicated_tables(shape, rng):
    mesh = _mesh(shape)
    traces = {int(s): rng.integers(0, 1000, int(rng.integers(1, 9))) for s in rng.choice(12, 5, replace=False)}
    with trj.TraceReplayState(12, 8, mesh=mesh) as state:
        assert state.device is None and state.mesh is mesh and len(state.devices) == DEVICES
        for slot, trace in traces.items():
            state.add_request(slot, trace)
        state.apply_staged_writes()
        want = np.zeros((12, 8), np.int32)
        lens = np.zeros(12, np.int32)
        for slot, trace in traces.items():
            want[slot, : len(trace)] = trace
            lens[slot] = len(trace)
        tables = state.tables
        for arr, ref in ((tables.table, want), (tables.trace_len, lens)):
            assert arr.sharding.is_fully_replicated and arr.sharding.mesh == mesh
            assert {s.device for s in arr.addressable_shards} == set(mesh.devices.flat)
            for s in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), ref)
        # Each device's shard comes from its own core table: no two shards share memory.
        assert len({s.data.unsafe_buffer_pointer() for s in tables.table.addressable_shards}) == DEVICES
        slot = next(iter(traces))
        state.remove_request(slot)
        state.apply_staged_writes()
        assert state.tables is not tables  # the CPU hands out fresh copies
        for s in state.tables.trace_len.addressable_shards:
            assert int(np.asarray(s.data)[slot]) == 0
        for s in tables.trace_len.addressable_shards:  # arrays already handed out are unchanged
            assert int(np.asarray(s.data)[slot]) == len(traces[slot])


def _run(state, sc, mesh, per_row: bool, method: str, where: str) -> list[np.ndarray]:
    rows = NamedSharding(mesh, P("batch"))
    rep = NamedSharding(mesh, P())

    def replay(t, s, i, a, b):
        if per_row:
            return trj.replay_at_step(t, s, i, a, method=method)
        return trj.replay(t, s, i, a, b, method=method)

    if where == "jit":
        fn = jax.jit(replay)
    else:
        fn = jax.jit(
            jax.shard_map(
                replay,
                mesh=mesh,
                in_specs=(P(), P("batch"), P("batch"), P("batch") if per_row else P(), P()),
                out_specs=P("batch"),
            )
        )
    out = []
    for step in sc.steps:
        _ops(state, step)
        first = jax.device_put(step.step if per_row else step.total_len, rows if per_row else rep)
        res = fn(
            state.tables,
            jax.device_put(step.sampled.astype(np.int32), rows),
            jax.device_put(step.idx_mapping, rows),
            first,
            jax.device_put(step.prompt_len, rep),
        )
        if where == "shard_map" or method == "jnp":
            assert res.sharding.is_equivalent_to(rows, 1), res.sharding
        out.append(np.asarray(res))
    return out


@pytest.mark.parametrize("where", ["jit", "shard_map"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_replay_on_batch_sharded_arrays_matches_the_reference(shape, method, where, rng):
    mesh = _mesh(shape)
    sc = make_scenario(_seed(rng), max_slots=12, max_trace_len=24, batch=16, n_steps=40)
    for per_row in (False, True):
        with trj.TraceReplayState(sc.max_slots, sc.max_trace_len, mesh=mesh, vocab_size=sc.vocab_size) as state:
            got = _run(state, sc, mesh, per_row, method, where)
        _compare(f"{shape} {method} {where} per_row={per_row} ({sc.describe()})", got, scenario_tokens(sc, per_row))


def test_mesh_refusals():
    mesh = _mesh((2, 4))
    with pytest.raises(ValueError, match=r"^give device or mesh, not both \(got device='cpu' and a mesh\)$"):
        trj.TraceReplayState(4, 4, device="cpu", mesh=mesh)
    with pytest.raises(TypeError, match=r"^mesh must be a jax\.sharding\.Mesh \(got list\)$"):
        trj.TraceReplayState(4, 4, mesh=[0, 1])
    lg = jnp.zeros((4, 30))
    with pytest.raises(
        ValueError,
        match=r"^logits has 30 columns, which 4 shards of vocab_axis 'vocab' do not "
        r"split evenly: pad the vocabulary to a multiple of 4$",
    ):
        token_logprob_rank_sharded(lg, jnp.zeros(4, jnp.int32), mesh=mesh, vocab_axis="vocab")
    with pytest.raises(
        ValueError,
        match=r"^vocab_axis must be one of the mesh's axes \('batch', 'vocab'\) "
        r"\(got 'model'\)$",
    ):
        token_logprob_rank_sharded(lg, jnp.zeros(4, jnp.int32), mesh=mesh, vocab_axis="model")


def test_close_deletes_every_copy_of_the_tables_over_a_mesh():
    """Each apply on a CPU mesh hands out new global tables; closing deletes all of them."""
    state = trj.TraceReplayState(4, 6, mesh=_mesh((2, 4)))
    handed_out = []
    for trace in ([1, 2, 3], [4, 5]):
        state.add_request(1, trace)
        state.apply_staged_writes()
        handed_out.append(state.tables)
    state.close()
    for tables in handed_out:
        assert tables.table.is_deleted() and tables.trace_len.is_deleted()


# -- vocabulary-sharded logprob ----------------------------------------------------------------
def _logits(rng, batch: int, vocab: int, dtype) -> jax.Array:
    x = rng.normal(0, 3, (batch, vocab)).astype(np.float32)
    x[0, rng.integers(vocab, size=vocab // 4)] = -np.inf  # -inf entries are fine
    x[1, :] = np.round(x[1, :])  # many ties
    x[2, 5] = np.nan  # a NaN row: logprob NaN
    x[3, :] = -np.inf  # only -inf: logprob NaN
    return jnp.asarray(x).astype(dtype)


def _ids(rng, batch: int, vocab: int) -> np.ndarray:
    ids = rng.integers(0, vocab, batch).astype(np.int32)
    ids[4], ids[5] = -1, vocab  # outside the vocabulary
    ids[6] = vocab - 1  # the last column (last shard)
    return ids


# Each case compiles four programs (~2 s each on a CPU runner): one dtype per mesh.
@pytest.mark.parametrize(
    "shape, dtype", [((1, 8), "float32"), ((2, 4), "bfloat16")], ids=["1x8-float32", "2x4-bfloat16"]
)
def test_vocab_sharded_logprob_equals_the_unsharded_result(shape, dtype, rng):
    mesh = _mesh(shape)
    batch, vocab = 10, 4 * 8 * 37
    logits = _logits(rng, batch, vocab, getattr(jnp, dtype))
    ids = _ids(rng, batch, vocab)
    sharded = jax.device_put(logits, NamedSharding(mesh, P("batch", "vocab")))
    ids_dev = jax.device_put(ids, NamedSharding(mesh, P("batch")))
    got_lp, got_rank = token_logprob_rank_sharded(sharded, ids_dev, mesh=mesh, vocab_axis="vocab", batch_axis="batch")
    assert got_lp.dtype == jnp.float32 and got_rank.dtype == jnp.int32
    want_lp, want_rank = trj.token_logprob_rank(logits, ids, method="jnp")
    ref_lp, ref_rank = token_logprob_rank_reference(np.asarray(logits.astype(jnp.float32)), ids)
    np.testing.assert_array_equal(np.asarray(got_rank), np.asarray(want_rank))
    np.testing.assert_array_equal(np.asarray(got_rank), ref_rank)
    got_lp, want_lp = np.asarray(got_lp), np.asarray(want_lp)
    np.testing.assert_array_equal(np.isnan(got_lp), np.isnan(want_lp))
    np.testing.assert_array_equal(np.isnan(got_lp), np.isnan(ref_lp))
    np.testing.assert_allclose(got_lp, want_lp, rtol=2e-6, atol=2e-6, equal_nan=True)  # float32 rounding only
    np.testing.assert_allclose(got_lp, ref_lp, rtol=1e-5, atol=1e-5, equal_nan=True)
    # Same bits inside jit, inside a caller's shard_map, and again.
    in_jit = jax.jit(
        lambda lg, i: token_logprob_rank_sharded(lg, i, mesh=mesh, vocab_axis="vocab", batch_axis="batch")
    )(sharded, ids_dev)
    own = jax.jit(
        jax.shard_map(
            lambda lg, i: token_logprob_rank_in_shard_map(lg, i, vocab_axis="vocab"),
            mesh=mesh,
            in_specs=(P("batch", "vocab"), P("batch")),
            out_specs=(P("batch"), P("batch")),
            check_vma=False,
        )
    )(sharded, ids_dev)
    for lp, rank in (in_jit, own):
        assert _same_bits(lp, got_lp)
        assert np.asarray(rank).tobytes() == np.asarray(got_rank).tobytes()


def test_vocab_sharded_bits_do_not_depend_on_the_batch_sharding(rng):
    """2x4 and 1x4 split the vocabulary alike: every row gets the same bits either way, and the
    same bits as the row alone."""
    batch, vocab = 12, 4 * 64
    logits = _logits(rng, batch, vocab, jnp.float32)
    ids = _ids(rng, batch, vocab)
    results = []
    for shape in ((2, 4), (1, 4)):
        mesh = _mesh(shape)
        lp, rank = token_logprob_rank_sharded(
            jax.device_put(logits, NamedSharding(mesh, P("batch", "vocab"))),
            jax.device_put(ids, NamedSharding(mesh, P("batch"))),
            mesh=mesh,
            vocab_axis="vocab",
            batch_axis="batch",
        )
        results.append((np.asarray(lp), np.asarray(rank)))
    assert _same_bits(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    mesh = _mesh((1, 4))
    for b in (0, 7):
        lp, _ = token_logprob_rank_sharded(logits[b : b + 1], ids[b : b + 1], mesh=mesh, vocab_axis="vocab")
        assert _same_bits(lp, results[1][0][b : b + 1]), f"row {b} alone differs"


if __name__ == "__main__":
    raise SystemExit(pytest.main(["-q", "-p", "no:cacheprovider", os.path.abspath(__file__)]))
