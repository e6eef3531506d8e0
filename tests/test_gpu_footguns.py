"""GPU tier of #39's cases 2, 4, 6 and 7: what the CPU tier checks, where only a GPU shows it.

- Staged writes not applied (torch): the check waits for nothing: a replay that warns (or,
  strict, refuses) returns while the stream is still busy with a kernel queued before it.
- JAX devices: ``device=None`` follows ``jax.default_device(...)`` (a CPU state on a GPU
  machine), and an argument committed to the CPU for a GPU state is named with both devices.
- Closed-over tables with every other argument constant are refused on a GPU as on the CPU,
  with both methods; a closed state's tables are refused by both methods (``test_jax_kernel_replay``).

Skipped with a reason on machines without a GPU (see conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.jax_helpers import jax_gpu
from jax.extend.backend import get_default_device

import trace_replay_jax as trj
import trace_replay_torch as trt
from trace_replay_core import StagedWritesWarning

pytestmark = pytest.mark.gpu
POISON = 2**30 + 7
SPIN = 400_000_000  # clock cycles of torch.cuda._sleep: a fraction of a second on the stream


def _torch_state(trace, **kw):
    prompt = torch.zeros(4, dtype=torch.int32, device="cuda")
    total = prompt.clone()
    total[1] = 2  # slot 1 at step 2
    state = trt.TraceReplayState(4, 8, device="cuda", total_len=total, prompt_len=prompt, **kw)
    state.add_request(1, trace)
    state.apply_staged_writes()
    return state


@pytest.mark.parametrize("strict", [False, True])
def test_gpu_torch_staged_writes_check_waits_for_nothing(rng, strict):
    trace = rng.integers(0, 1000, 5)
    with _torch_state(trace, strict=strict) as state:
        sampled = torch.full((2,), POISON, dtype=torch.int64, device="cuda")
        idx = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
        state.replay(sampled, idx)  # compiles the kernel
        torch.cuda.synchronize()
        state.add_request(1, rng.integers(0, 1000, 5))  # staged, not applied
        sampled.fill_(POISON)
        torch.cuda._sleep(SPIN)
        busy = torch.cuda.Event()
        busy.record()
        if strict:
            with pytest.raises(RuntimeError, match=r"^state\.replay\(\) ran while add_request/remove_request"):
                state.replay(sampled, idx)
        else:
            with pytest.warns(StagedWritesWarning, match=r"^state\.replay\(\) ran while add_request/remove_request"):
                state.replay(sampled, idx)
        assert not busy.query(), "the check waited for the device"
        torch.cuda.synchronize()
        assert sampled.tolist() == ([POISON, POISON] if strict else [trace[2], POISON])
        state.apply_staged_writes()


def test_gpu_jax_device_none_follows_jax_default_device():
    gpu = jax_gpu()
    cpu = jax.devices("cpu")[0]
    with trj.TraceReplayState(2, 4) as state:
        assert state.device == get_default_device()
    with jax.default_device(cpu):
        with trj.TraceReplayState(2, 4) as state:
            assert state.device == cpu and state.tables.table.devices() == {cpu}
    with jax.default_device(gpu):
        with trj.TraceReplayState(2, 4) as state:
            assert state.device == gpu and state.tables.table.devices() == {gpu}


@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_gpu_jax_argument_on_the_cpu_is_named_with_both_devices(method):
    gpu = jax_gpu()
    cpu = jax.devices("cpu")[0]
    with trj.TraceReplayState(4, 8, device=gpu) as state:
        state.add_request(1, [40, 41, 42])
        state.apply_staged_writes()
        args = [jnp.array([7, 8], jnp.int32), jnp.array([1, 3], jnp.int32)]
        args += [jnp.array([0, 6, 0, 0], jnp.int32), jnp.array([0, 5, 0, 0], jnp.int32)]
        args = [jax.device_put(a, gpu) for a in args]
        args[1] = jax.device_put(args[1], cpu)
        with pytest.raises(
            ValueError,
            match=rf"^idx_mapping is on cpu:0 but the state's tables are on {gpu}: put idx_mapping on the "
            r"state's device \(jax\.device_put\(idx_mapping, state\.device\)\)",
        ):
            state.replay(*args, method=method)
        args[1] = jax.device_put(args[1], gpu)
        assert np.asarray(state.replay(*args, method=method)).tolist() == [41, 8]


@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_gpu_jax_closed_over_tables_with_constant_arguments_are_refused(method):
    gpu = jax_gpu()
    with trj.TraceReplayState(4, 8, device=gpu) as state:
        state.add_request(1, [40, 41, 42])
        state.apply_staged_writes()
        consts = (np.array([7, 8], np.int32), np.array([1, 3], np.int32), np.array([0, 6, 0, 0], np.int32))
        consts += (np.array([0, 5, 0, 0], np.int32),)
        with pytest.raises(
            ValueError,
            match=r"^tables must be passed into the jitted function as an argument \(got a concrete array "
            r"while JAX traces the function that calls replay\)",
        ):
            jax.jit(lambda: trj.replay(state.tables, *consts, method=method))()
        step = jax.jit(lambda t: trj.replay(t, *consts, method=method))  # the fix: tables passed in
        assert np.asarray(step(state.tables)).tolist() == [41, 8]
        state.add_request(1, [50, 51, 52])
        state.apply_staged_writes()
        assert np.asarray(step(state.tables)).tolist() == [51, 8]  # reads the live table
