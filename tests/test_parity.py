"""Cross-framework parity: one randomised scenario, every path, bit-identical tokens.

Paths: the numpy reference, the torch adapter, the JAX adapter eagerly, inside ``jax.jit``
(one step per call) and inside ``lax.fori_loop`` (several steps per call, the table written
between calls), each with both replay methods (``"jnp"``: gather and select; ``"kernel"``: the
core's kernel through a buffer callback, numpy on the CPU). Fresh arrays every step, as in a
real loop. Seeds are fresh each run and printed on failure. The CPU tier runs everything on
the CPU; the GPU tier on the GPU.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.jax_helpers import jax_gpu, x64
from helpers.replay_oracle import scenario_tokens
from helpers.scenarios import Scenario, Step, make_scenario, reference_tokens

import trace_replay_jax as trj

# The scenarios stage writes and replay before applying them on purpose (the reference
# replays the traces of the last apply): the StagedWritesWarning that gives is expected here.
pytestmark = pytest.mark.filterwarnings("ignore::trace_replay_core.StagedWritesWarning")

LOOP_STEPS = 6  # steps per lax.fori_loop call (shorter runs end early: a dynamic trip count)
METHODS = ("jnp", "kernel")
MODES = ("eager", "jit", "fori")


def _seed(rng) -> int:
    """A scenario seed from the suite's ``rng`` fixture (fresh each run, reproducible through
    TRACE_REPLAY_TEST_SEED), or from the OS outside pytest."""
    if rng is None:
        return int(os.environ.get("TRACE_REPLAY_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    return int(rng.integers(2**32))


def _apply_ops(state, step: Step) -> None:
    for op in step.ops:
        if op[0] == "stage":
            state.add_request(op[1], op[2])
        elif op[0] == "clear":
            state.remove_request(op[1])
        else:
            state.apply_staged_writes()


def _check(scenario: Scenario, name: str, got: list[np.ndarray], per_row: bool) -> None:
    want = scenario_tokens(scenario, per_row)  # not the library's numpy replay: "kernel" runs it on the CPU
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g).reshape(-1).astype(np.int64)
        if not np.array_equal(g, w):
            bad = np.nonzero(g != w)[0]
            step = scenario.steps[t]
            raise AssertionError(
                f"{name} (per_row={per_row}) differs from the reference at step {t}, rows {bad.tolist()}: "
                f"got {g[bad].tolist()}, want {w[bad].tolist()}; idx_mapping {step.idx_mapping[bad].tolist()}; "
                f"{scenario.describe()}"
            )


# -- drivers --------------------------------------------------------------------------------------
def run_jax(
    scenario: Scenario, mode: str, per_row: bool, device, token_dtype, placement: str = "device", method: str = "jnp"
) -> list[np.ndarray]:
    """``mode``: "eager" (state.replay), "jit" (one jitted call per step) or "fori" (runs of
    steps without state operations inside one ``lax.fori_loop`` call); ``method``: the replay
    method ("jnp" or "kernel")."""
    put = lambda x, dt=None: jax.device_put(np.asarray(x, dtype=dt), device)  # noqa: E731
    out: list[np.ndarray] = []
    with trj.TraceReplayState(
        scenario.max_slots, scenario.max_trace_len, device=device, vocab_size=scenario.vocab_size, placement=placement
    ) as state:
        if mode == "jit":
            if per_row:
                fn = jax.jit(lambda t, s, i, st: trj.replay_at_step(t, s, i, st, method=method))
            else:
                fn = jax.jit(lambda t, s, i, tl, pl: trj.replay(t, s, i, tl, pl, method=method))
        if mode == "fori":

            def loop(tables, s, i, a, b, n):
                def body(k, acc):
                    if per_row:
                        r = trj.replay_at_step(tables, s[k], i[k], a[k], method=method)
                    else:
                        r = trj.replay(tables, s[k], i[k], a[k], b[k], method=method)
                    return acc.at[k].set(r)

                return jax.lax.fori_loop(0, n, body, jnp.zeros_like(s))

            fn = jax.jit(loop)
            t = 0
            steps = scenario.steps
            while t < len(steps):
                _apply_ops(state, steps[t])
                run = [steps[t]]
                while len(run) < LOOP_STEPS and t + len(run) < len(steps) and not steps[t + len(run)].ops:
                    run.append(steps[t + len(run)])
                pad = run + [run[-1]] * (LOOP_STEPS - len(run))
                stack = lambda f, dt=None, pad=pad: put(np.stack([f(s) for s in pad]), dt)  # noqa: E731
                res = fn(
                    state.tables,
                    stack(lambda s: s.sampled, token_dtype),
                    stack(lambda s: s.idx_mapping),
                    stack(lambda s: s.step if per_row else s.total_len),
                    stack(lambda s: s.prompt_len),
                    np.int32(len(run)),
                )
                out.extend(np.asarray(res)[: len(run)])
                t += len(run)
            return out
        for step in scenario.steps:
            _apply_ops(state, step)
            s, i = put(step.sampled, token_dtype), put(step.idx_mapping)
            if mode == "eager":
                r = (
                    state.replay_at_step(s, i, put(step.step), method=method)
                    if per_row
                    else state.replay(s, i, put(step.total_len), put(step.prompt_len), method=method)
                )
            elif per_row:
                r = fn(state.tables, s, i, put(step.step))
            else:
                r = fn(state.tables, s, i, put(step.total_len), put(step.prompt_len))
            assert r.dtype == np.dtype(token_dtype)
            out.append(np.asarray(r))
    return out


def run_torch(scenario: Scenario, per_row: bool, device: str) -> list[np.ndarray]:
    from trace_replay_torch import TraceReplayState

    out = []
    with TraceReplayState(
        scenario.max_slots, scenario.max_trace_len, device=device, vocab_size=scenario.vocab_size
    ) as state:
        for step in scenario.steps:
            _apply_ops(state, step)
            s = torch.tensor(step.sampled, dtype=torch.int64, device=device)
            i = torch.tensor(step.idx_mapping, dtype=torch.int32, device=device)
            if per_row:
                state.replay_at_step(s, i, torch.tensor(step.step, device=device))
            else:
                state.replay(
                    s, i, torch.tensor(step.total_len, device=device), torch.tensor(step.prompt_len, device=device)
                )
            out.append(s.cpu().numpy())
    return out


# -- CPU tier -------------------------------------------------------------------------------------
def test_scenario_exercises_every_case(rng):
    """The generator really produces what the parity tests claim to cover."""
    sc = make_scenario(_seed(rng), n_steps=120)
    ops = [op for s in sc.steps for op in s.ops]
    staged = [op[1] for op in ops if op[0] == "stage"]
    assert len(staged) > len(set(staged)), "no slot reused"
    assert any(op[0] == "clear" for op in ops)
    steps = np.concatenate([s.step[(s.idx_mapping >= 0) & (s.idx_mapping < sc.max_slots)] for s in sc.steps])
    assert (steps < 0).any() and (steps >= sc.max_trace_len).any() and ((steps >= 0) & (steps < 4)).any()
    assert any((s.idx_mapping == -1).any() for s in sc.steps)
    want = scenario_tokens(sc)
    for per_row in (False, True):  # the library's reference agrees with the one written here
        for t, (w, r) in enumerate(zip(scenario_tokens(sc, per_row), reference_tokens(sc, per_row))):
            assert np.array_equal(w, r), f"step {t} per_row={per_row}: {sc.describe()}"
    replaced = sum(int((w != s.sampled).sum()) for w, s in zip(want, sc.steps))
    kept = sum(int((w == s.sampled).sum()) for w, s in zip(want, sc.steps))
    assert replaced > 20 and kept > 20


@pytest.mark.parametrize("per_row", [False, True], ids=["per_slot", "per_row"])
def test_parity_cpu(per_row, rng):
    cpu = jax.devices("cpu")[0]
    sc = make_scenario(_seed(rng))
    _check(sc, "torch", run_torch(sc, per_row, "cpu"), per_row)
    for method in METHODS:
        for mode in MODES:
            _check(sc, f"jax {mode} {method}", run_jax(sc, mode, per_row, cpu, np.int32, method=method), per_row)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_parity_cpu_int64_under_x64(mode, method, rng):
    cpu = jax.devices("cpu")[0]
    sc = make_scenario(_seed(rng), n_steps=40)
    with x64(True):
        got = run_jax(sc, mode, False, cpu, np.int64, method=method)
    _check(sc, f"jax {mode} {method} x64", got, False)


# -- GPU tier -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [False, True], ids=["per_slot", "per_row"])
def test_parity_gpu(per_row, rng):
    gpu = jax_gpu()
    sc = make_scenario(_seed(rng), max_slots=40, max_trace_len=64, batch=33, n_steps=150)
    if torch.cuda.is_available():
        _check(sc, "torch cuda", run_torch(sc, per_row, f"cuda:{gpu.local_hardware_id}"), per_row)
    for method in METHODS:
        for mode in MODES:
            _check(sc, f"jax gpu {mode} {method}", run_jax(sc, mode, per_row, gpu, np.int32, method=method), per_row)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_parity_gpu_int64_under_x64(mode, method, rng):
    gpu = jax_gpu()
    sc = make_scenario(_seed(rng), n_steps=60)
    with x64(True):
        got = run_jax(sc, mode, False, gpu, np.int64, method=method)
    _check(sc, f"jax gpu {mode} {method} x64", got, False)


@pytest.mark.gpu
def test_parity_gpu_host_mapped_table(rng):
    gpu = jax_gpu()
    sc = make_scenario(_seed(rng), n_steps=60)
    for method in METHODS:
        for mode in ("eager", "fori"):
            got = run_jax(sc, mode, False, gpu, np.int32, placement="host_mapped", method=method)
            _check(sc, f"jax gpu host_mapped {mode} {method}", got, False)


def parity_main(device_kind: str) -> None:
    """Entry point for a subprocess (e.g. with other XLA flags): every JAX path, one scenario."""
    device = jax.devices(device_kind)[0]
    sc = make_scenario(_seed(None), n_steps=60)
    for per_row in (False, True):
        for method in METHODS:
            for mode in MODES:
                _check(
                    sc,
                    f"jax {device_kind} {mode} {method}",
                    run_jax(sc, mode, per_row, device, np.int32, method=method),
                    per_row,
                )
    print("parity ok", sc.describe())


if __name__ == "__main__":
    import sys

    parity_main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
