"""CPU tier: what torch's autograd sees of a replay that writes ``sampled`` in place.

A replay writes ``sampled`` through its data pointer, so torch cannot see the write; the adapter
bumps ``sampled``'s version after it (method and op). Before, a tensor that autograd had saved
(``logits.gather(1, sampled[:, None])``) was replayed into and the backward silently put the
gradient at the replayed token; now it raises torch's in-place error. A rejected call writes
nothing and bumps nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_replay_torch import TraceReplayState, replay_at_step_op, replay_op

TRACE = [40, 41, 42, 43]
INPLACE = r"one of the variables needed for gradient computation has been modified by an inplace operation"


def _state():
    """Slot 3 traced at step 2 (token 42); slot 1 untraced."""
    total = torch.tensor([0, 5, 0, 9], dtype=torch.int32)
    prompt = torch.tensor([0, 5, 0, 7], dtype=torch.int32)
    st = TraceReplayState(4, 8, device="cpu", total_len=total, prompt_len=prompt)
    st.add_request(3, TRACE)
    st.apply_staged_writes()
    return st


CALLS = {
    "replay": lambda st, s, idx: st.replay(s, idx),
    "replay-explicit-lengths": lambda st, s, idx: st.replay(s, idx, *st._bound_lengths()),
    "replay_at_step": lambda st, s, idx: st.replay_at_step(s, idx, torch.tensor([0, 2], dtype=torch.int32)),
    "replay_op": lambda st, s, idx: replay_op(st, s, idx),
    "replay_op-explicit-lengths": lambda st, s, idx: replay_op(st, s, idx, *st._bound_lengths()),
    "replay_at_step_op": lambda st, s, idx: replay_at_step_op(st, s, idx, torch.tensor([0, 2], dtype=torch.int32)),
    "torch.ops.trace_replay.replay": lambda st, s, idx: torch.ops.trace_replay.replay(
        s, idx, *st._bound_lengths(), st.op_id
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_replay_bumps_the_version_so_autograd_refuses_a_stale_saved_tensor(rng, call):
    with _state() as st:
        logits = torch.from_numpy(rng.standard_normal((2, 50)).astype(np.float32)).requires_grad_(True)
        sampled = torch.tensor([7, 9])
        idx = torch.tensor([1, 3], dtype=torch.int32)
        picked = logits.gather(1, sampled[:, None]).sum()  # autograd saves sampled (version 0)
        before = sampled._version
        CALLS[call](st, sampled, idx)
        assert sampled.tolist() == [7, 42] and sampled._version > before
        with pytest.raises(RuntimeError, match=INPLACE):
            picked.backward()


@pytest.mark.parametrize("call", ["replay", "replay_at_step", "replay_op"])
def test_a_rejected_replay_bumps_nothing(call):
    with _state() as st:
        sampled = torch.tensor([7, 9])
        with pytest.raises((TypeError, ValueError), match=r"idx_mapping"):
            CALLS[call](st, sampled, torch.tensor([1.0, 3.0]))
        assert sampled.tolist() == [7, 9] and sampled._version == 0


def test_a_tensor_made_in_inference_mode_is_replayed_in_and_out_of_it():
    """Such a tensor has no version counter to bump: the replay writes it as before, also outside
    inference mode (where torch's own in-place ops refuse it)."""
    idx = torch.tensor([1, 3], dtype=torch.int32)
    with torch.inference_mode():
        inside, outside = torch.tensor([7, 9]), torch.tensor([8, 6])
    with _state() as st:
        with torch.inference_mode():
            st.replay(inside, idx)
        st.replay_at_step(outside, idx, torch.tensor([0, 1], dtype=torch.int32))
    assert inside.is_inference() and inside.tolist() == [7, 42] and outside.tolist() == [8, 41]
