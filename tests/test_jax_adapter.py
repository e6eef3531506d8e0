"""The JAX adapter on the CPU: replay, staged writes and refusals, with the inputs and references of
``helpers/jax_adapter_cases.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jax_adapter_cases import (
    CPU,
    POISON,
    REPO,
    VOCAB,
    _FakeTable,
    _inputs,
    _one_row_step,
    _random_state,
    _reference,
)
from helpers.jax_helpers import external_view, x64

import trace_replay_jax as trj
from trace_replay_jax import TraceReplayState


# -- semantics ------------------------------------------------------------------------------------
def test_package_example_runs():
    doc = trj.__doc__
    code = textwrap.dedent(doc.split("::\n", 1)[1].split("\nPublic names")[0])
    exec(compile(code, "trace_replay_jax example", "exec"), {})


@pytest.mark.parametrize("batch", [0, 1, 5, 100, 1024])
def test_replay_matches_reference_and_returns_a_new_array(rng, batch):
    state, traces = _random_state(rng, CPU)
    s, i, tl, pl, st = _inputs(rng, batch, state.max_slots, state.max_trace_len, CPU, traces=traces)
    before = np.asarray(s).copy()
    out = state.replay(s, i, tl, pl)
    want = _reference(traces, state.max_slots, state.max_trace_len, s, i, tl, pl)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert out.dtype == s.dtype and out.shape == s.shape
    np.testing.assert_array_equal(np.asarray(s), before)  # the input is untouched
    if batch:
        assert out.unsafe_buffer_pointer() != s.unsafe_buffer_pointer()
        assert (want != POISON).any() or not traces  # row 0 is planted on a traced slot at step 0
    out = state.replay_at_step(s, i, st)
    np.testing.assert_array_equal(
        np.asarray(out), _reference(traces, state.max_slots, state.max_trace_len, s, i, step=st)
    )
    jitted = jax.jit(lambda t, s, i, tl, pl: trj.replay(t, s, i, tl, pl))
    np.testing.assert_array_equal(np.asarray(jitted(state.tables, s, i, tl, pl)), want)
    state.close()


def test_sampled_as_batch_by_one(rng):
    state, traces = _random_state(rng, CPU)
    s, i, tl, pl, _ = _inputs(rng, 64, state.max_slots, state.max_trace_len, CPU)
    out = state.replay(s.reshape(64, 1), i, tl, pl)
    assert out.shape == (64, 1)
    np.testing.assert_array_equal(
        np.asarray(out)[:, 0], _reference(traces, state.max_slots, state.max_trace_len, s, i, tl, pl)
    )


@pytest.mark.parametrize("sampled_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_int64_under_x64(rng, sampled_dtype, index_dtype):
    with x64(True):
        state, traces = _random_state(rng, CPU)
        s, i, tl, pl, st = _inputs(rng, 77, state.max_slots, state.max_trace_len, CPU, sampled_dtype, index_dtype)
        out = state.replay(s, i, tl, pl)
        assert out.dtype == np.dtype(sampled_dtype)
        np.testing.assert_array_equal(
            np.asarray(out), _reference(traces, state.max_slots, state.max_trace_len, s, i, tl, pl)
        )
        out = jax.jit(trj.replay_at_step)(state.tables, s, i, st)
        np.testing.assert_array_equal(
            np.asarray(out), _reference(traces, state.max_slots, state.max_trace_len, s, i, step=st)
        )
        state.close()


def test_default_token_dtype_is_int32():
    """Without x64 a sampler's argmax is int32, and the replay returns int32 tokens: the forced
    ones (read from the int32 table) and the ones left alone."""
    logits = jnp.zeros((3, 6)).at[jnp.arange(3), jnp.array([5, 4, 3])].set(1.0)
    sampled = jnp.argmax(logits, axis=-1)
    assert sampled.dtype == np.int32
    with TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(2, [7, 11, 13])
        state.apply_staged_writes()
        total, prompt = jnp.array([0, 0, 4, 0], jnp.int32), jnp.array([0, 0, 3, 0], jnp.int32)
        out = state.replay(sampled, jnp.array([2, -1, 2], jnp.int32), total, prompt)
        assert out.dtype == np.int32
        assert np.asarray(out).tolist() == [11, 4, 11]


@pytest.mark.parametrize("use_x64", [False, True])
def test_extreme_lengths_never_wrap_into_a_valid_step(use_x64):
    """total_len - prompt_len far outside int range must be skipped, as in the reference."""
    with x64(use_x64):
        dt = np.int64 if use_x64 else np.int32
        info = np.iinfo(dt)
        with TraceReplayState(4, 8, device="cpu") as state:
            state.add_request(1, [11, 12, 13, 14, 15, 16, 17, 18])
            state.apply_staged_writes()
            total = np.array([0, info.min + 3, 0, 0], dt)  # true difference: about -2**bits,
            prompt = np.array([0, info.max - 1, 0, 0], dt)  # a small step once wrapped
            sampled = jnp.full(3, POISON, jnp.int32)
            idx = jnp.array([1, 1, -1], jnp.int32)
            out = state.replay(sampled, idx, jnp.asarray(total), jnp.asarray(prompt))
            assert np.asarray(out).tolist() == [POISON] * 3
            total[1], prompt[1] = info.max, info.max - 5  # a real step 5
            out = state.replay(sampled, idx, jnp.asarray(total), jnp.asarray(prompt))
            assert np.asarray(out).tolist() == [16, 16, POISON]


def test_inside_fori_loop_and_while_loop(rng):
    state, traces = _random_state(rng, CPU)
    s, i, tl, pl, _ = _inputs(rng, 40, state.max_slots, state.max_trace_len, CPU)

    @jax.jit
    def loops(tables, s, i, tl, pl):
        def body(k, acc):
            return acc.at[k].set(trj.replay(tables, s, i, tl + k, pl))

        fori = jax.lax.fori_loop(0, 5, body, jnp.zeros((5,) + s.shape, s.dtype))

        def wbody(c):
            k, out = c
            return k + 1, trj.replay(tables, s, i, tl + k, pl)

        _, last = jax.lax.while_loop(lambda c: c[0] < 3, wbody, (0, s))
        return fori, last

    fori, last = loops(state.tables, s, i, tl, pl)
    for k in range(5):
        np.testing.assert_array_equal(
            np.asarray(fori[k]), _reference(traces, state.max_slots, state.max_trace_len, s, i, np.asarray(tl) + k, pl)
        )
    np.testing.assert_array_equal(
        np.asarray(last), _reference(traces, state.max_slots, state.max_trace_len, s, i, np.asarray(tl) + 2, pl)
    )


def test_staged_writes_seen_by_the_next_jitted_call_only_after_apply(rng):
    a = rng.integers(0, VOCAB, 6)
    b = rng.integers(0, VOCAB, 3)
    step = jax.jit(lambda t, s, i, tl, pl: trj.replay(t, s, i, tl, pl))
    with TraceReplayState(4, 8, device="cpu", vocab_size=VOCAB) as state:
        args = _one_row_step(state, 2, 2)
        assert int(step(state.tables, *args)[0]) == POISON
        state.add_request(2, a)
        assert state.pending == 1
        with pytest.warns(trj.StagedWritesWarning, match=r"^state\.tables was read while"):
            assert int(step(state.tables, *args)[0]) == POISON  # staged, not applied
        state.apply_staged_writes()
        assert state.pending == 0
        assert int(step(state.tables, *args)[0]) == a[2]
        state.add_request(2, b)  # slot reused, shorter trace
        state.apply_staged_writes()
        assert int(step(state.tables, *args)[0]) == b[2]
        assert int(step(state.tables, *_one_row_step(state, 2, 4))[0]) == POISON  # old tail gone
        state.remove_request(2)
        state.apply_staged_writes()
        assert int(step(state.tables, *args)[0]) == POISON
        state.add_request(2, a)
        state.add_request(2, None)  # untraced request wins
        state.apply_staged_writes()
        assert int(step(state.tables, *args)[0]) == POISON


def test_cpu_apply_leaves_tables_already_handed_out_unchanged(rng):
    """On the CPU each apply makes new arrays, so programs queued earlier keep the old table."""
    a, b = rng.integers(0, VOCAB, 5), rng.integers(0, VOCAB, 5)
    with TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(1, a)
        state.apply_staged_writes()
        old = state.tables
        state.add_request(1, b)
        state.apply_staged_writes()
        args = _one_row_step(state, 1, 3)
        assert int(trj.replay(old, *args)[0]) == a[3]
        assert int(trj.replay(state.tables, *args)[0]) == b[3]
        before = state.tables
        state.apply_staged_writes()  # nothing staged: the same arrays
        assert state.tables.table is before.table and state.tables.trace_len is before.trace_len


@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_tables_passed_in_with_every_other_argument_constant_see_each_apply(rng, method):
    """The form of the closed-over refusal's fix: only the tables are arguments; the program
    reads whatever was applied before each call (#39: the closed-over form replayed stale)."""
    a, b = rng.integers(0, VOCAB, 5), rng.integers(0, VOCAB, 5)
    with TraceReplayState(4, 8, device="cpu") as state:
        args = _one_row_step(state, 1, 3)
        step = jax.jit(lambda t: trj.replay(t, *args, method=method))
        state.add_request(1, a)
        state.apply_staged_writes()
        assert int(step(state.tables)[0]) == a[3]
        state.add_request(1, b)
        state.apply_staged_writes()
        assert int(step(state.tables)[0]) == b[3]


def test_trace_may_be_a_cpu_jax_array(rng):
    tr = rng.integers(0, VOCAB, 4)
    with TraceReplayState(2, 4, device="cpu") as state:
        state.add_request(0, jnp.asarray(tr, jnp.int32))
        state.apply_staged_writes()
        assert int(state.replay(*_one_row_step(state, 0, 3))[0]) == tr[3]


def test_add_requests_matches_add_request(rng):
    """A block (numpy or a CPU JAX array) and a ragged list through ``add_requests`` give the
    table one ``add_request`` each gives."""
    max_slots, max_len = 16, 20
    slots = rng.permutation(max_slots)[:12].tolist()
    block = rng.integers(0, VOCAB, (8, 13))
    ragged = [rng.integers(0, VOCAB, int(rng.integers(1, max_len + 1))) for _ in range(4)]
    with (
        TraceReplayState(max_slots, max_len, device="cpu", vocab_size=VOCAB) as many,
        TraceReplayState(max_slots, max_len, device="cpu", vocab_size=VOCAB) as one,
    ):
        many.add_requests(slots[:4], jax.device_put(block[:4].astype(np.int32), CPU))
        many.add_requests(slots[4:8], block[4:])
        many.add_requests(slots[8:], ragged)
        for slot, tr in zip(slots, list(block) + ragged):
            one.add_request(slot, tr)
        for st in (many, one):
            st.apply_staged_writes()
        got, want = many.snapshot(), one.snapshot()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        with pytest.raises(ValueError, match=rf"^traces\[1\] must be below vocab_size={VOCAB}"):
            many.add_requests([0, 1], [[1], [VOCAB]])
        assert many.pending == 0
        for slots, traces, slot, first, again in (
            ([0, 3, 1, 3], [[1], [2], [3], [4]], 3, 1, 3),
            (np.array([1, 0, 0, 1]), np.ones((4, 2), np.int32), 0, 1, 2),
        ):
            with pytest.raises(
                ValueError,
                match=rf"^slots gives slot {slot} twice \(positions {first} and "
                rf"{again}\): each request takes its own slot$",
            ):
                many.add_requests(slots, traces)
            assert many.pending == 0


def test_traced_trace_data_is_refused_with_the_fix():
    with TraceReplayState(4, 8, device="cpu") as state:
        for call, pattern in (
            (lambda t: state.add_request(0, t), r"^trace must be concrete host data; add_request\(\) is host-only"),
            (lambda t: state.add_requests([0], t[None]), r"^traces must be concrete host data; add_requests\(\)"),
            (lambda t: state.add_requests([0, 1], [[1], t]), r"^traces\[1\] must be concrete host data"),
        ):
            with pytest.raises(TypeError, match=pattern):
                jax.jit(call)(jnp.arange(3, dtype=jnp.int32))
            assert state.pending == 0


def test_gradient_through_replayed_tokens_is_that_of_constant_tokens():
    """Tokens are integers: a float loss indexed by replayed tokens differentiates as if the
    tokens were constants; differentiating with respect to the ids themselves is refused."""
    with TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(0, [3, 1, 4])
        state.apply_staged_writes()
        idx, tl, pl = jnp.array([0, -1], jnp.int32), jnp.array([1, 0, 0, 0], jnp.int32), jnp.zeros(4, jnp.int32)

        def loss(x):
            tokens = state.replay(jnp.argmax(x, axis=-1).astype(jnp.int32), idx, tl, pl)
            return jnp.take_along_axis(x, tokens[:, None], axis=1).sum()

        x = jnp.arange(12.0).reshape(2, 6)
        g = jax.grad(loss)(x)
        assert np.asarray(g).tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]]
        with pytest.raises(TypeError, match=r"^grad requires real- or complex-valued inputs"):
            jax.grad(lambda s: state.replay(s, idx, tl, pl).sum())(jnp.zeros(2, jnp.int32))


def test_close_is_idempotent_and_final():
    state = TraceReplayState(2, 2, device="cpu")
    state.close()
    state.close()
    assert state.closed
    for call in (
        lambda: state.tables,
        lambda: state.add_request(0, [1]),
        state.apply_staged_writes,
        lambda: state.replay(
            jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32)
        ),
    ):
        with pytest.raises(RuntimeError, match=r"^this TraceReplayState is closed$"):
            call()


# -- building blocks, testable on the CPU ---------------------------------------------------------
def test_external_view_is_zero_copy_and_frees_only_its_descriptor(rng):
    raw = np.zeros(16 * 64 * 4 + 128, np.uint8)
    off = (-raw.ctypes.data) % 64
    mem = raw[off : off + 16 * 64 * 4].view(np.int32).reshape(16, 64)
    mem[:] = rng.integers(0, 1000, (16, 64))
    for _ in range(200):  # descriptors are freed by JAX through libc free; no leak, no crash
        view = external_view(mem.ctypes.data, (16, 64), np.int32, CPU)
        assert view.unsafe_buffer_pointer() == mem.ctypes.data
        del view
    view = external_view(mem.ctypes.data, (16, 64), np.int32, CPU)
    r, c = int(rng.integers(16)), int(rng.integers(64))
    mem[r, c] = -5  # the view sees writes to the owner's memory
    assert int(jax.jit(lambda v: v[r, c])(view)) == -5
    del view
    assert mem[r, c] == -5


def test_external_view_passes_on_jaxs_refusal_of_misaligned_memory():
    raw = np.zeros(1024, np.uint8)
    off = (-raw.ctypes.data) % 64 + 4  # 4-byte aligned, not 64
    with pytest.raises(
        ValueError,
        match=r"^Specified input which requires a copy since the source data buffer is not aligned to 64 bytes\.",
    ):
        external_view(raw.ctypes.data + off, (8,), np.int32, CPU)


def test_external_view_refuses_a_copy_where_a_view_was_asked_for(monkeypatch):
    """A JAX that hands back a copy (as it may for memory it cannot view) is refused by the
    adapter itself: a copy would silently stop seeing the table's writes."""
    raw = np.zeros(1024, np.uint8)
    off = (-raw.ctypes.data) % 64
    ptr = raw.ctypes.data + off
    monkeypatch.setattr(jax.dlpack, "from_dlpack", lambda view, copy=None: jnp.arange(8, dtype=jnp.int32))
    with pytest.raises(
        RuntimeError,
        match=rf"^JAX copied the memory instead of viewing it \(0x{ptr:x} -> 0x[0-9a-f]+\); "
        r"it must be compact and aligned$",
    ):
        external_view(ptr, (8,), np.int32, CPU)


def test_xla_commit_runs_inside_a_jitted_op_and_reports_errors_later():
    """The commit op's plumbing (buffer_callback, in-flight guard, error hand-off) on the CPU;
    on a GPU the same op passes XLA's stream (see test_gpu_commit_runs_on_xlas_stream)."""
    from trace_replay_jax.commit import XlaCommit

    table = _FakeTable()
    op = XlaCommit(table, stream_of=lambda ctx: 12345)
    anchor = jnp.zeros((), jnp.int32)
    op(anchor)
    op(anchor)
    op.wait()
    assert table.streams == [12345, 12345]
    bad = XlaCommit(_FakeTable(fail=True), stream_of=lambda ctx: 0)
    bad(anchor)
    with pytest.raises(
        RuntimeError, match=r"^applying staged writes failed on the device stream: scatter launch failed$"
    ):
        bad.wait()
    bad.wait()  # reported once


def test_import_loads_neither_torch_nor_jax_triton_and_changes_no_environment():
    code = (
        "import os, sys; env = dict(os.environ); import trace_replay_jax; "
        "s = trace_replay_jax.TraceReplayState(2, 2, device='cpu'); s.add_request(0, [1]); "
        "s.apply_staged_writes(); s.close(); "
        "bad = [m for m in ('torch', 'jax_triton') if m in sys.modules]; "
        "changed = dict(os.environ) != env; print('loaded', bad, 'env changed', changed); "
        "sys.exit(1 if bad or changed else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
