"""Token ids that are not what they look like are refused by name, never silently changed.

- torch: a trace given as a float tensor (one that requires grad cannot even be exported over
  DLPack: before, a bare ``BufferError``) is refused naming ``trace`` and its dtype; the core
  turns any failed DLPack export of a trace into a ``TypeError`` naming the argument.
- JAX with ``jax_enable_x64`` off: an int64 numpy array is turned into int32 by keeping the low
  32 bits, so the token id ``2**32 + 5`` was scored as token 5 and the slot ``2**32 + 1`` read as
  slot 1. Such arrays are refused, naming the argument, the value and what JAX would have read;
  with x64 on they pass as they are (an id outside the vocabulary scores NaN / -1, as documented).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.jax_helpers import x64

import trace_replay_jax as trj
import trace_replay_torch as trt
from trace_replay_core import TraceTable


# -- torch traces --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, pattern",
    [
        (
            lambda st: st.add_request(0, torch.ones(3, requires_grad=True)),
            r"^trace must hold integer token ids \(got a torch\.float32 tensor, which requires grad\): "
            r"pass the sampled or recorded ids as an integer tensor$",
        ),
        (
            lambda st: st.add_request(0, torch.ones(3, dtype=torch.float64)),
            r"^trace must hold integer token ids \(got a torch\.float64 tensor\)",
        ),
        (
            lambda st: st.add_request(0, torch.ones(3, dtype=torch.bool)),
            r"^trace must hold integer token ids \(got a torch\.bool tensor\)",
        ),
        (
            lambda st: st.add_requests([0, 1], torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True)),
            r"^traces must hold integer token ids \(got a torch\.bfloat16 tensor, which requires grad\)",
        ),
        (
            lambda st: st.add_requests([0, 1], [[1, 2], torch.ones(2, requires_grad=True)]),
            r"^traces\[1\] must hold integer token ids \(got a torch\.float32 tensor, which requires grad\)",
        ),
    ],
)
def test_torch_trace_that_is_not_integer_ids_is_refused_by_name(call, pattern):
    with trt.TraceReplayState(4, 4, device="cpu") as state:
        state.add_request(2, [7])
        with pytest.raises(TypeError, match=pattern):
            call(state)
        assert state.table.pending == 1  # a rejected call changes nothing


class _Unexportable:
    """A host array whose DLPack export fails, as torch's does for a tensor that requires grad."""

    dtype = "float32"

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kw):
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")


def test_core_names_a_trace_whose_dlpack_export_fails():
    with TraceTable(2, 4, device="cpu") as table:
        with pytest.raises(
            TypeError,
            match=r"^tokens must be 1-D integer token ids on the host; could not read the _Unexportable "
            r"of dtype float32 over DLPack: Can't export tensors that require gradient",
        ):
            table.stage(0, _Unexportable())
        assert table.pending == 0


# -- JAX: int64 numpy arrays without x64 ---------------------------------------------------------
def _wrapped(name, value, index, read):
    return (
        rf"^{name} holds {value} at index {index}, which int32 cannot hold: with jax_enable_x64 off "
        rf"JAX converts this int64 numpy array to int32 and would read {read} instead; pass values "
        rf"that fit int32, or enable x64 \(jax\.config\.update\('jax_enable_x64', True\)\)"
    )


@pytest.mark.parametrize("method", ["kernel", "jnp"])
@pytest.mark.parametrize("shape", [(3,), (3, 1)])
def test_logprob_token_ids_int32_cannot_hold_are_refused_without_x64(rng, method, shape):
    logits = jnp.asarray(rng.standard_normal((3, 10)), jnp.float32)
    ids = np.array([1, 2**32 + 5, 2], np.int64).reshape(shape)
    with x64(False):
        with pytest.raises(ValueError, match=_wrapped("token_ids", 2**32 + 5, 1, 5)):
            trj.token_logprob_rank(logits, ids, method=method)
        with pytest.raises(ValueError, match=_wrapped("token_ids", -(2**31) - 1, 0, 2**31 - 1)):
            jax.jit(lambda x: trj.token_logprob_rank(x, np.array([-(2**31) - 1, 0, 0]), method=method))(logits)
        ok = np.array([1, 2**31 - 1, -(2**31)], np.int64).reshape(shape)  # fits: scored out of range
        lp, rk = trj.token_logprob_rank(logits, ok, method=method)
        assert np.isfinite(np.asarray(lp)[0]) and np.isnan(np.asarray(lp)[1:]).all()
        assert np.asarray(rk)[1:].tolist() == [-1, -1]
    with x64(True):  # int64 stays int64: the id is outside the vocabulary, scored NaN / -1
        lp, rk = trj.token_logprob_rank(jnp.asarray(logits), ids, method=method)
        assert np.isnan(np.asarray(lp)[1]) and int(np.asarray(rk)[1]) == -1


REPLAY_NAMES = ("sampled", "idx_mapping", "total_len", "prompt_len")


@pytest.mark.parametrize("bad", range(4))
def test_replay_arrays_int32_cannot_hold_are_refused_without_x64(bad):
    big = 2**32 + 1  # read as 1 without the check: slot 1, or a valid step
    with trj.TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(1, [40, 41, 42])
        state.apply_staged_writes()
        args = [np.array([7, 8], np.int64), np.array([-1, 3], np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64)]
        args[bad][1 if bad < 2 else 3] = big
        index = 1 if bad < 2 else 3
        with x64(False):
            pattern = _wrapped(REPLAY_NAMES[bad], big, index, 1)
            with pytest.raises(ValueError, match=pattern):
                state.replay(*args)
            with pytest.raises(ValueError, match=pattern):
                trj.replay(state.tables, *args, method="kernel")
            with pytest.raises(ValueError, match=pattern):  # numpy constants inside the caller's jit
                jax.jit(lambda t: trj.replay(t, *args))(state.tables)
            args[bad][index] = 1
            assert np.asarray(state.replay(*args)).shape == (2,)


def test_replay_at_step_step_int32_cannot_hold_is_refused_without_x64():
    with trj.TraceReplayState(4, 8, device="cpu") as state:
        state.add_request(1, [40, 41, 42])
        state.apply_staged_writes()
        sampled, idx = np.array([7, 8], np.int64), np.array([1, 1], np.int64)
        with x64(False):
            with pytest.raises(ValueError, match=_wrapped("step", 2**33 + 2, 0, 2)):
                state.replay_at_step(sampled, idx, np.array([2**33 + 2, 0], np.int64))
        with x64(True):  # int64 kept: the step is past the trace, the row keeps its token
            out = state.replay_at_step(sampled, idx, np.array([2**33 + 2, 0], np.int64))
            assert np.asarray(out).tolist() == [7, 40]


@pytest.mark.parametrize("trace", [np.array([5, 2**32 + 5], np.int64), [5, 2**32 + 5]])
def test_trace_int32_cannot_hold_is_refused_by_staging(trace):
    """Traces never went through JAX's conversion: staging checks int64 ids before it casts."""
    with trj.TraceReplayState(4, 8, device="cpu") as state:
        with pytest.raises(ValueError, match=r"^tokens must be below 2\*\*31 \(got 4294967301 at index 1\)$"):
            state.add_request(0, trace)
        assert state.pending == 0


def test_sharded_logprob_token_ids_int32_cannot_hold_are_refused_without_x64(rng):
    """``token_logprob_rank_sharded`` makes the unsharded function's check (before: the id
    ``2**32 + 5`` was scored as token 5, silently)."""
    from jax.sharding import Mesh

    from trace_replay_jax.sharded import token_logprob_rank_sharded

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("vocab",))
    logits = jnp.asarray(rng.standard_normal((3, 10)), jnp.float32)
    ids = np.array([1, 2**32 + 5, 2], np.int64)
    with x64(False):
        with pytest.raises(ValueError, match=_wrapped("token_ids", 2**32 + 5, 1, 5)):
            token_logprob_rank_sharded(logits, ids, mesh=mesh, vocab_axis="vocab")
        lp, rk = token_logprob_rank_sharded(logits, np.array([1, 7, 2], np.int64), mesh=mesh, vocab_axis="vocab")
        want_lp, want_rk = trj.token_logprob_rank(logits, np.array([1, 7, 2], np.int32), method="jnp")
        np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), rtol=2e-6, atol=2e-6)
        np.testing.assert_array_equal(np.asarray(rk), np.asarray(want_rk))
