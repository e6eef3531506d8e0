"""``TraceTable.stage_many``: many traces in one call, the same result as one ``stage`` each.

CPU tier on the numpy backend and on the GPU backend's real staging code over the stand-in
driver of ``staging_doubles.py``; the GPU tier repeats the equivalence on a real device for both
table placements.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.staging_doubles import assert_unchanged, everything, expect_rows

from trace_replay_core import TraceTable

BLOCK_DTYPES = ["int32", "int64", "uint16", ">i4", "uint64"]


def _reference(ops) -> dict:
    """The slot -> trace a sequence of ("one", slot, tokens) / ("many", slots, traces) implies."""
    model = {}
    for kind, slots, traces in ops:
        pairs = [(slots, traces)] if kind == "one" else list(zip(slots, traces))
        for slot, tokens in pairs:
            model[int(slot)] = np.asarray(tokens).astype(np.int64)
    return model


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("length", [1, 3, 4, 61, 97])
def test_block_staged_as_one_stage_each(rng, make_table, dtype, length):
    max_slots, max_len = 40, 97
    t = make_table(max_slots, max_len, staging_bytes=64)
    first = rng.integers(1, 1000, 5)
    t.stage(0, first)  # staged before, in the same commit
    ops = [("one", 0, first)]
    n = int(rng.integers(2, 30))
    slots = rng.choice(max_slots, n, replace=False)
    slots[-1] = slots[0]  # a slot given twice: the last wins
    top = min(np.iinfo(np.dtype(dtype)).max, 2**31 - 1)
    block = rng.integers(1, top, (n, length), endpoint=True).astype(dtype)
    t.stage_many(slots, block)
    ops.append(("many", slots, block))
    t.stage(int(slots[1]), [7, 8])  # restaged after: replaces
    ops.append(("one", int(slots[1]), [7, 8]))
    assert t.pending == len(_reference(ops))
    t.commit(stream=0)
    expect_rows(t, _reference(ops))
    t.close()


def test_strided_and_foreign_blocks(rng, make_table):
    t = make_table(16, 64, vocab_size=50_000)
    wide = rng.integers(1, 50_000, (4, 128))
    t.stage_many([0, 1, 2, 3], wide[:, ::2])  # a strided view
    t.stage_many(np.array([4, 5], np.int16), np.asfortranarray(wide[:2, :9]))
    expected = {s: wide[s, ::2] for s in range(4)} | {4: wide[0, :9], 5: wide[1, :9]}
    import torch

    t.stage_many(torch.arange(6, 9), torch.from_numpy(wide[:3, :33].copy()))  # CPU tensors, over DLPack
    expected |= {6 + i: wide[i, :33] for i in range(3)}
    t.commit(stream=0)
    expect_rows(t, expected)
    t.close()


def test_ragged_list_staged_as_one_stage_each(rng, make_table):
    max_slots, max_len = 50, 80
    t = make_table(max_slots, max_len, staging_bytes=64, vocab_size=30_000)
    import torch

    model = {}
    for _ in range(4):
        n = int(rng.integers(1, 25))
        slots = rng.integers(0, max_slots, n).tolist()  # repeats allowed: the last wins
        traces = []
        for i in range(n):
            tr = rng.integers(1, 30_000, int(rng.integers(1, max_len + 1)))
            kind = i % 4
            traces.append(
                tr.tolist()
                if kind == 0
                else tr.astype(np.int32)
                if kind == 1
                else torch.from_numpy(tr)
                if kind == 2
                else tr.astype(np.uint16)[::-1]
            )
            model[slots[i]] = tr if kind != 3 else tr.astype(np.uint16)[::-1]
        t.stage_many(slots, tuple(traces) if n % 2 else traces)
        t.commit(stream=0)
        expect_rows(t, model)
    t.close()


def test_empty_calls_stage_nothing(make_table):
    t = make_table(4, 8)
    t.stage_many([], [])
    t.stage_many(np.zeros(0, np.int64), np.zeros((0, 3), np.int32))
    assert t.pending == 0
    t.close()


def _refusals(rng, vocab, max_len):
    """(id, slots, traces, exception, anchored message): each must be refused, changing nothing."""
    good = rng.integers(1, vocab, (3, 10))
    bad_value = good.copy()
    bad_value[2, 7] = vocab
    negative = good.astype(np.int64)
    negative[1, 4] = -5
    return [
        ("slot-out-of-range", [1, 9, 2], good, ValueError, r"^slots\[1\] must be in \[0, 8\) \(got 9\)$"),
        ("slot-negative", [1, 2, -1], good, ValueError, r"^slots\[2\] must be in \[0, 8\) \(got -1\)$"),
        ("slot-float", [1, 2.0, 3], good, TypeError, r"^slots\[1\] must be an int \(got float 2\.0\)$"),
        ("slot-bool", [True, 2, 3], good, TypeError, r"^slots\[0\] must be an int \(got bool True\)$"),
        (
            "slots-2d",
            np.zeros((3, 1), np.int64),
            good,
            TypeError,
            r"^slots must be a 1-D sequence of ints \(got a 2-D array of int64\)$",
        ),
        ("slots-scalar", 3, good, TypeError, r"^slots must be a sequence of ints or a 1-D integer array \(got int\)$"),
        (
            "slots-float-array",
            np.array([1.0, 2.0, 3.0]),
            good,
            TypeError,
            r"^slots must be a 1-D sequence of ints \(got a 1-D array of float64\)$",
        ),
        ("rows-mismatch", [1, 2], good, ValueError, r"^traces has 3 traces but slots has 2 entries$"),
        ("list-mismatch", [1, 2], [[1], [2], [3]], ValueError, r"^traces has 3 traces but slots has 2 entries$"),
        (
            "1-d",
            [1, 2, 3],
            good[0],
            ValueError,
            r"^traces must be a 2-D array \[traces, tokens\] or a list of 1-D traces \(got an array of shape \[10\]\)$",
        ),
        ("3-d", [1, 2, 3], good[:, :, None], ValueError, r"^traces must be a 2-D array"),
        ("no-tokens", [1, 2, 3], good[:, :0], ValueError, r"^traces must not be empty"),
        (
            "too-long",
            [1, 2, 3],
            rng.integers(1, vocab, (3, max_len + 1)),
            ValueError,
            rf"^traces has {max_len + 1} tokens per trace; the table holds at most max_trace_len={max_len}$",
        ),
        ("float", [1, 2, 3], good.astype(float), TypeError, r"^traces must have an integer dtype \(got float64\)$"),
        (
            "at-vocab",
            [1, 2, 3],
            bad_value,
            ValueError,
            rf"^traces\[2\] must be below vocab_size={vocab} \(got {vocab} at index 7\)$",
        ),
        ("negative", [1, 2, 3], negative, ValueError, r"^traces\[1\] must be non-negative \(got -5 at index 4\)$"),
        (
            "list-item-bad",
            [1, 2, 3],
            [[1, 2], [3, vocab + 1], [4]],
            ValueError,
            rf"^traces\[1\] must be below vocab_size={vocab} \(got {vocab + 1} at index 1\)$",
        ),
        ("list-item-empty", [1, 2, 3], [[1, 2], [3], []], ValueError, r"^traces\[2\] must not be empty"),
        ("list-item-2d", [1, 2, 3], [[1, 2], [[3]], [4]], ValueError, r"^traces\[1\] must be 1-D"),
        ("dict", [1, 2, 3], {1: [1]}, TypeError, r"^traces must be a 2-D integer array \[traces, tokens\] or a list"),
    ]


def test_refused_calls_change_nothing(rng, make_table):
    max_slots, max_len, vocab = 8, 40, 60_000
    t = make_table(max_slots, max_len, vocab_size=vocab, staging_bytes=64)
    first = {s: rng.integers(1, vocab, int(rng.integers(1, max_len + 1))) for s in (0, 1, 5)}
    t.stage_many(list(first), list(first.values()))
    t.commit(stream=0)
    t.stage_many([1, 3], rng.integers(1, vocab, (2, 7)))
    t.clear(5)
    state0 = everything(t)
    for case, slots, traces, exc, pattern in _refusals(rng, vocab, max_len):
        with pytest.raises(exc, match=pattern):
            t.stage_many(slots, traces)
        assert_unchanged(t, state0, case)
    t.close()


def test_distinct_refuses_a_repeated_slot_and_changes_nothing(rng, make_table):
    max_slots, max_len, vocab = 8, 40, 1000
    t = make_table(max_slots, max_len, vocab_size=vocab)
    t.stage_many([2, 6], rng.integers(1, vocab, (2, 5)))
    state0 = everything(t)
    for slots, traces, pattern in (
        (
            [0, 3, 1, 3],
            [[1], [2], [3], [4]],
            r"^slots gives slot 3 twice \(positions 1 and 3\): each request "
            r"takes its own slot$",
        ),
        (np.array([1, 0, 0, 1]), rng.integers(1, vocab, (4, 3)), r"^slots gives slot 0 twice \(positions 1 and 2\)"),
        ([4, 4], [[1], [vocab]], r"^slots gives slot 4 twice"),
    ):  # the slots are judged before the traces
        with pytest.raises(ValueError, match=pattern):
            t.stage_many(slots, traces, distinct=True)
        assert_unchanged(t, state0, f"distinct {slots}")
    with pytest.raises(TypeError, match=r"^distinct must be True or False \(got 1\)$"):
        t.stage_many([0, 1], [[1], [2]], distinct=1)
    assert_unchanged(t, state0, "distinct=1")
    t.stage_many([0, 1], [[1], [2]], distinct=True)
    assert t.pending == 4
    t.close()


def test_gpu_backend_block_grows_staging_once(rng, fake_cuda):
    """A block larger than the staging buffer grows it once, rows padded to 16 bytes; one scatter
    launch covers every entry."""
    max_slots, max_len, n, length = 300, 97, 200, 93
    t = TraceTable(max_slots, max_len, device="cuda:0", staging_bytes=64, staging_depth=2)
    slots = rng.permutation(max_slots)[:n]
    block = rng.integers(1, 2**31, (n, length))
    t.stage_many(slots, block)
    offsets = sorted(entry[2] for entry in t._backend.ring.staged.entries.values())
    assert offsets == [i * 96 for i in range(n)]  # 93 tokens padded to 96
    t.commit(stream=0)
    expect_rows(t, dict(zip(slots.tolist(), block)))
    launched, chunks, _ = fake_cuda.scatter.launches[-1]
    assert launched == n and chunks == 1
    t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host_mapped"])
def test_gpu_stage_many_matches_stage(rng, placement):
    """On a real GPU: a block, a ragged list and single stages in one commit give the rows that
    one stage per trace gives, on a second table."""
    max_slots, max_len, vocab = 256, 2048, 151_936
    many = TraceTable(max_slots, max_len, device="cuda:0", placement=placement, vocab_size=vocab, staging_bytes=64)
    one = TraceTable(max_slots, max_len, device="cuda:0", placement=placement, vocab_size=vocab)
    for _ in range(3):
        slots = rng.permutation(max_slots)[:64]
        block = rng.integers(1, vocab, (48, int(rng.integers(1, max_len + 1))), dtype=np.int32)
        ragged = [rng.integers(1, vocab, int(rng.integers(1, max_len + 1))) for _ in range(16)]
        many.stage_many(slots[:48], block)
        many.stage_many(slots[48:], ragged)
        for slot, tokens in zip(slots.tolist(), list(block) + ragged):
            one.stage(slot, tokens)
        for table in (many, one):
            table.clear(int(slots[5]))
            table.commit(stream=0)
    got, want = many.snapshot(), one.snapshot()
    assert np.array_equal(got[1], want[1])
    assert (got[1] > 0).sum() >= 63
    for slot in np.nonzero(want[1])[0]:
        n = want[1][slot]
        assert np.array_equal(got[0][slot, :n], want[0][slot, :n]), f"slot {slot} differs"
    many.close()
    one.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("placement", ["device", "host_mapped"])
def test_gpu_large_block_reaches_the_table(rng, dtype, placement):
    """On a real GPU: a 2 MiB block (eight check pieces) copied into pinned staging memory
    arrives intact in the table after the commit's host-to-device copy, three commits running."""
    t = TraceTable(128, 8192, device="cuda:0", placement=placement, vocab_size=150_000)
    for _ in range(3):
        slots = rng.permutation(128)[:64]
        block = rng.integers(0, 150_000, (64, 8192)).astype(dtype)
        t.stage_many(slots, block)
        t.commit(stream=0)
        table, lengths = t.snapshot()
        assert (lengths[slots] == 8192).all()
        bad = np.argwhere(table[slots] != block.astype(np.int32))
        assert bad.size == 0, f"first differing (row, token): {bad[:5].tolist()}"
    t.close()


@pytest.mark.parametrize("length", [8192, 8190, 70_000])
def test_blocks_larger_than_a_check_piece(rng, make_table, length):
    """Blocks staged piece by piece (``_staging.CHECK_CHUNK_BYTES``): every piece lands, and a bad
    id in a later piece is refused naming its trace, with nothing staged."""
    from trace_replay_core._staging import CHECK_CHUNK_BYTES

    rows = 3 * CHECK_CHUNK_BYTES // (4 * length) + 2  # at least three pieces (or one row each)
    t = make_table(rows + 2, length, vocab_size=150_000)
    slots = rng.permutation(rows + 2)[:rows]
    block = rng.integers(1, 150_000, (rows, length)).astype(np.int32)
    bad = block.copy()
    bad[rows - 1, length // 3] = 150_000
    with pytest.raises(
        ValueError,
        match=rf"^traces\[{rows - 1}\] must be below vocab_size=150000 "
        rf"\(got 150000 at index {length // 3}\)$",
    ):
        t.stage_many(slots, bad)
    assert t.pending == 0
    bad[rows - 1, length // 3] = 5
    bad[1, 0] = -2  # an earlier piece: found first
    with pytest.raises(ValueError, match=r"^traces\[1\] must be non-negative \(got -2 at index 0\)$"):
        t.stage_many(slots, bad)
    t.stage_many(slots, block)
    t.commit(stream=0)
    expect_rows(t, dict(zip(slots.tolist(), block)))
    t.close()
