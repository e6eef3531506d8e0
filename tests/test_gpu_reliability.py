"""GPU tier: soak, resource lifetime, garbage collection and threads.

Skipped with a reason on machines without a GPU (see conftest.py). The soak length is set by
``TRACE_REPLAY_SOAK_STEPS`` (default 100,000).
"""

import gc
import os
import threading

import numpy as np
import pytest
import torch
from helpers import POISON, admit_requests, assert_tokens_equal, check_soak, run_threads

from trace_replay_core import TraceTable
from trace_replay_torch import TraceReplayState

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("placement", ["device", "host_mapped"])
def test_soak(rng, placement):
    """Many steps with several in flight, slots reused every few steps, commits interleaved;
    every step's output is compared with the reference afterwards."""
    steps = int(os.environ.get("TRACE_REPLAY_SOAK_STEPS", 100_000))
    if placement == "host_mapped":
        steps //= 10
    max_slots, max_len, batch, vocab = 64, 48, 32, 50_000
    # Host plan of the whole run: batch layouts and per-slot lengths per step.
    idx_all = rng.integers(-1, max_slots, (steps, batch)).astype(np.int32)
    base_all = rng.integers(0, vocab, (steps, batch)).astype(np.int64)
    prompt = rng.integers(1, 30, max_slots).astype(np.int32)
    step_of = rng.integers(-2, max_len + 2, max_slots).astype(np.int32)
    idx_dev = torch.from_numpy(idx_all).to(DEV)
    base_dev = torch.from_numpy(base_all).to(DEV)
    out_dev = torch.full((steps, batch), POISON, dtype=torch.int64, device=DEV)
    total_all = np.empty((steps, max_slots), np.int32)
    total = torch.zeros(max_slots, dtype=torch.int32, device=DEV)
    prompt_dev = torch.from_numpy(prompt).to(DEV)
    table = np.zeros((max_slots, max_len), np.int32)
    lens = np.zeros(max_slots, np.int32)
    tables = []  # (first step, table copy, lens copy) whenever the committed state changes
    sampled = torch.empty(batch, dtype=torch.int64, device=DEV)
    idx = torch.empty(batch, dtype=torch.int32, device=DEV)
    with TraceReplayState(
        max_slots, max_len, device=DEV, placement=placement, total_len=total, prompt_len=prompt_dev, staging_depth=3
    ) as st:
        for k in range(steps):
            if k % 4 == 0:  # requests finish and new ones take their slots
                admit_requests(rng, st.add_request, table, lens, step_of, count=3, vocab=vocab)
                st.apply_staged_writes()
                tables.append((k, table.copy(), lens.copy()))
            step_of += 1
            total_all[k] = prompt + step_of
            if k % 2000 == 0:
                torch.cuda._sleep(2_000_000)  # let a queue of steps build up behind the device
            total.copy_(torch.from_numpy(total_all[k]).pin_memory(), non_blocking=True)
            idx.copy_(idx_dev[k])
            sampled.copy_(base_dev[k])
            st.replay(sampled, idx)
            out_dev[k].copy_(sampled)
        out = out_dev.cpu().numpy()
    mismatches, forced, first = check_soak(out, base_all, idx_all, total_all, prompt, tables)
    assert mismatches == 0, f"{mismatches} mismatching rows over {steps} steps; first at {first}"
    assert forced > steps  # most steps really replayed something
    print(f"soak {placement}: {steps} steps, {forced} forced tokens, 0 mismatches")


def _rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.alone
def test_create_close_cycles_do_not_leak():
    from cuda.bindings import driver as cu

    torch.cuda.synchronize()
    cycles = int(os.environ.get("TRACE_REPLAY_LIFETIME_CYCLES", 10_000))

    def cycle():
        t = TraceTable(16, 256, device=DEV, staging_bytes=64 * 1024, staging_depth=2)
        t.stage(3, [1, 2, 3])
        t.commit(stream=0)
        t.close()

    for _ in range(50):
        cycle()
    free0, rss0 = cu.cuMemGetInfo()[1], _rss_bytes()
    for _ in range(cycles):
        cycle()
    free1, rss1 = cu.cuMemGetInfo()[1], _rss_bytes()
    print(f"{cycles} cycles: device free {free0 - free1:+d} B, host RSS {rss1 - rss0:+d} B")
    # a leak of one cycle's buffers would be >= 10,000 x 128 KiB = 1.2 GiB of pinned host memory
    assert abs(free0 - free1) < 16 * 2**20
    assert rss1 - rss0 < 64 * 2**20


def test_garbage_collected_state_waits_for_queued_reads():
    """Dropping an unclosed table while a queued kernel still reads it: no crash, right result."""
    t = TraceTable(8, 1024, device=DEV)
    tr = np.arange(1, 1025) * 7
    t.stage(5, tr)
    stream = torch.cuda.current_stream().cuda_stream
    t.commit(stream=stream)
    sampled = torch.full((3,), POISON, dtype=torch.int64, device=DEV)
    idx = torch.tensor([5, 5, -1], dtype=torch.int32, device=DEV)
    step = torch.tensor([0, 1023, 0], dtype=torch.int32, device=DEV)
    torch.cuda._sleep(200_000_000)  # the replay below waits behind ~0.1 s of spinning
    t.replay_at_step(sampled, idx, step, stream=stream)
    del t
    gc.collect()  # close() from the finaliser: waits for the device first
    torch.empty(64 * 2**20, dtype=torch.uint8, device=DEV).fill_(0xAB)  # reuse freed memory
    assert sampled.tolist() == [7, 1024 * 7, POISON]


def test_staging_from_many_threads():
    max_slots, max_len, threads, per_thread = 64, 512, 8, 200
    t = TraceTable(max_slots, max_len, device=DEV, staging_bytes=4096)
    rngs = [np.random.default_rng(s) for s in range(threads)]
    last, staged = {}, {}
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def worker(i):
        barrier.wait()
        for j in range(per_thread):
            slot = i * (max_slots // threads) + j % (max_slots // threads)  # own slots per thread
            tr = rngs[i].integers(0, 10_000, int(rngs[i].integers(1, max_len + 1)))
            t.stage(slot, tr)
            with lock:
                last[slot] = tr
                staged[slot] = staged.get(slot, 0) + 1

    run_threads(worker, threads)
    t.commit(stream=torch.cuda.current_stream().cuda_stream)
    table, lens = t.snapshot()
    t.close()
    # every slot was seen, as often as the threads' loops say (a thread that stopped early shows)
    assert staged == {s: per_thread // (max_slots // threads) for s in range(max_slots)}, staged
    for slot in range(max_slots):
        tr = last[slot]
        assert lens[slot] == len(tr), f"slot {slot}"
        assert_tokens_equal(table[slot, : len(tr)], tr, f"slot {slot}")
