"""Writes staged but not applied: a replay warns once per state, naming ``apply_staged_writes``;
``strict=True`` raises instead and replays nothing. Both frameworks, on the CPU.

Before: ``add_request`` (or ``remove_request``) followed by ``replay`` without
``apply_staged_writes()`` replayed the traces of the last apply, silently: a new trace was not
replayed and a removed one still was. The JAX state is also checked where a jitted step gets
its tables: reading ``state.tables`` with writes pending warns (``strict``: raises).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import trace_replay_jax as trj
import trace_replay_torch as trt
from trace_replay_core import StagedWritesWarning

POISON = 2**30 + 7
FIX = (
    r"Call state\.apply_staged_writes\(\) (first|before {call}); "
    r"TraceReplayState\(\.\.\., strict=True\) makes this an error$"
)


def _message(call: str, what: str) -> str:
    return (
        rf"^{what} while add_request/remove_request writes are staged but not applied: .*the traces "
        rf"of the last apply \(a new trace is not replayed, a removed one still is\)\. " + FIX.format(call=call)
    )


# -- torch ---------------------------------------------------------------------------------------
def _torch_state(rng, **kw):
    prompt = torch.tensor(rng.integers(0, 9, 4), dtype=torch.int32)
    total = prompt.clone()
    total[1] += 2  # slot 1 at step 2
    return trt.TraceReplayState(4, 8, device="cpu", total_len=total, prompt_len=prompt, **kw)


def _torch_step(state, call):
    sampled = torch.full((2,), POISON, dtype=torch.int64)
    idx = torch.tensor([1, 3], dtype=torch.int32)
    if call == "replay":
        return state.replay(sampled, idx)
    return state.replay_at_step(sampled, idx, torch.tensor([2, 0], dtype=torch.int32))


@pytest.mark.parametrize("call", ["replay", "replay_at_step"])
@pytest.mark.parametrize("stage", ["add_request", "remove_request", "add_requests"])
def test_torch_replay_with_staged_writes_warns_once_per_state(rng, call, stage):
    trace = rng.integers(0, 1000, 5)
    with _torch_state(rng) as state:
        state.add_request(1, trace)
        state.apply_staged_writes()
        assert _torch_step(state, call).tolist() == [trace[2], POISON]
        if stage == "add_request":
            state.add_request(1, rng.integers(0, 1000, 5))
        elif stage == "remove_request":
            state.remove_request(1)
        else:
            state.add_requests([1, 2], rng.integers(0, 1000, (2, 5)))
        with pytest.warns(StagedWritesWarning, match=_message(call, rf"state\.{call}\(\) ran")) as caught:
            out = _torch_step(state, call)
        assert caught[0].filename == __file__  # points at the caller's line
        assert out.tolist() == [trace[2], POISON]  # the traces of the last apply
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _torch_step(state, call)  # once per state
        state.apply_staged_writes()
        state.add_request(1, trace)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _torch_step(state, call)  # warned once already: silent
    with _torch_state(rng) as other:  # another state warns again
        other.add_request(0, [1])
        with pytest.warns(StagedWritesWarning):
            _torch_step(other, call)


@pytest.mark.parametrize("call", ["replay", "replay_at_step"])
def test_torch_strict_raises_and_replays_nothing(rng, call):
    trace = rng.integers(0, 1000, 5)
    with _torch_state(rng, strict=True) as state:
        assert state.strict
        state.add_request(1, trace)
        sampled = torch.full((2,), POISON, dtype=torch.int64)
        with pytest.raises(RuntimeError, match=_message(call, rf"state\.{call}\(\) ran")):
            if call == "replay":
                state.replay(sampled, torch.tensor([1, 3], dtype=torch.int32))
            else:
                state.replay_at_step(sampled, torch.tensor([1, 3], dtype=torch.int32), torch.tensor([2, 0]))
        assert sampled.tolist() == [POISON, POISON] and state.table.pending == 1
        with pytest.raises(RuntimeError, match=r"^state\.replay\(\) ran"):  # every time, not once
            trt.replay_op(state, sampled, torch.tensor([1, 3], dtype=torch.int32))
        state.apply_staged_writes()
        assert _torch_step(state, call).tolist() == [trace[2], POISON]


_I64, _I32 = torch.int64, torch.int32
TORCH_REJECTED = {
    "replay-float-idx": (
        lambda st: st.replay(torch.zeros(2, dtype=_I64), torch.tensor([1.0, 3.0])),
        TypeError,
        r"^idx_mapping must have dtype int32 or int64 \(got float32\)$",
    ),
    "replay-list-idx": (
        lambda st: st.replay(torch.zeros(2, dtype=_I64), [1, 3]),
        TypeError,
        r"^idx_mapping must be a torch\.Tensor \(got list\)$",
    ),
    "replay-short-total_len": (
        lambda st: st.replay(
            torch.zeros(2, dtype=_I64),
            torch.tensor([1, 3], dtype=_I32),
            torch.zeros(2, dtype=_I32),
            torch.zeros(4, dtype=_I32),
        ),
        ValueError,
        r"^total_len must have at least 4 entries \(got shape \[2\]\)$",
    ),
    "replay_at_step-list-step": (
        lambda st: st.replay_at_step(torch.zeros(2, dtype=_I64), torch.tensor([1, 3], dtype=_I32), [2, 0]),
        TypeError,
        r"^step must be a torch\.Tensor \(got list\)$",
    ),
    "replay_at_step-long-step": (
        lambda st: st.replay_at_step(
            torch.zeros(2, dtype=_I64), torch.tensor([1, 3], dtype=_I32), torch.zeros(3, dtype=_I32)
        ),
        ValueError,
        r"^step must have 2 rows \(got shape \[3\]\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(TORCH_REJECTED))
def test_torch_a_rejected_replay_leaves_the_warning_to_the_next_replay(rng, case):
    """A replay refused for its arguments does not use up the state's one warning: the next
    replay that runs with the writes still staged warns (before, it replayed stale traces silently)."""
    call, exc, pattern = TORCH_REJECTED[case]
    trace = rng.integers(0, 1000, 5)
    with _torch_state(rng) as state:
        state.add_request(1, trace)  # staged, not applied: slot 1 has no trace yet
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StagedWritesWarning)  # whether the refused call warns is not the point
            with pytest.raises(exc, match=pattern):
                call(state)
        what = case.split("-")[0]
        with pytest.warns(StagedWritesWarning, match=_message(what, rf"state\.{what}\(\) ran")):
            assert _torch_step(state, what).tolist() == [POISON, POISON]  # the traces of the last apply
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _torch_step(state, what)  # then once per state, as before


def test_torch_applied_writes_never_warn(rng):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _torch_state(rng, strict=True) as state:
            for _ in range(3):
                state.add_request(1, rng.integers(0, 1000, 5))
                state.remove_request(2)
                state.apply_staged_writes()
                _torch_step(state, "replay")
                _torch_step(state, "replay_at_step")


def test_torch_a_staged_write_applied_by_the_core_does_not_warn(rng):
    """The flag is a hint: the table's own count decides (another thread may have applied)."""
    with _torch_state(rng, strict=True) as state:
        state.add_request(1, [1, 2, 3])
        state.table.commit(stream=0)
        _torch_step(state, "replay")


@pytest.mark.parametrize("strict", [0, 1, "yes", None])
def test_strict_must_be_a_bool(strict):
    with pytest.raises(TypeError, match=rf"^strict must be True or False \(got {strict!r}\)$"):
        trt.TraceReplayState(2, 2, device="cpu", strict=strict)
    with pytest.raises(TypeError, match=rf"^strict must be True or False \(got {strict!r}\)$"):
        trj.TraceReplayState(2, 2, device="cpu", strict=strict)


# -- JAX -----------------------------------------------------------------------------------------
def _jax_args():
    sampled = jnp.full(2, POISON, jnp.int32)
    idx = jnp.array([1, 3], jnp.int32)
    total, prompt = jnp.array([0, 2, 0, 0], jnp.int32), jnp.zeros(4, jnp.int32)
    return sampled, idx, total, prompt


def _jax_step(state, call):
    sampled, idx, total, prompt = _jax_args()
    if call == "replay":
        return state.replay(sampled, idx, total, prompt)
    if call == "replay_at_step":
        return state.replay_at_step(sampled, idx, jnp.array([2, 0], jnp.int32))
    return trj.replay(state.tables, sampled, idx, total, prompt)


_JAX_WHAT = {"replay": r"state\.replay\(\) ran", "replay_at_step": r"state\.replay_at_step\(\) ran"}
_JAX_WHAT["tables"] = r"state\.tables was read"


@pytest.mark.parametrize("call", ["replay", "replay_at_step", "tables"])
@pytest.mark.parametrize("stage", ["add_request", "remove_request", "add_requests"])
def test_jax_replay_with_staged_writes_warns_once_per_state(rng, call, stage):
    trace = rng.integers(0, 1000, 5)
    with trj.TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(1, trace)
        state.apply_staged_writes()
        assert np.asarray(_jax_step(state, call)).tolist() == [trace[2], POISON]
        if stage == "add_request":
            state.add_request(1, rng.integers(0, 1000, 5))
        elif stage == "remove_request":
            state.remove_request(1)
        else:
            state.add_requests([1, 2], rng.integers(0, 1000, (2, 5)))
        with pytest.warns(StagedWritesWarning, match=_message("", _JAX_WHAT[call])) as caught:
            out = _jax_step(state, call)
        assert caught[0].filename == __file__
        assert np.asarray(out).tolist() == [trace[2], POISON]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _jax_step(state, call)
            _jax_step(state, "tables")  # once per state, whichever call found it


@pytest.mark.parametrize("call", ["replay", "replay_at_step", "tables"])
def test_jax_strict_raises_and_changes_nothing(rng, call):
    trace = rng.integers(0, 1000, 5)
    with trj.TraceReplayState(4, 8, device="cpu", strict=True) as state:
        assert state.strict
        state.add_request(1, trace)
        tables = state._tables
        with pytest.raises(RuntimeError, match=_message("", _JAX_WHAT[call])):
            _jax_step(state, call)
        assert state.pending == 1 and state._tables is tables
        state.apply_staged_writes()
        assert np.asarray(_jax_step(state, call)).tolist() == [trace[2], POISON]


def test_jax_jitted_step_is_checked_where_it_gets_its_tables(rng):
    """A compiled program cannot check a host flag: the read of state.tables does, at every
    call (strict), before the program runs."""
    step = jax.jit(lambda t, s, i, tl, pl: trj.replay(t, s, i, tl, pl))
    trace = rng.integers(0, 1000, 5)
    with trj.TraceReplayState(4, 8, device="cpu", strict=True) as state:
        state.add_request(1, trace)
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"^state\.tables was read while"):
                step(state.tables, *_jax_args())
        state.apply_staged_writes()
        assert np.asarray(step(state.tables, *_jax_args())).tolist() == [trace[2], POISON]
