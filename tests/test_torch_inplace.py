"""CPU tier: what torch's autograd and ``torch.func`` see of a replay that writes ``sampled`` in place.

- The version counter: a replay writes ``sampled`` through its data pointer, so torch cannot see
  the write; the adapter bumps ``sampled``'s version after it (method and op). Before, a tensor
  that autograd had saved (``logits.gather(1, sampled[:, None])``) was replayed into and the
  backward silently put the gradient at the replayed token; now it raises torch's in-place
  error. A rejected call writes nothing and bumps nothing.
- ``torch.vmap``: the replay ops already replay a whole batch; a vmap over them (or over the
  methods) is refused with a message that says to fold the mapped axis into the batch, instead
  of "Cannot access data pointer of Tensor that doesn't have storage" or torch's generic
  batching-rule error. Under other ``torch.func`` transforms (``grad``) the methods run as the
  registered op.
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
        with pytest.raises(TypeError, match=r"^idx_mapping must have dtype int32 or int64 \(got float32\)$"):
            CALLS[call](st, sampled, torch.tensor([1.0, 3.0]))
        assert sampled.tolist() == [7, 9] and sampled._version == 0


VMAP = (
    r"^trace_replay_torch's {op} \(state\.{op}, {op}_op\) does not support torch\.vmap: it already replays "
    r"a whole batch\. Call it on the batched tensors instead \(fold the mapped axis into the batch axis: "
    r"{names} as \[n \* batch\]\), without vmap$"
)


@pytest.mark.parametrize("call", ["replay", "replay_op", "replay_at_step", "replay_at_step_op"])
def test_vmap_over_a_replay_is_refused_naming_what_to_do(call):
    op, names = (
        ("replay_at_step", "sampled, idx_mapping and step") if "step" in call else ("replay", "sampled and idx_mapping")
    )
    with _state() as st:
        sampled = torch.tensor([[7, 9], [8, 6]])
        idx = torch.tensor([[1, 3], [3, 1]], dtype=torch.int32)
        with pytest.raises(ValueError, match=VMAP.format(op=op, names=names)):
            torch.vmap(lambda s, i: CALLS[call](st, s, i))(sampled, idx)
        assert sampled.tolist() == [[7, 9], [8, 6]] and sampled._version == 0
        st.replay(sampled.reshape(-1), idx.reshape(-1))  # what the message says: one batch of n * batch
        assert sampled.tolist() == [[7, 42], [42, 6]]


@pytest.mark.parametrize("call", ["replay", "replay_at_step"])
def test_the_methods_run_as_the_op_under_torch_func_grad(rng, call):
    """Under ``torch.func.grad`` the tokens drawn from the logits are wrapped tensors without
    storage: the method runs as the registered op (before: "Cannot access data pointer")."""
    logits = torch.from_numpy(rng.standard_normal((2, 50)).astype(np.float32))
    idx = torch.tensor([1, 3], dtype=torch.int32)
    with _state() as st:

        def loss(x):
            sampled = torch.argmax(x, dim=-1)
            CALLS[call](st, sampled, idx)
            return x.gather(1, sampled[:, None]).sum()

        grad = torch.func.grad(loss)(logits)
    assert grad.nonzero().tolist() == [[0, int(logits[0].argmax())], [1, 42]]


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
