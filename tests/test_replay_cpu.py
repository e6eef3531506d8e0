"""CPU tier: the numpy backend of TraceTable against the row-by-row numpy reference."""

import numpy as np
import pytest
from helpers import POISON, assert_tokens_equal, random_scenario

from trace_replay_core import TraceTable, replay_reference

BATCHES = [1, 5, 100, 1024]
INT_DTYPES = [np.int32, np.int64]


def _table_from(sc, max_slots, max_trace_len, **kw):
    t = TraceTable(max_slots, max_trace_len, device="cpu", **kw)
    for slot, tr in sc["traces"].items():
        t.stage(slot, tr)
    t.commit(stream=0)
    return t


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("sampled_dtype", INT_DTYPES)
@pytest.mark.parametrize("index_dtype", INT_DTYPES)
@pytest.mark.parametrize("mode", ["lengths", "step"])
def test_replay_matches_reference(rng, batch, sampled_dtype, index_dtype, mode):
    max_slots, max_trace_len = 37, 29
    sc = random_scenario(
        rng,
        max_slots=max_slots,
        max_trace_len=max_trace_len,
        batch=batch,
        sampled_dtype=sampled_dtype,
        index_dtype=index_dtype,
    )
    with _table_from(sc, max_slots, max_trace_len) as t:
        sampled = sc["sampled"].copy()
        if mode == "lengths":
            expected = replay_reference(
                sampled, sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
            )
            t.replay(sampled, sc["idx"], sc["total_len"], sc["prompt_len"], stream=0)
        else:
            expected = replay_reference(sampled, sc["idx"], sc["table"], sc["trace_len"], step=sc["step"])
            t.replay_at_step(sampled, sc["idx"], sc["step"], stream=0)
    assert sampled.dtype == sampled_dtype
    assert_tokens_equal(sampled, expected)
    # The scenario must exercise both outcomes, or the comparison proves little.
    if batch >= 100:
        assert (expected != sc["sampled"]).any() and (expected == sc["sampled"]).any()


def test_sampled_2d_single_column(rng):
    sc = random_scenario(rng, max_slots=8, max_trace_len=6, batch=50)
    with _table_from(sc, 8, 6) as t:
        sampled = sc["sampled"].reshape(-1, 1).copy()
        t.replay(sampled, sc["idx"], sc["total_len"], sc["prompt_len"], stream=0)
    expected = replay_reference(
        sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
    )
    assert_tokens_equal(sampled.reshape(-1), expected)


def test_clear_and_reuse_slots(rng):
    max_slots, max_trace_len, batch = 16, 12, 64
    t = TraceTable(max_slots, max_trace_len, device="cpu")
    state = {}
    for rnd in range(6):
        for slot in rng.choice(max_slots, size=6, replace=False):
            slot = int(slot)
            if rng.random() < 0.4:
                t.clear(slot)
                state.pop(slot, None)
            else:
                tr = rng.integers(0, 1000, int(rng.integers(1, max_trace_len + 1)))
                t.stage(slot, tr)
                state[slot] = tr
        # staging the same slot twice before a commit: the last one wins; slot 3 holds a full-length
        # trace after round 0 and a 3-token one after each later round (a reused slot's length shrinks)
        tr3 = rng.integers(0, 1000, max_trace_len) if rnd == 0 else np.array([1, 2, 3])
        t.stage(3, tr3)
        state[3] = tr3
        t.commit(stream=0)
        table = np.zeros((max_slots, max_trace_len), np.int32)
        lens = np.zeros(max_slots, np.int32)
        for slot, tr in state.items():
            table[slot, : len(tr)] = tr
            lens[slot] = len(tr)
        idx = rng.integers(-1, max_slots, batch).astype(np.int64)
        step = rng.integers(-1, max_trace_len + 1, batch).astype(np.int64)
        idx[: max_trace_len + 1], step[: max_trace_len + 1] = 3, np.arange(max_trace_len + 1)  # every step of slot 3
        sampled = np.full(batch, POISON, np.int64)
        t.replay_at_step(sampled, idx, step, stream=0)
        assert_tokens_equal(
            sampled, replay_reference(np.full(batch, POISON), idx, table, lens, step=step), f"round {rnd}"
        )
    t.close()


def test_uncommitted_traces_are_not_visible():
    """A staged trace is invisible until commit; after it, steps at and past the trace's end are
    left alone. The sentinel differs from the zero-filled table, so a replay that ignored the
    trace length (reading the table's zeros) would show."""
    sentinel = 987_654
    with TraceTable(4, 4, device="cpu") as t:
        t.stage(1, [7, 8])
        sampled = np.array([sentinel], np.int64)
        t.replay_at_step(sampled, np.array([1], np.int32), np.array([0], np.int32), stream=0)
        assert sampled.tolist() == [sentinel]
        assert t.pending == 1
        t.commit(stream=0)
        assert t.pending == 0
        t.replay_at_step(sampled, np.array([1], np.int32), np.array([1], np.int32), stream=0)
        assert sampled.tolist() == [8]
        rows = np.full(4, sentinel, np.int64)
        t.replay_at_step(rows, np.array([1, 1, 0, 1], np.int32), np.array([2, 3, 0, 0], np.int32), stream=0)
        assert rows.tolist() == [sentinel, sentinel, sentinel, 7]  # past the end; untraced slot 0; step 0


def test_empty_batch_is_a_no_op():
    """An empty batch, given as an empty slice of a larger buffer, writes nothing around it; the
    same call with one row does write (so the buffer really is reachable)."""
    with TraceTable(4, 4, device="cpu") as t:
        t.stage(0, [1, 2, 3, 4])
        t.commit(stream=0)
        buf = np.full(6, POISON, np.int64)
        idx = np.zeros(6, np.int32)  # slot 0, traced, at step 0
        lengths = np.zeros(4, np.int32), np.zeros(4, np.int32)
        t.replay(buf[2:2], idx[2:2], *lengths, stream=0)
        t.replay_at_step(buf[2:2], idx[2:2], np.zeros(0, np.int32), stream=0)
        assert buf.tolist() == [POISON] * 6
        t.replay(buf[2:3], idx[2:3], *lengths, stream=0)
        assert buf.tolist() == [POISON, POISON, 1, POISON, POISON, POISON]


def test_trace_may_fill_its_row():
    with TraceTable(2, 5, device="cpu") as t:
        t.stage(1, [1, 2, 3, 4, 5])
        t.commit(stream=0)
        out = np.zeros(5, np.int32)
        t.replay_at_step(out, np.ones(5, np.int32), np.arange(5, dtype=np.int32), stream=0)
        assert out.tolist() == [1, 2, 3, 4, 5]


def test_close_is_idempotent_and_blocks_use():
    t = TraceTable(2, 2, device="cpu")
    t.close()
    t.close()
    assert t.closed
    with pytest.raises(RuntimeError, match="^this TraceTable is closed$"):
        t.stage(0, [1])
