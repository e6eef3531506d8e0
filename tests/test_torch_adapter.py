"""CPU tier: the torch adapter on CPU tensors (same code path as on the GPU, numpy backend)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trace_replay_core import replay_reference  # noqa: E402
from trace_replay_torch import TraceReplayState  # noqa: E402

from helpers import assert_tokens_equal, random_scenario  # noqa: E402


def _state(sc, max_slots, max_len, device="cpu", **kw):
    st = TraceReplayState(max_slots, max_len, device=device, **kw)
    for slot, tr in sc["traces"].items():
        st.add_request(slot, torch.from_numpy(tr) if slot % 2 else tr.tolist())
    st.apply_staged_writes()
    return st


@pytest.mark.parametrize("batch", [1, 5, 100, 1024])
@pytest.mark.parametrize("sampled_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_adapter_matches_reference(rng, batch, sampled_dtype, index_dtype):
    max_slots, max_len = 33, 17
    sc = random_scenario(rng, max_slots=max_slots, max_trace_len=max_len, batch=batch)
    total = torch.from_numpy(sc["total_len"]).to(index_dtype)
    prompt = torch.from_numpy(sc["prompt_len"]).to(index_dtype)
    idx = torch.from_numpy(sc["idx"]).to(index_dtype)
    with _state(sc, max_slots, max_len, total_len=total, prompt_len=prompt) as st:
        sampled = torch.from_numpy(sc["sampled"]).to(sampled_dtype)
        out = st.replay(sampled, idx)
        assert out is sampled and out.dtype == sampled_dtype
        expected = replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"],
                                    sc["prompt_len"])
        assert_tokens_equal(sampled.numpy(), expected)
        sampled2 = torch.from_numpy(sc["sampled"]).to(sampled_dtype)
        st.replay(sampled2, idx, total, prompt)
        assert_tokens_equal(sampled2.numpy(), expected, "explicit lengths")
        sampled3 = torch.from_numpy(sc["sampled"]).to(sampled_dtype)
        st.replay_at_step(sampled3, idx, torch.from_numpy(sc["step"]).to(index_dtype))
        assert_tokens_equal(sampled3.numpy(),
                            replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], step=sc["step"]),
                            "per-row step")


def test_new_buffers_and_reused_buffers_every_step(rng):
    """The adapter caches bound launches per array layout: both fresh and reused buffers must
    replay the values they hold now."""
    max_slots, max_len, batch = 12, 9, 40
    sc = random_scenario(rng, max_slots=max_slots, max_trace_len=max_len, batch=batch)
    total = torch.from_numpy(sc["total_len"]).clone()
    prompt = torch.from_numpy(sc["prompt_len"]).clone()
    reused_sampled = torch.empty(batch, dtype=torch.int64)
    reused_idx = torch.empty(batch, dtype=torch.int32)
    with _state(sc, max_slots, max_len, total_len=total, prompt_len=prompt) as st:
        for step in range(12):
            idx_np = rng.integers(-1, max_slots, batch).astype(np.int32)
            base = rng.integers(0, 50_000, batch)
            total += 1  # the loop advanced every slot; bound lengths are read on the device
            expected = replay_reference(base, idx_np, sc["table"], sc["trace_len"], total.numpy(), prompt.numpy())
            fresh = torch.from_numpy(base.copy())
            st.replay(fresh, torch.from_numpy(idx_np.copy()))
            assert_tokens_equal(fresh.numpy(), expected, f"fresh buffers, step {step}")
            reused_sampled.copy_(torch.from_numpy(base))
            reused_idx.copy_(torch.from_numpy(idx_np))
            st.replay(reused_sampled, reused_idx)
            assert_tokens_equal(reused_sampled.numpy(), expected, f"reused buffers, step {step}")


def test_none_trace_clears_a_reused_slot():
    z = torch.zeros(4, dtype=torch.int32)
    with TraceReplayState(4, 4, device="cpu", total_len=z, prompt_len=z) as st:
        st.add_request(1, [8, 9])
        st.apply_staged_writes()
        s = torch.tensor([0])
        st.replay(s, torch.tensor([1]))
        assert s.tolist() == [8]
        st.add_request(1, None)   # the next request in slot 1 samples freely
        st.apply_staged_writes()
        s = torch.tensor([0])
        st.replay(s, torch.tensor([1]))
        assert s.tolist() == [0]


def test_add_requests_matches_add_request(rng):
    """A block and a ragged list through ``add_requests`` replay like one ``add_request`` each."""
    max_slots, max_len, batch = 32, 24, 40
    block = rng.integers(0, 50_000, (12, 17))
    ragged = [torch.from_numpy(rng.integers(0, 50_000, int(rng.integers(1, max_len + 1)))) for _ in range(6)]
    slots = rng.permutation(max_slots)[:18].tolist()
    lengths = {s: torch.from_numpy(rng.integers(0, 30, max_slots).astype(np.int32)) for s in ("total", "prompt")}
    many = TraceReplayState(max_slots, max_len, device="cpu", total_len=lengths["total"], prompt_len=lengths["prompt"])
    one = TraceReplayState(max_slots, max_len, device="cpu", total_len=lengths["total"], prompt_len=lengths["prompt"])
    many.add_requests(slots[:12], torch.from_numpy(block))
    many.add_requests(slots[12:], ragged)
    for slot, tr in zip(slots, list(block) + ragged):
        one.add_request(slot, tr)
    sampled = rng.integers(0, 50_000, batch)
    idx = torch.from_numpy(rng.integers(-1, max_slots, batch).astype(np.int32))
    outs = []
    for st in (many, one):
        st.apply_staged_writes()
        out = torch.from_numpy(sampled.copy())
        st.replay(out, idx)
        outs.append(out.numpy())
    assert_tokens_equal(outs[0], outs[1], "add_requests vs add_request")
    on_device = r"^traces\[0\] must be host data .*got a tensor on meta: pass traces\[0\]\.cpu\(\)"
    with pytest.raises(ValueError, match=on_device):
        many.add_requests([0], [torch.empty(3, dtype=torch.int64, device="meta")])
    assert many.table.pending == 0


ADAPTER_REFUSALS = {
    "device-trace": (lambda st: st.add_request(0, torch.empty(3, dtype=torch.int64, device="meta")),
                     ValueError, r"^trace must be host data \(list, numpy array or CPU tensor\); got a tensor on meta: pass trace.cpu\(\) \(a host sync you choose to make\)$"),
    "no-bound-lengths": (lambda st: TraceReplayState(4, 4, device="cpu").replay(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)),
                         ValueError, r"^total_len and prompt_len were neither given nor bound \(see bind_lengths\)$"),
    "one-length-only": (lambda st: st.replay(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), total_len=torch.zeros(4, dtype=torch.int32)),
                        ValueError, r"^give both total_len and prompt_len, or neither \(to use the bound ones\)$"),
    "bad-device": (lambda st: TraceReplayState(4, 4, device="meta"), ValueError, r"^device must be a cpu or cuda device \(got meta\)$"),
    "bind-one-length": (lambda st: TraceReplayState(4, 4, device="cpu", total_len=torch.zeros(4, dtype=torch.int32)),
                        ValueError, r"^give both total_len and prompt_len, or neither$"),
    "bound-too-short": (lambda st: st.bind_lengths(torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),
                        ValueError, r"^total_len must have at least 4 entries \(got shape \[2\]\)$"),
    "requires-grad-float": (lambda st: st.replay(torch.zeros(2, requires_grad=True), torch.zeros(2, dtype=torch.int32)),
                            (TypeError, RuntimeError, ValueError), r"(sampled|gradient)"),
}


@pytest.mark.parametrize("case", sorted(ADAPTER_REFUSALS))
def test_adapter_refusals_change_nothing(case):
    call, exc, pattern = ADAPTER_REFUSALS[case]
    z = torch.zeros(4, dtype=torch.int32)
    st = TraceReplayState(4, 4, device="cpu", total_len=z, prompt_len=z)
    st.add_request(2, [1, 2, 3])
    st.apply_staged_writes()
    st.add_request(3, [4])
    before = st.table.snapshot(), st.table.pending
    with pytest.raises(exc, match=pattern):
        call(st)
    after = st.table.snapshot(), st.table.pending
    assert np.array_equal(before[0][0], after[0][0]) and np.array_equal(before[0][1], after[0][1])
    assert before[1] == after[1] == 1
    st.close()
