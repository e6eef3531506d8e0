"""GPU tier: a soak through the JAX adapter (shorter than the torch one).

Many jitted steps queued without waiting, slots reused every few steps, staged writes applied
between steps on XLA's stream; every step's output compared with the reference afterwards.
Both replay methods: ``"jnp"`` (gather and select) and ``"kernel"`` (the core's Triton kernel
through a command-buffer-compatible buffer callback). Length set by
``TRACE_REPLAY_JAX_SOAK_STEPS`` (default 20,000 per method).
"""

import os

import jax
import numpy as np
import pytest
from helpers import admit_requests, check_soak  # noqa: E402
from helpers.jax_helpers import jax_gpu  # noqa: E402

import trace_replay_jax as trj  # noqa: E402
from trace_replay_jax import TraceReplayState  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["jnp", "kernel"])
def test_jax_soak(method, rng):
    gpu = jax_gpu()
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
        return trj.replay(tables_, sampled, idx, total, prompt_, method=method)

    prompt_dev = jax.device_put(prompt, gpu)
    outs = []
    with TraceReplayState(max_slots, max_len, device=gpu, vocab_size=vocab) as state:
        for k in range(steps):
            if k % 4 == 0:  # requests finish and new ones take their slots
                admit_requests(rng, state.add_request, table, lens, step_of, count=3, vocab=vocab)
                state.apply_staged_writes()
                tables.append((k, table.copy(), lens.copy()))
            step_of += 1
            total_all[k] = prompt + step_of
            out = step(
                state.tables,
                jax.device_put(base_all[k], gpu),
                jax.device_put(idx_all[k], gpu),
                jax.device_put(total_all[k], gpu),
                prompt_dev,
            )
            outs.append(out)
        got = np.stack([np.asarray(o) for o in outs])
    mismatches, forced, first = check_soak(got, base_all, idx_all, total_all, prompt, tables)
    assert mismatches == 0, f"{mismatches} mismatching rows over {steps} steps; first at {first}"
    assert forced > steps
    print(f"jax soak ({method}): {steps} steps, {forced} forced tokens, 0 mismatches")
