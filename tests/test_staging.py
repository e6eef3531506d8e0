"""CPU tier: staging copies and checks each trace in one pass; what it keeps is exact, a refusal keeps nothing.

``stage`` copies a trace into staging memory and checks the token ids on the way
(``_staging.copy_trace``); the entry is recorded only once they pass. These tests pin what that
relies on, for both backends: the numpy one, and the GPU backend's real staging and commit code
over a stand-in CUDA driver (``staging_doubles.FakeDriver``: host memory for every allocation,
queued copies and scatter launches that run in order only when the host waits), so that the
pinned staging ring, its growth, the entry table packed by ``commit`` and the staging guard all
run without a GPU.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import run_threads
from helpers.staging_doubles import assert_unchanged, committed, everything, expect_rows

from trace_replay_core import TraceTable
from trace_replay_core._staging import copy_trace
from trace_replay_core._validate import trace_array

INT32_MAX = 2**31 - 1


# What is staged is exactly what was given ---------------------------------------------------
NUMPY_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i4", ">i8", ">u4"]


def _random_ids(rng, dtype, n):
    """Random ids in [1, top] for ``dtype``, top as high as an int32 table allows; never zero."""
    top = min(np.iinfo(np.dtype(dtype)).max, INT32_MAX)
    ids = rng.integers(1, top, n, endpoint=True)
    ids[rng.integers(0, n)] = top  # the largest id the dtype and the table both hold
    return ids.astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_dtypes_staged_exactly(rng, make_table, dtype):
    max_slots, max_len = 6, 300
    t = make_table(max_slots, max_len)
    traces = {}
    for slot in range(max_slots):
        n = int(rng.integers(1, max_len + 1))
        tr = _random_ids(rng, dtype, n)
        if slot % 3 == 1:
            tr = np.repeat(tr, 2)[::2]  # a strided view
        elif slot % 3 == 2:
            tr.flags.writeable = False
        t.stage(slot, tr)
        traces[slot] = tr
    t.commit(stream=0)
    expect_rows(t, traces)
    t.close()


def test_int64_near_the_int32_limit_staged_exactly(rng, make_table):
    t = make_table(4, 64)
    traces = {s: rng.integers(INT32_MAX - 1000, INT32_MAX, 64, endpoint=True) for s in range(4)}
    traces[2][-1] = INT32_MAX
    for slot, tr in traces.items():
        t.stage(slot, tr)
    t.stage(3, [INT32_MAX, 1, INT32_MAX - 1])  # a list of Python ints: int64 as well
    traces[3] = [INT32_MAX, 1, INT32_MAX - 1]
    t.commit(stream=0)
    expect_rows(t, traces)
    t.close()


def test_sequences_staged_exactly(rng, make_table):
    t = make_table(4, 50, vocab_size=5000)
    as_list = rng.integers(1, 5000, 50).tolist()
    as_tuple = tuple(rng.integers(1, 5000, 7).tolist())
    t.stage(0, as_list)
    t.stage(1, as_tuple)
    t.stage(2, range(4999, 4950, -1))
    t.commit(stream=0)
    expect_rows(t, {0: as_list, 1: list(as_tuple), 2: list(range(4999, 4950, -1))})
    t.close()


@pytest.mark.parametrize("dtype", ["int16", "int32", "int64", "uint8"])
def test_torch_cpu_tensors_staged_exactly(rng, make_table, dtype):
    import torch

    t = make_table(3, 40)
    traces = {s: _random_ids(rng, dtype, int(rng.integers(1, 41))) for s in range(3)}
    for slot, tr in traces.items():
        tensor = torch.from_numpy(tr.copy())
        t.stage(slot, tensor if slot != 2 else tensor.repeat_interleave(2)[::2])  # a strided view
    t.commit(stream=0)
    expect_rows(t, traces)
    t.close()


def test_jax_cpu_arrays_staged_exactly(rng, make_table):
    import jax

    t = make_table(2, 40)
    traces = {s: rng.integers(1, INT32_MAX, int(rng.integers(1, 41)), dtype=np.int32) for s in range(2)}
    cpu = jax.devices("cpu")[0]
    for slot, tr in traces.items():
        t.stage(slot, jax.device_put(tr, cpu))
    t.commit(stream=0)
    expect_rows(t, traces)
    t.close()


# A refused call changes nothing -------------------------------------------------------------
def _refusals(rng, max_len, vocab):
    """(id, tokens, exception, anchored message) for traces that must be refused."""
    n = int(rng.integers(2, max_len))
    at = int(rng.integers(0, n))

    def ids(dtype, bad):
        tr = rng.integers(1, min(vocab, np.iinfo(np.dtype(dtype)).max), n).astype(dtype)
        tr[at] = bad
        return tr

    return [
        ("negative-int32", ids(np.int32, -3), ValueError, rf"^tokens must be non-negative \(got -3 at index {at}\)$"),
        ("negative-int8", ids(np.int8, -1), ValueError, rf"^tokens must be non-negative \(got -1 at index {at}\)$"),
        (
            "negative-int64",
            ids(np.int64, -(2**40)),
            ValueError,
            rf"^tokens must be non-negative \(got -{2**40} at index {at}\)$",
        ),
        (
            "at-vocab",
            ids(np.int32, vocab),
            ValueError,
            rf"^tokens must be below vocab_size={vocab} \(got {vocab} at index {at}\)$",
        ),
        (
            "above-vocab-uint16",
            ids(np.uint16, vocab + 1),
            ValueError,
            rf"^tokens must be below vocab_size={vocab} \(got {vocab + 1} at index {at}\)$",
        ),
        # int64/uint32 values that an int32 cast would wrap into valid ids: refused, never wrapped
        (
            "int64-wraps-to-valid",
            ids(np.int64, 2**32 + 5),
            ValueError,
            rf"^tokens must be below vocab_size={vocab} \(got {2**32 + 5} at index {at}\)$",
        ),
        (
            "int64-negative-wraps-to-valid",
            ids(np.int64, -(2**32) + 7),
            ValueError,
            rf"^tokens must be non-negative \(got {-(2**32) + 7} at index {at}\)$",
        ),
        (
            "uint32-top-bit",
            ids(np.uint32, 2**31 + 9),
            ValueError,
            rf"^tokens must be below vocab_size={vocab} \(got {2**31 + 9} at index {at}\)$",
        ),
        (
            "uint64-huge",
            ids(np.uint64, 2**64 - 1),
            ValueError,
            rf"^tokens must be below vocab_size={vocab} \(got {2**64 - 1} at index {at}\)$",
        ),
        ("big-endian-negative", ids(">i8", -2), ValueError, rf"^tokens must be non-negative \(got -2 at index {at}\)$"),
        (
            "negative-and-too-large",
            np.array([vocab + 5, -4], np.int64),
            ValueError,
            r"^tokens must be non-negative \(got -4 at index 1\)$",
        ),
        (
            "list-too-large",
            [1, 2**31],
            ValueError,
            rf"^tokens must be below vocab_size={vocab} \(got {2**31} at index 1\)$",
        ),
        (
            "too-long",
            rng.integers(1, vocab, max_len + 1),
            ValueError,
            rf"^tokens has {max_len + 1} tokens; the table holds at most max_trace_len={max_len}$",
        ),
        ("empty", np.zeros(0, np.int32), ValueError, r"^tokens must not be empty"),
        ("2-d", rng.integers(1, vocab, (2, 2)), ValueError, r"^tokens must be 1-D \(got shape \[2, 2\]\)$"),
        ("float", rng.random(3), TypeError, r"^tokens must have an integer dtype \(got float64\)$"),
        (
            "beyond-64-bits",
            [1, 2**70],
            ValueError,
            r"^tokens must be below 2\*\*31 \(got 1180591620717411303424 at index 1\)$",
        ),
    ]


def test_refused_traces_change_nothing(rng, make_table):
    max_slots, max_len, vocab = 8, 40, 60_000
    t = make_table(max_slots, max_len, vocab_size=vocab, staging_bytes=64)
    first = {s: rng.integers(1, vocab, int(rng.integers(1, max_len + 1))) for s in (0, 1, 5)}
    for slot, tr in first.items():
        t.stage(slot, tr)
    t.commit(stream=0)
    later = {1: rng.integers(1, vocab, max_len), 3: rng.integers(1, vocab, 3).astype(np.int32)}
    for slot, tr in later.items():
        t.stage(slot, tr)
    t.clear(5)
    state0 = everything(t)
    for case, tokens, exc, pattern in _refusals(rng, max_len, vocab):
        for slot in (1, 2):  # a staged slot and a fresh one
            before = tokens.copy() if isinstance(tokens, np.ndarray) else list(tokens)
            with pytest.raises(exc, match=pattern):
                t.stage(slot, tokens)
            assert_unchanged(t, state0, case)
            assert np.array_equal(np.asarray(before), np.asarray(tokens)), f"{case}: input changed"
    t.commit(stream=0)
    expect_rows(t, {0: first[0], 1: later[1], 3: later[3]})
    t.close()


WITHOUT_VOCAB = [  # (tokens, message) refused with no vocab_size: int32 holds ids below 2**31
    (np.array([5, 2**31], np.int64), r"^tokens must be below 2\*\*31 \(got 2147483648 at index 1\)$"),
    (np.array([2**32 + 5, 5], np.int64), r"^tokens must be below 2\*\*31 \(got 4294967301 at index 0\)$"),
    (np.array([7, -(2**32) + 7], np.int64), r"^tokens must be non-negative \(got -4294967289 at index 1\)$"),
    (np.array([2**31, 1], np.uint32), r"^tokens must be below 2\*\*31 \(got 2147483648 at index 0\)$"),
    (np.array([1, 2**63], np.uint64), r"^tokens must be below 2\*\*31 \(got 9223372036854775808 at index 1\)$"),
    (np.array([1, -(2**31)], np.int32), r"^tokens must be non-negative \(got -2147483648 at index 1\)$"),
    ([3, 2**31 + 1], r"^tokens must be below 2\*\*31 \(got 2147483649 at index 1\)$"),
]


def test_refusal_messages_match_check_trace(rng):
    """``copy_trace`` (staging's path) and ``check_trace`` refuse the same traces, in the same words."""
    from trace_replay_core._validate import check_trace

    cases = [(1000, tokens, exc, pattern) for _, tokens, exc, pattern in _refusals(rng, 40, 1000)]
    cases += [(None, tokens, ValueError, pattern) for tokens, pattern in WITHOUT_VOCAB]
    for vocab, tokens, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            check_trace(tokens, max_trace_len=40, vocab_size=vocab)
        with pytest.raises(exc, match=pattern):
            arr = trace_array(tokens, max_trace_len=40)
            copy_trace(arr, np.empty(len(arr), np.uint32), vocab_size=vocab)


def test_largest_ids_accepted_without_vocab():
    out = np.empty(2, np.uint32)
    for tokens in (
        np.array([INT32_MAX, 0], np.int64),
        np.array([INT32_MAX, 0], np.uint32),
        np.array([INT32_MAX, 0], np.uint64),
        np.array([INT32_MAX, 0], ">i8"),
        [INT32_MAX, 0],
    ):
        copy_trace(trace_array(tokens, max_trace_len=2), out, vocab_size=None)
        assert out.tolist() == [INT32_MAX, 0]


# Restaging, clearing, growth, the ring -------------------------------------------------------
def test_restaging_before_commit_replaces(rng, make_table):
    max_slots, max_len = 6, 200
    t = make_table(max_slots, max_len, staging_bytes=64)
    model = {}
    for _ in range(5):
        staged = set()
        for _ in range(30):
            slot = int(rng.integers(0, max_slots))
            staged.add(slot)
            if rng.random() < 0.2:
                t.clear(slot)
                model.pop(slot, None)
            else:
                tr = rng.integers(1, 30_000, int(rng.integers(1, max_len + 1)))
                t.stage(slot, tr.astype(rng.choice([np.int32, np.int64, np.uint16])))
                model[slot] = tr
        assert t.pending == len(staged)
        t.commit(stream=0)
        assert t.pending == 0
        expect_rows(t, model)
        t.stage(0, [7, 8, 9])
        t.stage(0, [4])  # shorter: the length shrinks with it
        model[0] = [4]
        t.commit(stream=0)
        expect_rows(t, model)
    t.close()


def test_gpu_staging_grows_and_packs_many_entries(rng, fake_cuda):
    """Hundreds of traces in one commit from a 64-byte staging buffer: the pinned buffer grows
    while staging and while packing the entry table, keeping what was staged."""
    max_slots, max_len = 300, 97
    t = TraceTable(max_slots, max_len, device="cuda:0", staging_bytes=64, staging_depth=2)
    traces = {s: rng.integers(1, 2**31, int(rng.integers(1, max_len + 1))) for s in range(0, max_slots, 2)}
    for slot, tr in traces.items():
        t.stage(slot, tr)
    for slot in range(1, max_slots, 2):
        t.clear(slot)  # entries with no tokens: only the table grows
    t.commit(stream=0)
    expect_rows(t, traces)
    n, chunks, _ = fake_cuda.scatter.launches[-1]
    assert n == max_slots and chunks == 1
    t.close()


def test_gpu_staging_guard_waits_for_in_flight_copies(rng, fake_cuda):
    """With nothing run on the device, a 2-deep ring wraps: stage must wait for the copy that
    still reads the buffer, or later traces would land in earlier slots."""
    max_slots, max_len = 12, 512
    t = TraceTable(max_slots, max_len, device="cuda:0", staging_depth=2)
    traces = {s: rng.integers(1, 2**31, max_len) for s in range(max_slots)}
    for slot, tr in traces.items():
        t.stage(slot, tr)
        t.commit(stream=0)
    assert t._backend.ring.guard_waits == max_slots - 2
    expect_rows(t, traces)
    t.close()


def test_gpu_staging_without_guard_corrupts(rng, fake_cuda):
    """Evidence that the previous test can fail: with the guard disabled, traces get mixed up."""
    max_slots, max_len = 12, 512
    t = TraceTable(max_slots, max_len, device="cuda:0", staging_depth=2)
    for pair in t._backend.ring.pairs:
        pair.event.done = lambda: True
    traces = {s: rng.integers(1, 2**31, max_len) for s in range(max_slots)}
    for slot, tr in traces.items():
        t.stage(slot, tr)
        t.commit(stream=0)
    table, _ = committed(t)
    assert any(not np.array_equal(table[s], tr) for s, tr in traces.items())
    t.close()


def test_gpu_commit_after_clears_neither_waits_nor_allocates(fake_cuda):
    """clear takes its staging entry as stage does: waiting for the staging buffer that a commit
    in flight still reads, and growing it, happen in clear, never in commit (which must not
    synchronise). Nothing runs on the device until the end."""
    t = TraceTable(12, 16, device="cuda:0", staging_depth=2, staging_bytes=64)
    t.stage_many(list(range(2, 10)), np.full((8, 1), 5))  # commit A (pair 0): slots 2-9 traced
    t.commit(stream=0)
    t.stage(0, np.arange(3, 19))  # commit B (pair 1, grown to 128 bytes)
    t.commit(stream=0)
    t.stage(1, np.arange(4, 20))  # commit C (pair 0, waiting for A)
    t.commit(stream=0)
    calls = []
    for name in ("cuMemAlloc", "cuMemAllocHost", "cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize"):
        real = getattr(fake_cuda, name)
        setattr(fake_cuda, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1])
    for slot in range(2, 10):
        t.clear(slot)  # pair 1, still read by B: 8 entries need more than its 128 bytes
    assert calls == ["cuEventSynchronize", "cuMemAllocHost", "cuMemAlloc"]
    calls.clear()
    t.commit(stream=0)
    assert calls == []
    expect_rows(t, {0: np.arange(3, 19), 1: np.arange(4, 20)})
    t.close()


def test_gpu_staging_from_many_threads(rng, fake_cuda):
    """Threads share one pinned staging buffer: no trace is lost, mixed or overwritten."""
    max_slots, max_len, threads, rounds = 32, 300, 8, 40
    t = TraceTable(max_slots, max_len, device="cuda:0", staging_bytes=256)
    per = max_slots // threads
    seeds = rng.integers(0, 2**32, threads)
    last = {}
    barrier = threading.Barrier(threads)

    def worker(i):
        r = np.random.default_rng(seeds[i])
        barrier.wait()
        for j in range(rounds):
            slot = i * per + j % per
            tr = r.integers(1, 2**31, int(r.integers(1, max_len + 1)))
            if j % 7 == 0:
                t.commit(stream=0)
            t.stage(slot, tr if j % 2 else tr.astype(np.int32))
            last[slot] = tr

    run_threads(worker, threads)
    t.commit(stream=0)
    expect_rows(t, last)
    t.close()
