"""CPU tier: the torch adapter on CPU tensors (same code path as on the GPU, numpy backend)."""

import numpy as np
import pytest
import torch
from helpers import POISON, assert_tokens_equal, random_scenario  # noqa: E402

from trace_replay_core import replay_reference  # noqa: E402
from trace_replay_torch import (  # noqa: E402
    TraceReplayState,
    registry,  # noqa: E402
    replay_at_step_op,
    replay_op,
    token_logprob_rank_op,
)


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
        expected = replay_reference(
            sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
        )
        assert_tokens_equal(sampled.numpy(), expected)
        sampled2 = torch.from_numpy(sc["sampled"]).to(sampled_dtype)
        st.replay(sampled2, idx, total, prompt)
        assert_tokens_equal(sampled2.numpy(), expected, "explicit lengths")
        sampled3 = torch.from_numpy(sc["sampled"]).to(sampled_dtype)
        st.replay_at_step(sampled3, idx, torch.from_numpy(sc["step"]).to(index_dtype))
        assert_tokens_equal(
            sampled3.numpy(),
            replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], step=sc["step"]),
            "per-row step",
        )


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
    total = torch.tensor([0, 4, 0, 0], dtype=torch.int32)
    prompt = torch.tensor([0, 3, 0, 0], dtype=torch.int32)  # slot 1 is at step 1
    with TraceReplayState(4, 4, device="cpu", total_len=total, prompt_len=prompt) as st:
        st.add_request(1, [8, 9])
        st.apply_staged_writes()
        s = torch.tensor([POISON])
        st.replay(s, torch.tensor([1]))
        assert s.tolist() == [9]
        st.add_request(1, None)  # the next request in slot 1 samples freely
        st.apply_staged_writes()
        s = torch.tensor([POISON])
        st.replay(s, torch.tensor([1]))
        assert s.tolist() == [POISON], "a cleared slot still replays"


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
    "device-trace": (
        lambda st: st.add_request(0, torch.empty(3, dtype=torch.int64, device="meta")),
        ValueError,
        r"^trace must be host data \(list, numpy array or CPU tensor\); got a tensor on meta: "
        r"pass trace.cpu\(\) \(a host sync you choose to make\)$",
    ),
    "no-bound-lengths": (
        lambda st: TraceReplayState(4, 4, device="cpu").replay(
            torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)
        ),
        ValueError,
        r"^total_len and prompt_len were neither given nor bound \(see bind_lengths\)$",
    ),
    "one-length-only": (
        lambda st: st.replay(
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int32),
            total_len=torch.zeros(4, dtype=torch.int32),
        ),
        ValueError,
        r"^give both total_len and prompt_len, or neither \(to use the bound ones\)$",
    ),
    "bad-device": (
        lambda st: TraceReplayState(4, 4, device="meta"),
        ValueError,
        r"^device must be a cpu or cuda device \(got meta\)$",
    ),
    "bind-one-length": (
        lambda st: TraceReplayState(4, 4, device="cpu", total_len=torch.zeros(4, dtype=torch.int32)),
        ValueError,
        r"^give both total_len and prompt_len, or neither$",
    ),
    "bound-too-short": (
        lambda st: st.bind_lengths(torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),
        ValueError,
        r"^total_len must have at least 4 entries \(got shape \[2\]\)$",
    ),
    "requires-grad-float": (
        lambda st: st.replay(torch.zeros(2, requires_grad=True), torch.zeros(2, dtype=torch.int32)),
        (TypeError, RuntimeError, ValueError),
        r"(sampled|gradient)",
    ),
    "step-not-a-tensor": (
        lambda st: st.replay_at_step(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), [0, 1]),
        TypeError,
        r"^step must be a torch\.Tensor \(got list\)$",
    ),
    "step-op-not-a-tensor": (
        lambda st: replay_at_step_op(st, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), 3),
        TypeError,
        r"^step must be a torch\.Tensor \(got int\)$",
    ),
    "idx-not-a-tensor": (
        lambda st: st.replay(torch.zeros(2, dtype=torch.int64), [2, 0]),
        TypeError,
        r"^idx_mapping must be a torch\.Tensor \(got list\)$",
    ),
    "sampled-not-a-tensor": (
        lambda st: st.replay(np.zeros(2, np.int64), torch.zeros(2, dtype=torch.int32)),
        TypeError,
        r"^sampled must be a torch\.Tensor \(got ndarray\)$",
    ),
    "explicit-length-not-a-tensor": (
        lambda st: st.replay(
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int32),
            [0] * 4,
            torch.zeros(4, dtype=torch.int32),
        ),
        TypeError,
        r"^total_len must be a torch\.Tensor \(got list\)$",
    ),
    "bind-not-a-tensor": (
        lambda st: st.bind_lengths(np.zeros(4, np.int32), torch.zeros(4, dtype=torch.int32)),
        TypeError,
        r"^total_len must be a torch\.Tensor \(got ndarray\)$",
    ),
    "repeated-slot-list": (
        lambda st: st.add_requests([0, 3, 1, 3], [[1], [2], [3], [4]]),
        ValueError,
        r"^slots gives slot 3 twice \(positions 1 and 3\): each request takes its own slot$",
    ),
    "repeated-slot-first-repeat": (
        lambda st: st.add_requests([1, 0, 0, 1], np.ones((4, 2), np.int64)),
        ValueError,
        r"^slots gives slot 0 twice \(positions 1 and 2\): each request takes its own slot$",
    ),
    "repeated-slot-tensor": (
        lambda st: st.add_requests(torch.tensor([2, 1, 2]), torch.ones(3, 3, dtype=torch.int64)),
        ValueError,
        r"^slots gives slot 2 twice \(positions 0 and 2\): each request takes its own slot$",
    ),
    "repeated-invalid-slot": (
        lambda st: st.add_requests([5, 5], [[1], [2]]),
        ValueError,
        r"^slots\[0\] must be in \[0, 4\) \(got 5\)$",
    ),
    "op-not-a-state": (
        lambda st: replay_op(st.op_id, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)),
        TypeError,
        r"^state must be a trace_replay_torch\.TraceReplayState \(got int\)$",
    ),
}


# Each case keeps a write staged, not applied, on purpose: a replay then warns (StagedWritesWarning).
@pytest.mark.filterwarnings("ignore::trace_replay_core.StagedWritesWarning")
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)])
def test_cuda_without_a_gpu_is_the_cores_device_error(device):
    """``"cuda"`` and ``"cuda:0"`` give one error: the core's, naming the device and the fix."""
    with pytest.raises(
        ValueError,
        match=r"^device 'cuda(:0)?' is not available: this process sees 0 CUDA "
        r"device\(s\); use device='cpu' for the CPU backend$",
    ):
        TraceReplayState(4, 4, device=device)


def _closed_calls():
    i32, i64 = torch.int32, torch.int64
    z = torch.zeros(4, dtype=i32)
    s, idx = torch.zeros(2, dtype=i64), torch.zeros(2, dtype=i32)
    return {
        "add_request": lambda st: st.add_request(0, [1, 2]),
        "add_request-none": lambda st: st.add_request(0, None),
        "add_requests": lambda st: st.add_requests([0, 1], [[1], [2]]),
        "add_requests-repeated": lambda st: st.add_requests([0, 0], [[1], [2]]),
        "remove_request": lambda st: st.remove_request(0),
        "apply_staged_writes": lambda st: st.apply_staged_writes(),
        "bind_lengths": lambda st: st.bind_lengths(z, z),
        "replay": lambda st: st.replay(s, idx),
        "replay-explicit-lengths": lambda st: st.replay(s, idx, z, z),
        "replay-not-tensors": lambda st: st.replay([0, 0], [0, 0]),
        "replay_at_step": lambda st: st.replay_at_step(s, idx, idx),
        "replay_at_step-list-step": lambda st: st.replay_at_step(s, idx, [0, 0]),
        "__enter__": lambda st: st.__enter__(),
        "replay_op": lambda st: replay_op(st, s, idx),
        "replay_op-explicit-lengths": lambda st: replay_op(st, s, idx, z, z),
        "replay_at_step_op": lambda st: replay_at_step_op(st, s, idx, idx),
    }


CLOSED_CALLS = _closed_calls()


def test_closed_table_covers_every_method():
    methods = {
        name for name, value in vars(TraceReplayState).items() if callable(value) and not name.startswith("_")
    } | {"__enter__"}
    assert methods - {"close"} <= {case.split("-")[0] for case in CLOSED_CALLS}


@pytest.mark.parametrize("case", sorted(CLOSED_CALLS))
@pytest.mark.parametrize("bound", [True, False])
def test_every_method_of_a_closed_state_says_so(case, bound):
    z = torch.zeros(4, dtype=torch.int32)
    st = TraceReplayState(4, 4, device="cpu", **(dict(total_len=z, prompt_len=z) if bound else {}))
    st.add_request(1, [3])
    st.apply_staged_writes()
    st.replay(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), z, z)  # a cached replay
    st.close()
    with pytest.raises(RuntimeError, match=r"^this TraceReplayState is closed$"):
        CLOSED_CALLS[case](st)
    assert st.closed and st.table.closed
    st.close()  # still idempotent


def test_an_op_with_a_closed_states_id_names_it():
    z = torch.zeros(4, dtype=torch.int32)
    st = TraceReplayState(4, 4, device="cpu", total_len=z, prompt_len=z)
    state_id = st.op_id
    assert registry.lookup(state_id) is st
    st.close()
    s = torch.tensor([5, 6])
    message = rf"^this TraceReplayState is closed \(op id {state_id}: closed, garbage collected or never opened\)"
    with pytest.raises(RuntimeError, match=message):
        torch.ops.trace_replay.replay(s, torch.zeros(2, dtype=torch.int32), z, z, state_id)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.trace_replay.replay_at_step(s, torch.zeros(2, dtype=torch.int32), z[:2], state_id)
    assert s.tolist() == [5, 6]
    with pytest.raises(RuntimeError, match=r"^this TraceReplayState is closed \(op id 0: "):
        registry.lookup(0)


def test_op_ids_are_unique_and_collected_states_leave_the_registry():
    import gc

    states = [TraceReplayState(2, 2, device="cpu") for _ in range(3)]
    ids = [st.op_id for st in states]
    assert len(set(ids)) == 3 and ids == sorted(ids)
    last = ids[-1]
    del states
    gc.collect()
    with pytest.raises(RuntimeError, match=rf"^this TraceReplayState is closed \(op id {last}: "):
        registry.lookup(last)
    assert TraceReplayState(2, 2, device="cpu").op_id > last  # never reused


def test_logprob_op_refuses_non_tensors():
    with pytest.raises(TypeError, match=r"^token_ids must be a torch\.Tensor \(got list\)$"):
        token_logprob_rank_op(torch.zeros(2, 5), [0, 1])
