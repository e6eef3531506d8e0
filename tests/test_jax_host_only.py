"""Host-only methods of the JAX state refuse to run under a JAX trace, naming the fix.

Before this refusal, ``apply_staged_writes()`` inside ``jax.jit`` on the CPU, with something
staged, stored a tracer in ``state.tables`` and every later replay failed. Each case runs the
method inside a traced function (jit, a lax loop, vmap, grad, shard_map), checks the message,
and checks that nothing changed: the staged trace is still pending, ``tables`` is the same
object with the same contents, and a later apply and replay work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import trace_replay_jax as trj  # noqa: E402
from trace_replay_jax import TraceReplayState  # noqa: E402

# Each case keeps a write staged, not applied, on purpose (to show that a refusal leaves it so)
# and reads state.tables meanwhile: the StagedWritesWarning that read gives is expected here.
pytestmark = pytest.mark.filterwarnings("ignore::trace_replay_core.StagedWritesWarning")

X = jnp.ones(2, jnp.float32)


def _jit(fn):
    return lambda: jax.jit(lambda x: (fn(), x)[1])(X)


def _loop(fn):
    return lambda: jax.jit(lambda x: jax.lax.fori_loop(0, 2, lambda k, c: (fn(), c)[1], x))(X)


def _vmap(fn):
    return lambda: jax.vmap(lambda x: (fn(), x)[1])(X)


def _grad(fn):
    return lambda: jax.grad(lambda x: (fn(), x.sum())[1])(X)


def _shard_map(fn):
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("batch",))
    P = jax.sharding.PartitionSpec
    return lambda: jax.shard_map(lambda x: (fn(), x)[1], mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))(X)


# Errors raised while JAX traces carry JAX's traceback note after the message: the patterns end
# at the message's end or at a line break.
WRAPPERS = {"jit": _jit, "fori_loop": _loop, "vmap": _vmap, "grad": _grad, "shard_map": _shard_map}

_UNDER = (
    r" is host-only and cannot run inside jax\.jit, lax loops, vmap, grad or shard_map \(it was called while "
    r"JAX was tracing\): "
)
CALLS = {
    "apply_staged_writes": (
        lambda st: st.apply_staged_writes(),
        r"^state\.apply_staged_writes\(\)"
        + _UNDER
        + r"call it between jitted calls, on the host, and pass state\.tables into the next "
        r"jitted call as an argument(?=\n|$)",
    ),
    "add_request": (
        lambda st: st.add_request(3, [1, 2]),
        r"^state\.add_request\(\)" + _UNDER + r"call it between jitted calls, on the host(?=\n|$)",
    ),
    "add_request-none": (lambda st: st.add_request(3, None), r"^state\.add_request\(\)" + _UNDER),
    "add_requests": (lambda st: st.add_requests([3], np.ones((1, 2), np.int32)), r"^state\.add_requests\(\)" + _UNDER),
    "remove_request": (lambda st: st.remove_request(1), r"^state\.remove_request\(\)" + _UNDER),
    "snapshot": (
        lambda st: st.snapshot(),
        r"^state\.snapshot\(\)"
        + _UNDER
        + r"call it outside the traced function \(it waits for the device and copies to the host\)(?=\n|$)",
    ),
    "pending": (
        lambda st: st.pending,
        r"^state\.pending" + _UNDER + r"read it between jitted calls, on the host(?=\n|$)",
    ),
    "close": (
        lambda st: st.close(),
        r"^state\.close\(\)" + _UNDER + r"close the state outside the traced function, after its last use(?=\n|$)",
    ),
    "construct": (
        lambda st: TraceReplayState(4, 4, device="cpu"),
        r"^TraceReplayState\(\)"
        + _UNDER
        + r"create the state outside the traced function and pass state\.tables in as an argument(?=\n|$)",
    ),
}


@pytest.mark.parametrize("where", sorted(WRAPPERS))
@pytest.mark.parametrize("case", sorted(CALLS))
def test_host_only_methods_are_refused_under_a_trace_and_change_nothing(case, where, rng):
    call, pattern = CALLS[case]
    trace = rng.integers(0, 1000, 5).astype(np.int32)
    with TraceReplayState(8, 8, device="cpu") as state:
        state.add_request(1, [5, 6, 7])
        state.apply_staged_writes()
        state.add_request(2, trace)  # staged, not applied
        tables = state.tables
        before = [np.asarray(x).copy() for x in (tables.table, tables.trace_len)]
        with pytest.raises(RuntimeError, match=pattern):
            WRAPPERS[where](lambda: call(state))()
        assert not state.closed
        assert state.pending == 1
        assert state.tables is tables
        assert not isinstance(state.tables.table, jax.core.Tracer)
        for x, b in zip((tables.table, tables.trace_len), before):
            np.testing.assert_array_equal(np.asarray(x), b)
        state.apply_staged_writes()
        out = state.replay(
            jnp.full(3, -7, jnp.int32),
            jnp.array([1, 2, 0], jnp.int32),
            jnp.array([0, 1, 4, 0, 0, 0, 0, 0], jnp.int32),
            jnp.zeros(8, jnp.int32),
        )
        assert np.asarray(out).tolist() == [6, int(trace[4]), -7]


def test_the_staged_apply_inside_jit_no_longer_puts_a_tracer_into_tables():
    """The reported case: on the CPU, with something staged, an apply inside jit."""
    with TraceReplayState(4, 4, device="cpu") as state:
        state.add_request(0, [9, 8])

        @jax.jit
        def step(tables, sampled):
            state.apply_staged_writes()
            return trj.replay(
                tables, sampled, jnp.array([0], jnp.int32), jnp.array([1, 0, 0, 0], jnp.int32), jnp.zeros(4, jnp.int32)
            )

        with pytest.raises(RuntimeError, match=r"^state\.apply_staged_writes\(\) is host-only"):
            step(state.tables, jnp.zeros(1, jnp.int32))
        assert not isinstance(state.tables.table, jax.core.Tracer)
        state.apply_staged_writes()
        idx, total, prompt = jnp.array([0], jnp.int32), jnp.array([1, 0, 0, 0], jnp.int32), jnp.zeros(4, jnp.int32)
        replay = jax.jit(lambda tables, sampled: trj.replay(tables, sampled, idx, total, prompt))
        assert np.asarray(replay(state.tables, jnp.zeros(1, jnp.int32))).tolist() == [8]


def test_host_only_methods_still_work_from_a_callback_thread_and_at_top_level():
    """The check is per thread: JAX traces on the caller's thread only."""
    import threading

    errors = []
    with TraceReplayState(4, 4, device="cpu") as state:

        def worker():
            try:
                state.add_request(1, [4, 4])
                state.apply_staged_writes()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert not errors, errors
        assert state.snapshot()[1].tolist() == [0, 2, 0, 0]
