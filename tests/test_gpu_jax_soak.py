"""GPU tier: a soak through the JAX adapter (shorter than the torch one).

Many jitted steps queued without waiting, slots reused every few steps, staged writes applied
between steps on XLA's stream; every step's output compared with the reference afterwards.
Length set by ``TRACE_REPLAY_JAX_SOAK_STEPS`` (default 20,000).
"""

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import trace_replay_jax as trj  # noqa: E402
from trace_replay_core import replay_reference  # noqa: E402
from trace_replay_jax import TraceReplayState  # noqa: E402

pytestmark = pytest.mark.gpu


def test_jax_soak(rng):
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"no CUDA device visible to JAX ({exc})")
    steps = int(os.environ.get("TRACE_REPLAY_JAX_SOAK_STEPS", 20_000))
    max_slots, max_len, batch, vocab = 64, 48, 32, 50_000
    idx_all = rng.integers(-1, max_slots, (steps, batch)).astype(np.int32)
    base_all = rng.integers(0, vocab, (steps, batch)).astype(np.int32)
    prompt = rng.integers(1, 30, max_slots).astype(np.int32)
    step_of = rng.integers(-2, max_len + 2, max_slots).astype(np.int32)
    total_all = np.empty((steps, max_slots), np.int32)
    table = np.zeros((max_slots, max_len), np.int32)
    lens = np.zeros(max_slots, np.int32)
    tables = []

    @jax.jit
    def step(tables_, sampled, idx, total, prompt_):
        return trj.replay(tables_, sampled, idx, total, prompt_)

    prompt_dev = jax.device_put(prompt, gpu)
    outs = []
    with TraceReplayState(max_slots, max_len, device=gpu, vocab_size=vocab) as state:
        for k in range(steps):
            if k % 4 == 0:
                for slot in rng.choice(max_slots, size=3, replace=False):
                    if rng.random() < 0.3:
                        state.add_request(int(slot), None)
                        lens[slot] = 0
                    else:
                        tr = rng.integers(0, vocab, int(rng.integers(1, max_len + 1)))
                        state.add_request(int(slot), tr)
                        table[slot, : len(tr)] = tr
                        lens[slot] = len(tr)
                    step_of[slot] = -2
                state.apply_staged_writes()
                tables.append((k, table.copy(), lens.copy()))
            step_of += 1
            total_all[k] = prompt + step_of
            out = step(state.tables, jax.device_put(base_all[k], gpu), jax.device_put(idx_all[k], gpu),
                       jax.device_put(total_all[k], gpu), prompt_dev)
            outs.append(out)
        got = np.stack([np.asarray(o) for o in outs])
    mismatches, forced, t_i, first = 0, 0, 0, None
    for k in range(steps):
        while t_i + 1 < len(tables) and tables[t_i + 1][0] <= k:
            t_i += 1
        _, tab, ln = tables[t_i]
        exp = replay_reference(base_all[k], idx_all[k], tab, ln, total_all[k], prompt)
        bad = int((got[k] != exp).sum())
        if bad and first is None:
            first = (k, got[k].tolist(), exp.tolist())
        mismatches += bad
        forced += int((exp != base_all[k]).sum())
    assert mismatches == 0, f"{mismatches} mismatching rows over {steps} steps; first at {first}"
    assert forced > steps
    print(f"jax soak: {steps} steps, {forced} forced tokens, 0 mismatches")
