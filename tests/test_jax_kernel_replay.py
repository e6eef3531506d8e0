"""``replay(..., method="kernel")``: the core's replay kernel run by XLA through a buffer callback.

CPU tier: the kernel method is really a callback (it shows in the jaxpr), gives the jnp
method's tokens on random inputs of every size and dtype, never changes ``sampled``, works in
loops, and refuses what the jnp method refuses. GPU tier: the Triton kernel on XLA's stream
stays correct when every call brings new input addresses, when the same addresses come back
with the table written in between (the case where command buffers replay a recorded launch),
inside ``lax.fori_loop``, and with command buffers forced on for custom calls (a subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jax_helpers import jax_gpu, x64
from helpers.replay_oracle import expected_replay

import trace_replay_jax as trj
from trace_replay_jax import TraceReplayState

COMMAND_BUFFER_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL "
    "--xla_gpu_graph_min_graph_size=1"
)


def _state_with_traces(rng, device, max_slots=16, max_len=12, vocab=5000):
    """A state with traces on half its slots; returns (state, slot -> trace)."""
    state = TraceReplayState(max_slots, max_len, device=device, vocab_size=vocab)
    traces = {}
    for slot in rng.choice(max_slots, max_slots // 2, replace=False):
        traces[int(slot)] = rng.integers(0, vocab, int(rng.integers(1, max_len + 1)))
        state.add_request(int(slot), traces[int(slot)])
    state.apply_staged_writes()
    return state, traces


def _inputs(rng, batch, max_slots, max_len, token_dtype=np.int32, index_dtype=np.int32):
    sampled = rng.integers(0, 5000, batch).astype(token_dtype)
    idx = rng.integers(-1, max_slots + 1, batch).astype(index_dtype)
    prompt = rng.integers(0, 20, max_slots).astype(index_dtype)
    total = (prompt + rng.integers(-2, max_len + 2, max_slots)).astype(index_dtype)
    step = rng.integers(-2, max_len + 2, batch).astype(index_dtype)
    return sampled, idx, total, prompt, step


def _want(traces, sampled, idx, total, prompt, step=None):
    """The expected tokens from the traces the test staged (not from the library's numpy replay,
    which the kernel method runs on the CPU)."""
    if step is not None:
        return expected_replay(sampled, idx, traces, step=step)
    return expected_replay(sampled, idx, traces, total, prompt)


# -- CPU tier -------------------------------------------------------------------------------------
def test_the_kernel_method_is_a_buffer_callback_and_the_jnp_method_is_not():
    with TraceReplayState(4, 4, device="cpu") as state:
        args = (jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
        for method, present in (("kernel", True), ("jnp", False)):
            jaxpr = str(jax.make_jaxpr(lambda t, *a, m=method: trj.replay(t, *a, method=m))(state.tables, *args))
            assert ("buffer_callback" in jaxpr) == present, jaxpr


@pytest.mark.parametrize("batch", [1, 5, 100, 1024])
def test_kernel_method_equals_jnp_and_the_reference(batch, rng):
    cpu = jax.devices("cpu")[0]
    state, traces = _state_with_traces(rng, cpu)
    with state:
        sampled, idx, total, prompt, step = _inputs(rng, batch, state.max_slots, state.max_trace_len)
        # Random lengths may leave every traced slot outside its trace: put one traced slot at
        # step 0 in row 0 (per slot and per row), with a sampled token its trace replaces.
        slot = min(traces)
        total[slot], idx[0], step[0], sampled[0] = prompt[slot], slot, 0, (traces[slot][0] + 1) % 5000
        args = [jnp.asarray(a) for a in (sampled, idx, total, prompt)]
        got = {m: np.asarray(trj.replay(state.tables, *args, method=m)) for m in trj.jnp_replay.METHODS}
        want = _want(traces, sampled, idx, total, prompt)
        for m, g in got.items():
            np.testing.assert_array_equal(g, want, err_msg=m)
        rows = {
            m: np.asarray(state.replay_at_step(args[0], args[1], jnp.asarray(step), method=m))
            for m in trj.jnp_replay.METHODS
        }
        want_rows = _want(traces, sampled, idx, total, prompt, step)
        for m, g in rows.items():
            np.testing.assert_array_equal(g, want_rows, err_msg=m)
        assert want[0] != sampled[0] and want_rows[0] != sampled[0]  # row 0 is replaced
        if batch >= 100:  # rows left alone occur too (small batches may have one kind)
            assert (want == sampled).any()


@pytest.mark.parametrize("token_dtype, index_dtype", [(np.int64, np.int32), (np.int32, np.int64), (np.int64, np.int64)])
def test_kernel_method_with_int64_under_x64(token_dtype, index_dtype, rng):
    with x64(True):
        state, traces = _state_with_traces(rng, "cpu")
        with state:
            sampled, idx, total, prompt, _ = _inputs(
                rng, 37, state.max_slots, state.max_trace_len, token_dtype, index_dtype
            )
            slot = min(traces)  # row 0: a traced slot at its step 0, with a token above int32
            total[slot], idx[0], sampled[0] = prompt[slot], slot, 2**40 if token_dtype == np.int64 else 2**30
            out = jax.jit(lambda t, *a: trj.replay(t, *a, method="kernel"))(
                state.tables, *(jnp.asarray(a) for a in (sampled[:, None], idx, total, prompt))
            )
            assert out.dtype == token_dtype and out.shape == (37, 1)
            want = _want(traces, sampled, idx, total, prompt)
            np.testing.assert_array_equal(np.asarray(out)[:, 0], want)
            assert want[0] == traces[slot][0]


def test_kernel_method_never_changes_sampled_and_handles_an_empty_batch(rng):
    state, traces = _state_with_traces(rng, "cpu")
    with state:
        sampled, idx, total, prompt, _ = _inputs(rng, 64, state.max_slots, state.max_trace_len)
        slot = min(traces)  # row 0 is replaced whatever the draw
        total[slot], idx[0], sampled[0] = prompt[slot], slot, (traces[slot][0] + 1) % 5000
        s = jnp.asarray(sampled)

        @jax.jit
        def both(t, s, i, tl, pl):  # sampled is still needed after the replay: XLA copies it
            return trj.replay(t, s, i, tl, pl, method="kernel"), s + 0

        out, kept = both(state.tables, s, *(jnp.asarray(a) for a in (idx, total, prompt)))
        np.testing.assert_array_equal(np.asarray(kept), sampled)
        np.testing.assert_array_equal(np.asarray(s), sampled)
        want = _want(traces, sampled, idx, total, prompt)
        np.testing.assert_array_equal(np.asarray(out), want)
        assert want[0] != sampled[0]
        empty = state.replay(
            jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32), jnp.asarray(total), jnp.asarray(prompt), method="kernel"
        )
        assert empty.shape == (0,)


def test_kernel_method_inside_fori_loop_with_the_table_written_between_calls(rng):
    state, traces = _state_with_traces(rng, "cpu")
    with state:
        steps, batch = 5, 24
        sampled = rng.integers(0, 5000, (steps, batch)).astype(np.int32)
        idx = rng.integers(-1, state.max_slots, (steps, batch)).astype(np.int32)
        prompt = rng.integers(0, 5, state.max_slots).astype(np.int32)
        idx[:, 0] = min(traces)  # row 0 of each step: a traced slot, at steps 0..4 of its trace
        prompt[min(traces)] = 0
        forced = 0

        @jax.jit
        def loop(tables, s, i, prompt):
            def body(k, acc):
                total = prompt + k
                return acc.at[k].set(trj.replay(tables, s[k], i[k], total, prompt, method="kernel"))

            return jax.lax.fori_loop(0, steps, body, jnp.zeros_like(s))

        for call in range(3):
            out = np.asarray(loop(state.tables, jnp.asarray(sampled), jnp.asarray(idx), jnp.asarray(prompt)))
            for k in range(steps):
                want = _want(traces, sampled[k], idx[k], prompt + k, prompt)
                np.testing.assert_array_equal(out[k], want, err_msg=f"call {call} step {k}")
                forced += int((want != sampled[k]).sum())
            slot = int(rng.integers(state.max_slots))
            traces[slot] = rng.integers(0, 5000, state.max_trace_len)
            state.add_request(slot, traces[slot])
            state.apply_staged_writes()
        assert forced > 0


def test_kernel_method_refusals():
    with TraceReplayState(4, 4, device="cpu") as state:
        args = (jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
        with pytest.raises(ValueError, match=r"^method must be one of \('jnp', 'kernel'\) \(got 'triton'\)$"):
            trj.replay(state.tables, *args, method="triton")
        with pytest.raises(ValueError, match=r"^method must be one of \('jnp', 'kernel'\) \(got 'Kernel'\)$"):
            state.replay_at_step(*args[:3], method="Kernel")
        with pytest.raises(ValueError, match=r"^trace_replay_jax\.replay does not support jax\.vmap"):
            jax.vmap(lambda s: trj.replay(state.tables, s, *args[1:], method="kernel"))(args[0][None])
        with pytest.raises(TypeError, match=r"^sampled must have dtype int32 or int64 \(got float32\)"):
            trj.replay(state.tables, args[0].astype(jnp.float32), *args[1:], method="kernel")


# -- GPU tier -------------------------------------------------------------------------------------
def gpu_kernel_checks(device, rng) -> None:
    """New addresses every call; the same addresses with the table written between calls; a
    loop; each against the jnp method and the reference. Used in-process and in a subprocess
    with command buffers forced on."""
    state, traces = _state_with_traces(rng, device, max_slots=64, max_len=32)
    with state:
        fns = {
            m: jax.jit(lambda t, s, i, tl, pl, m=m: trj.replay(t, s, i, tl, pl, method=m))
            for m in trj.jnp_replay.METHODS
        }
        rows = {
            m: jax.jit(lambda t, s, i, st, m=m: trj.replay_at_step(t, s, i, st, method=m))
            for m in trj.jnp_replay.METHODS
        }
        fixed = [jax.device_put(a, device) for a in _inputs(rng, 256, 64, 32)]
        for call in range(40):
            if call % 2:  # fresh arrays: new buffer addresses (XLA records again)
                host = _inputs(rng, 256, 64, 32)
                args = [jax.device_put(a, device) for a in host]
            else:  # the very same arrays: a recorded launch is replayed
                args = fixed
                host = [np.asarray(a) for a in fixed]
            want = _want(traces, *host[:4])
            want_rows = _want(traces, *host)
            for m in fns:
                got = np.asarray(fns[m](state.tables, *args[:4]))
                assert np.array_equal(got, want), f"{m} call {call}: rows {np.nonzero(got != want)[0].tolist()}"
                got = np.asarray(rows[m](state.tables, args[0], args[1], args[4]))
                assert np.array_equal(got, want_rows), f"{m} per-row call {call}"
            # Write the table between calls, with nothing waiting: the next call must see it.
            for slot in rng.choice(64, 4, replace=False):
                traces[int(slot)] = rng.integers(0, 5000, int(rng.integers(1, 33)))
                state.add_request(int(slot), traces[int(slot)])
            state.apply_staged_writes()


@pytest.mark.gpu
def test_gpu_kernel_method_new_addresses_and_table_writes_between_calls(rng):
    gpu_kernel_checks(jax_gpu(), rng)


@pytest.mark.gpu
def test_gpu_kernel_method_with_command_buffers_in_a_subprocess(rng):
    jax_gpu()
    env = dict(
        os.environ,
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFER_FLAGS).strip(),
        TRACE_REPLAY_TEST_SEED=str(int(rng.integers(2**32))),
    )
    here = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, str(Path(__file__))], cwd=here, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "kernel checks ok" in proc.stdout


@pytest.mark.gpu
def test_gpu_kernel_method_refuses_a_table_no_open_state_owns(rng):
    gpu = jax_gpu()
    state, _ = _state_with_traces(rng, gpu)
    with state:
        copy = trj.ReplayTables(state.tables.table + 0, state.tables.trace_len + 0)  # other memory
        args = [jax.device_put(a, gpu) for a in _inputs(rng, 8, state.max_slots, state.max_trace_len)[:4]]
        np.testing.assert_array_equal(np.asarray(trj.replay(copy, *args)), np.asarray(trj.replay(state.tables, *args)))
        # The callback's RuntimeError reaches the caller wrapped by XLA, traceback included.
        with pytest.raises(
            jax.errors.JaxRuntimeError,
            match=r"^INTERNAL: Error when calling buffer callback: (?s:.*)RuntimeError: "
            r"replay\(method='kernel'\) got a table at 0x[0-9a-f]+ on cuda:\d+ "
            r"that no open TraceReplayState owns: pass state\.tables of an open state",
        ):
            np.asarray(trj.replay(copy, *args, method="kernel"))


# -- what method="kernel" refuses: the same on the CPU as on a GPU (#39) ---------------------------
_NOT_OWNED = (
    r"^INTERNAL: Error when calling buffer callback: (?s:.*)RuntimeError: "
    r"replay\(method='kernel'\) got a table at 0x[0-9a-f]+ on {where} "
    r"that no open TraceReplayState owns: pass state\.tables of an open state"
)


def test_kernel_method_refuses_a_table_no_open_state_owns_on_the_cpu(rng):
    cpu = jax.devices("cpu")[0]
    state, traces = _state_with_traces(rng, cpu)
    with state:
        args = _inputs(rng, 8, state.max_slots, state.max_trace_len)[:4]
        want = _want(traces, *args)
        for built in (
            trj.ReplayTables(state.tables.table + 0, state.tables.trace_len + 0),  # other memory
            trj.ReplayTables(*(jnp.asarray(x) for x in state.snapshot())),  # by hand, from a snapshot
        ):
            np.testing.assert_array_equal(np.asarray(trj.replay(built, *args)), want)  # jnp reads any
            with pytest.raises(jax.errors.JaxRuntimeError, match=_NOT_OWNED.format(where="the CPU")):
                np.asarray(trj.replay(built, *args, method="kernel"))
            step = jax.jit(lambda t, *a: trj.replay(t, *a, method="kernel"))
            with pytest.raises(jax.errors.JaxRuntimeError, match=_NOT_OWNED.format(where="the CPU")):
                np.asarray(step(built, *args))
        np.testing.assert_array_equal(np.asarray(trj.replay(state.tables, *args, method="kernel")), want)


def test_kernel_method_reads_a_copy_of_an_earlier_apply_while_the_state_is_open(rng):
    """On the CPU each apply hands out a new copy; a program queued with an older one may run
    after the apply, so the kernel method accepts every copy until the state closes (as jnp)."""
    with TraceReplayState(4, 8, device="cpu") as state:
        a, b = rng.integers(0, 1000, 8), rng.integers(0, 1000, 8)
        state.add_request(1, a)
        state.apply_staged_writes()
        old = state.tables
        state.add_request(1, b)
        state.apply_staged_writes()
        args = (jnp.array([0], jnp.int32), jnp.array([1], jnp.int32), jnp.array([0, 3, 0, 0], jnp.int32))
        args += (jnp.zeros(4, jnp.int32),)
        assert int(trj.replay(old, *args, method="kernel")[0]) == a[3]
        assert int(trj.replay(state.tables, *args, method="kernel")[0]) == b[3]


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_tables_of_a_closed_state_are_refused_by_both_methods(rng, device, method):
    dev = jax.devices("cpu")[0] if device == "cpu" else jax_gpu()
    state, _ = _state_with_traces(rng, dev)
    args = [jax.device_put(a, dev) for a in _inputs(rng, 8, state.max_slots, state.max_trace_len)[:4]]
    tables = state.tables
    trj.replay(tables, *args, method=method).block_until_ready()
    state.close()
    assert tables.table.is_deleted() and tables.trace_len.is_deleted()
    with pytest.raises(RuntimeError, match=r"^Array has been deleted with shape=int32\[16,12\]\."):
        trj.replay(tables, *args, method=method)
    step = jax.jit(lambda t, *a: trj.replay(t, *a, method=method))
    with pytest.raises(RuntimeError, match=r"^Array has been deleted with shape=int32\[16,12\]\."):
        step(tables, *args)


@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_close_deletes_every_copy_of_the_tables_a_cpu_state_handed_out(rng, method):
    """On the CPU each apply hands out a new copy of the table; closing the state deletes all of
    them, not only the latest, so a kept copy is refused by both methods as on a GPU (before:
    an earlier apply's tables still replayed with method="jnp" after close)."""
    state, _ = _state_with_traces(rng, jax.devices("cpu")[0])
    args = [jnp.asarray(a) for a in _inputs(rng, 8, state.max_slots, state.max_trace_len)[:4]]
    handed_out = [state.tables]
    for _ in range(2):
        state.add_request(0, rng.integers(0, 5000, 3))
        state.apply_staged_writes()
        handed_out.append(state.tables)
    assert len({t.table.unsafe_buffer_pointer() for t in handed_out}) == 3  # three copies
    state.close()
    for tables in handed_out:
        assert tables.table.is_deleted() and tables.trace_len.is_deleted()
        with pytest.raises(RuntimeError, match=r"^Array has been deleted with shape=int32\[16,12\]\."):
            trj.replay(tables, *args, method=method)


def test_a_program_queued_before_close_still_reads_its_copy():
    """Deleting a CPU copy at close leaves a program already queued with it to finish on it (XLA
    keeps the buffer until the program is done). The program is slow enough to be queued still
    when close runs, mostly; its result is checked either way."""
    state = TraceReplayState(4, 8, device="cpu")
    state.add_request(1, [5, 6, 7])
    state.apply_staged_writes()
    old = state.tables
    state.add_request(1, [8])
    state.apply_staged_writes()

    @jax.jit
    def slow(tables, x):
        def body(i, acc):
            return acc + (jnp.sin(x * i).sum() * 0).astype(jnp.int32) + tables.table[1, 2]

        return jax.lax.fori_loop(0, 200, body, jnp.int32(0))

    x = jnp.ones((500, 500))
    slow(old, x).block_until_ready()  # compiled before the timed call
    out = slow(old, x)
    state.close()
    assert old.table.is_deleted()
    assert int(out) == 200 * 7


def test_a_cpu_state_keeps_no_copy_of_its_tables_alive(rng):
    """The copies a CPU state hands out are tracked weakly: one dropped by its user is freed,
    closing or not (each apply makes a copy; a state held for a long run must not keep them)."""
    import gc
    import weakref

    with TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(1, [1, 2, 3])
        state.apply_staged_writes()
        first = weakref.ref(state.tables.table)
        state.add_request(1, [4, 5])
        state.apply_staged_writes()
        gc.collect()
        assert first() is None


if __name__ == "__main__":
    seed = int(os.environ.get("TRACE_REPLAY_TEST_SEED", 0))
    gpu_kernel_checks(jax.devices("gpu")[0], np.random.default_rng(seed))
    print("kernel checks ok", os.environ.get("XLA_FLAGS", ""))
