"""CPU tier: staging is thread-safe (one lock per table); threads hammering it lose nothing."""

import threading

import numpy as np
from helpers import run_threads

from trace_replay_core import TraceTable


def test_staging_from_many_threads_cpu():
    max_slots, max_len, threads, per_thread = 32, 64, 8, 300
    t = TraceTable(max_slots, max_len, device="cpu")
    last, staged = {}, {}
    barrier = threading.Barrier(threads)

    def worker(i):
        rng = np.random.default_rng(i)
        barrier.wait()
        for j in range(per_thread):
            slot = i * (max_slots // threads) + j % (max_slots // threads)
            tr = rng.integers(0, 10_000, int(rng.integers(1, max_len + 1)))
            if j % 17 == 0:
                t.commit(stream=0)  # commits interleaved with other threads' staging
            t.stage(slot, tr)
            last[slot] = tr  # each thread owns its slots: the last write per slot is known
            staged[slot] = staged.get(slot, 0) + 1

    run_threads(worker, threads)
    t.commit(stream=0)
    table, lens = t.snapshot()
    # every thread ran to its end: each slot was staged per_thread / (its thread's slots) times
    assert staged == {s: per_thread // (max_slots // threads) for s in range(max_slots)}, staged
    assert len(last) == max_slots
    for slot, tr in last.items():
        assert lens[slot] == len(tr) and np.array_equal(table[slot, : len(tr)], tr), f"slot {slot}"
