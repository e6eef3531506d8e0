"""Inputs and references of the JAX adapter's CPU tests: semantics, ownership, ordering, building blocks.

Its refusals are ``test_jax_adapter_refusals.py``, its GPU tier ``test_gpu_jax_adapter.py``;
cross-framework parity over long randomised scenarios lives in ``test_parity.py``. Here each
property is checked on its own, with poisoned inputs (rows the code forgot stay visibly
wrong) and fresh random data every run.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from trace_replay_core import replay_reference
from trace_replay_jax import TraceReplayState

POISON = 2**30 + 7  # never a trace token (traces are below vocab_size)
VOCAB = 50_000
CPU = jax.devices("cpu")[0]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _random_state(rng, device, max_slots=16, max_len=32):
    """A state with random committed traces on most slots; returns (state, traces)."""
    state = TraceReplayState(max_slots, max_len, device=device, vocab_size=VOCAB)
    traces = {}
    for slot in range(max_slots):
        if rng.random() < 0.75:
            traces[slot] = rng.integers(0, VOCAB, int(rng.integers(1, max_len + 1)))
            state.add_request(slot, traces[slot])
    state.apply_staged_writes()
    return state, traces


def _reference(traces, max_slots, max_len, sampled, idx, total=None, prompt=None, step=None):
    table = np.zeros((max_slots, max_len), np.int32)
    lens = np.zeros(max_slots, np.int32)
    for slot, tr in traces.items():
        table[slot, : len(tr)] = tr
        lens[slot] = len(tr)
    return replay_reference(
        np.asarray(sampled),
        np.asarray(idx),
        table,
        lens,
        None if total is None else np.asarray(total),
        None if prompt is None else np.asarray(prompt),
        None if step is None else np.asarray(step),
    )


def _inputs(rng, batch, max_slots, max_len, device, sampled_dtype=np.int32, index_dtype=np.int32, traces=None):
    """Random replay inputs: rows of valid, padding (-1) and out-of-range slots, per-slot steps
    before, inside and past the traces. With ``traces``, row 0 is planted on a traced slot at
    step 0, so at least one row is replaced whatever the draw."""
    idx = rng.integers(0, max_slots, batch)
    special = rng.random(batch)
    idx[special < 0.15] = -1
    idx[(special >= 0.15) & (special < 0.2)] = max_slots + 2
    prompt = rng.integers(0, 100, max_slots + 2)
    total = prompt + rng.integers(-3, max_len + 3, max_slots + 2)
    if traces and batch:
        slot = min(traces)
        idx[0], total[slot] = slot, prompt[slot]
    sampled = np.full(batch, POISON)
    step = rng.integers(-3, max_len + 3, batch)
    put = lambda x, dt: jax.device_put(np.asarray(x, dt), device)  # noqa: E731
    return (
        put(sampled, sampled_dtype),
        put(idx, index_dtype),
        put(total, index_dtype),
        put(prompt, index_dtype),
        put(step, index_dtype),
    )


# -- state operations and ordering ----------------------------------------------------------------
def _one_row_step(state, slot, step, device=CPU):
    put = lambda x: jax.device_put(np.asarray(x, np.int32), device)  # noqa: E731
    total = np.zeros(state.max_slots, np.int32)
    total[slot] = step
    return put([POISON]), put([slot]), put(total), put(np.zeros(state.max_slots))


class _FakeTable:
    def __init__(self, fail=False):
        self.streams, self.fail = [], fail

    def commit(self, *, stream):
        self.streams.append(stream)
        if self.fail:
            raise RuntimeError("scatter launch failed")
