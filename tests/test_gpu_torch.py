"""GPU tier: the torch adapter and the core on a CUDA device, against the numpy reference.

Skipped with a reason on machines without a GPU (see conftest.py).
"""

from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_tokens_equal, random_scenario  # noqa: E402

from trace_replay_core import TraceTable, replay_reference  # noqa: E402
from trace_replay_torch import TraceReplayState  # noqa: E402

pytestmark = pytest.mark.gpu
PLACEMENTS = ["device", "host_mapped"]
DEV = "cuda"


def _state(sc, max_slots, max_len, placement, **kw):
    st = TraceReplayState(max_slots, max_len, device=DEV, placement=placement, **kw)
    for slot, tr in sc["traces"].items():
        st.add_request(slot, tr)
    st.apply_staged_writes()
    return st


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("batch", [1, 5, 100, 1024])
@pytest.mark.parametrize("sampled_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_matches_reference(rng, placement, batch, sampled_dtype, index_dtype):
    max_slots, max_len = 67, 300
    sc = random_scenario(rng, max_slots=max_slots, max_trace_len=max_len, batch=batch)
    total = torch.from_numpy(sc["total_len"]).to(DEV, index_dtype)
    prompt = torch.from_numpy(sc["prompt_len"]).to(DEV, index_dtype)
    idx = torch.from_numpy(sc["idx"]).to(DEV, index_dtype)
    with _state(sc, max_slots, max_len, placement, total_len=total, prompt_len=prompt) as st:
        table, lens = st.table.snapshot()
        for slot, tr in sc["traces"].items():
            assert lens[slot] == len(tr) and np.array_equal(table[slot, : len(tr)], tr)
        sampled = torch.from_numpy(sc["sampled"]).to(DEV, sampled_dtype)
        st.replay(sampled, idx)
        expected = replay_reference(
            sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
        )
        assert_tokens_equal(sampled.cpu().numpy(), expected)
        sampled = torch.from_numpy(sc["sampled"]).to(DEV, sampled_dtype)
        st.replay_at_step(sampled, idx, torch.from_numpy(sc["step"]).to(DEV, index_dtype))
        assert_tokens_equal(
            sampled.cpu().numpy(),
            replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], step=sc["step"]),
            "per-row step",
        )


def test_gpu_refuses_host_arrays_and_other_devices():
    z = torch.zeros(8, dtype=torch.int32, device=DEV)
    with TraceReplayState(8, 8, device=DEV, total_len=z, prompt_len=z) as st:
        with pytest.raises(ValueError, match=r"^sampled must be on cuda:0 \(got cpu\)$"):
            st.replay(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32, device=DEV))
        with pytest.raises(ValueError, match=r"^idx_mapping must be on cuda:0 \(got cpu\)$"):
            st.replay(torch.zeros(2, dtype=torch.int64, device=DEV), torch.zeros(2, dtype=torch.int32))


class _Simulation:
    """Continuous batching on the host mirror: which slot holds which trace, per-slot lengths."""

    def __init__(self, rng, max_slots, max_len, vocab=30_000):
        self.rng, self.max_slots, self.max_len, self.vocab = rng, max_slots, max_len, vocab
        self.table = np.zeros((max_slots, max_len), np.int32)
        self.lens = np.zeros(max_slots, np.int32)
        self.prompt = np.zeros(max_slots, np.int64)
        self.total = np.zeros(max_slots, np.int64)
        self.active = set()

    def admit(self, st, slot):
        """A new request takes ``slot``: traced or free, with its own prompt length."""
        self.prompt[slot] = self.total[slot] = int(self.rng.integers(1, 50))
        if self.rng.random() < 0.7:
            tr = self.rng.integers(0, self.vocab, int(self.rng.integers(1, self.max_len + 1)))
            st.add_request(slot, tr)
            self.table[slot, : len(tr)] = tr
            self.lens[slot] = len(tr)
        else:
            st.add_request(slot, None)
            self.lens[slot] = 0
        self.active.add(slot)

    def step_inputs(self):
        rows = sorted(self.active)
        self.rng.shuffle(rows)
        pad = int(self.rng.integers(0, 4))
        idx = np.array(rows + [-1] * pad, np.int32)
        sampled = self.rng.integers(0, self.vocab, len(idx))
        expected = replay_reference(sampled, idx, self.table, self.lens, self.total, self.prompt)
        return idx, sampled, expected

    def advance(self):
        for slot in list(self.active):
            self.total[slot] += 1
            if self.rng.random() < 0.08:
                self.active.discard(slot)


def _run_queued_steps(rng, st, sim, total_dev, steps, stream):
    """Queue ``steps`` decode steps without synchronising; return (outputs, expectations)."""
    outs, exps = [], []
    for _ in range(steps):
        free = [s for s in range(sim.max_slots) if s not in sim.active]
        for slot in rng.permutation(free)[: int(rng.integers(0, 3))]:
            sim.admit(st, int(slot))
        st.apply_staged_writes()
        idx, sampled, expected = sim.step_inputs()
        # New tensors every step, uploaded without a host sync.
        total_dev.copy_(torch.from_numpy(sim.total.astype(np.int32)).pin_memory(), non_blocking=True)
        s = torch.from_numpy(sampled).pin_memory().to(DEV, non_blocking=True)
        i = torch.from_numpy(idx).pin_memory().to(DEV, non_blocking=True)
        st.replay(s, i)
        outs.append(s)
        exps.append((sampled, expected))
        sim.advance()
    return outs, exps


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_many_steps_queued_with_slot_reuse(rng, placement):
    max_slots, max_len = 48, 64
    sim = _Simulation(rng, max_slots, max_len)
    total_dev = torch.zeros(max_slots, dtype=torch.int32, device=DEV)
    prompt_dev = torch.zeros(max_slots, dtype=torch.int32, device=DEV)
    with TraceReplayState(
        max_slots, max_len, device=DEV, placement=placement, total_len=total_dev, prompt_len=prompt_dev, staging_depth=2
    ) as st:
        # prompt lengths change only on admission; keep a device copy in sync without host waits
        orig_admit = sim.admit

        def admit(st_, slot):
            orig_admit(st_, slot)
            prompt_dev[slot] = int(sim.prompt[slot])

        sim.admit = admit
        outs, exps = _run_queued_steps(rng, st, sim, total_dev, 400, None)
        torch.cuda.synchronize()
        forced = 0
        for k, (o, (base, e)) in enumerate(zip(outs, exps)):
            assert_tokens_equal(o.cpu().numpy(), e, f"step {k}")
            forced += int((e != base).sum())
        assert forced > 100  # the run really replayed, not only left rows alone


def test_non_default_stream(rng):
    max_slots, max_len, batch = 32, 100, 300
    sc = random_scenario(rng, max_slots=max_slots, max_trace_len=max_len, batch=batch)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        total = torch.from_numpy(sc["total_len"]).to(DEV)
        prompt = torch.from_numpy(sc["prompt_len"]).to(DEV)
        with _state(sc, max_slots, max_len, "device", total_len=total, prompt_len=prompt) as st:
            torch.cuda._sleep(20_000_000)  # keep the side stream busy: ordering must hold anyway
            sampled = torch.from_numpy(sc["sampled"]).to(DEV)
            st.replay(sampled, torch.from_numpy(sc["idx"]).to(DEV))
            result = sampled.cpu()  # ordered after the replay on this stream
    expected = replay_reference(
        sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
    )
    assert_tokens_equal(result.numpy(), expected)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_cuda_graph_sees_commits_between_replays(rng, placement):
    max_slots, max_len, batch = 16, 32, 64
    total = torch.zeros(max_slots, dtype=torch.int32, device=DEV)
    prompt = torch.zeros(max_slots, dtype=torch.int32, device=DEV)
    sampled = torch.zeros(batch, dtype=torch.int64, device=DEV)
    idx = torch.zeros(batch, dtype=torch.int32, device=DEV)
    with TraceReplayState(
        max_slots, max_len, device=DEV, placement=placement, total_len=total, prompt_len=prompt
    ) as st:
        st.replay(sampled, idx)  # compile and bind before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            st.replay(sampled, idx)
        table = np.zeros((max_slots, max_len), np.int32)
        lens = np.zeros(max_slots, np.int32)
        for rnd in range(20):
            for slot in rng.choice(max_slots, size=3, replace=False):
                if rng.random() < 0.25:
                    st.add_request(int(slot), None)
                    lens[slot] = 0
                else:
                    tr = rng.integers(0, 10_000, int(rng.integers(1, max_len + 1)))
                    st.add_request(int(slot), tr)
                    table[slot, : len(tr)] = tr
                    lens[slot] = len(tr)
            st.apply_staged_writes()  # outside the graph, on the current stream
            idx_np = rng.integers(-1, max_slots, batch).astype(np.int32)
            tot_np = rng.integers(0, max_len + 2, max_slots).astype(np.int32)
            base = rng.integers(10_000, 20_000, batch)
            idx.copy_(torch.from_numpy(idx_np))
            total.copy_(torch.from_numpy(tot_np))
            sampled.copy_(torch.from_numpy(base))
            graph.replay()
            expected = replay_reference(base, idx_np, table, lens, tot_np, np.zeros(max_slots, np.int32))
            assert_tokens_equal(sampled.cpu().numpy(), expected, f"graph replay {rnd}")


def test_commit_refused_during_capture():
    z = torch.zeros(4, dtype=torch.int32, device=DEV)
    with TraceReplayState(4, 4, device=DEV, total_len=z, prompt_len=z) as st:
        st.add_request(0, [1])
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=r"^commit\(\) cannot be captured into a CUDA graph"):
            with torch.cuda.graph(graph):
                st.apply_staged_writes()
        assert st.table.pending == 1  # refused: still staged
        st.apply_staged_writes()
        assert st.table.pending == 0


def _guard_scenario(rng, guard: bool):
    """Hold the stream busy, then stage and commit many times into a 2-deep staging ring.

    Every commit writes distinct tokens to its own slot at the same staging offsets, so reusing a
    staging buffer before its copy ran would put a later commit's tokens into an earlier slot.
    """
    max_slots, max_len, commits = 24, 4096, 24
    t = TraceTable(max_slots, max_len, device=DEV, staging_depth=2)
    backend: Any = t._backend  # the GPU backend: its staging ring and guard
    if not guard:  # what the guard prevents: pretend every earlier copy already ran
        for pair in backend.ring.pairs:
            pair.event.done = lambda: True
    stream = torch.cuda.current_stream().cuda_stream
    traces = [rng.integers(0, 2**30, max_len) for _ in range(commits)]
    torch.cuda._sleep(400_000_000)  # ~0.2 s of spinning ahead of every copy
    for slot, tr in enumerate(traces):
        t.stage(slot, tr)
        t.commit(stream=stream)
    table, lens = t.snapshot()
    waits = backend.ring.guard_waits
    t.close()
    wrong = [slot for slot, tr in enumerate(traces) if not np.array_equal(table[slot], tr)]
    return wrong, waits


def test_staging_guard_keeps_in_flight_buffers_intact(rng):
    wrong, waits = _guard_scenario(rng, guard=True)
    assert wrong == []
    assert waits > 0  # the ring wrapped while copies were still queued: the guard had to wait


def test_staging_without_guard_corrupts(rng):
    """Evidence that the previous test can fail: with the guard disabled, traces get mixed up."""
    wrong, _ = _guard_scenario(rng, guard=False)
    assert wrong, "disabling the guard should have corrupted at least one trace"


@pytest.mark.alone
def test_close_frees_memory_and_is_idempotent():
    from cuda.bindings import driver as cu

    torch.cuda.synchronize()

    def free_bytes():
        return cu.cuMemGetInfo()[1]

    before = free_bytes()
    t = TraceTable(1024, 32768, device=DEV)  # 128 MiB table
    during = free_bytes()
    t.close()
    t.close()
    after = free_bytes()
    assert before - during >= 128 * 2**20
    assert abs(after - before) < 8 * 2**20
