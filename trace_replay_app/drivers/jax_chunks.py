"""Shapes, host buffers and the step loop of the JAX decode driver (numpy only).

A loop keeps its per-step outputs on the device in chunks of :data:`CHUNK` steps (a fixed shape,
so one compiled step serves any run length) and pads prompts, traces and the KV cache to
:func:`bucket` sizes (a few compiled shapes instead of one per length). :func:`run_chunks`
drives a run (admit, apply the staged traces, step, one copy to the host at the end) with the
driver's jitted admit and step; the framework comes in as the ``put``/``fetch`` callables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["CHUNK", "bucket", "fresh_outputs", "outputs", "prompt_prefix", "run_chunks"]

MIN_BUCKET = 8
CHUNK = 256  # decode steps per chunk of on-device outputs


def bucket(n: int, limit: int) -> int:
    """The power of two >= ``n`` (at least :data:`MIN_BUCKET`), capped at ``limit``."""
    return min(limit, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))


def fresh_outputs(rows: int) -> dict[str, np.ndarray]:
    """Host zeros for one chunk of per-step outputs, and the step counter at its start."""
    shape = (CHUNK, rows)
    return {
        "step": np.zeros((), np.int32),
        "tokens": np.zeros(shape, np.int32),
        "argmax": np.zeros(shape, np.int32),
        "logprobs": np.zeros(shape, np.float32),
        "ranks": np.zeros(shape, np.int32),
    }


def outputs(carry: Any) -> dict[str, Any]:
    """The per-step output arrays of a loop's carry (any record with these four fields)."""
    return {"tokens": carry.tokens, "argmax": carry.argmax, "logprobs": carry.logprobs, "ranks": carry.ranks}


def prompt_prefix(prompt: Sequence[int], kv_len: int) -> np.ndarray:
    """The tokens a request prefills (its prompt but the last token, which the first decode
    step feeds), int32, zero-padded to a :func:`bucket` size of at most ``kv_len``."""
    prefix = np.zeros(bucket(len(prompt) - 1, kv_len), np.int32)
    prefix[: len(prompt) - 1] = prompt[:-1]
    return prefix


def run_chunks(
    schedule,
    prompts,
    traces,
    state,
    carry,
    *,
    put: Callable,
    fetch: Callable,
    admit: Callable,
    step: Callable,
    on_step: Callable[[int], None] | None,
) -> dict[str, np.ndarray]:
    """Every step of ``schedule``; the per-step outputs ``[n_steps, slots]`` on the host.

    Per step: a full chunk of outputs is set aside (still on the device) and the carry gets
    fresh ones; the requests admitted at the step go through ``admit(carry, slots, prompts) ->
    carry`` together (their slots and prompts, in admission order), and each ``i`` through
    ``state.add_request(slot, traces[i])`` (None: untraced, which forgets the slot's old
    trace); ``state.apply_staged_writes()``; then ``step(carry, state.tables, idx_chunk) ->
    carry`` with the chunk of ``idx_mapping`` the step indexes by ``carry.step``. ``put`` places
    host arrays where the carry lives; ``fetch`` copies a pytree to the host, once, at the end
    (the run's one wait for the device). ``on_step(k)`` after each step is queued.
    """
    rows, steps = schedule.slots, schedule.n_steps
    n_chunks = -(-steps // CHUNK)
    idx_all = np.full((n_chunks * CHUNK, rows), -1, dtype=np.int32)  # padded with empty rows, like the outputs
    idx_all[:steps] = schedule.idx_mapping
    idx_chunks = [put(chunk) for chunk in np.split(idx_all, n_chunks)]
    chunks = []  # outputs of finished chunks, still on the device
    per_step = schedule.tokens_per_step.tolist()
    for k in range(steps):
        if k and k % CHUNK == 0:
            chunks.append(outputs(carry))
            carry = carry._replace(**put(fresh_outputs(rows)))
        admitted = schedule.admitted(k).tolist()
        if admitted:
            slots = [int(schedule.slot[i]) for i in admitted]
            carry = admit(carry, slots, [prompts[i] for i in admitted])
            for slot, i in zip(slots, admitted):
                state.add_request(slot, traces[i])
        state.apply_staged_writes()
        carry = step(carry, state.tables, idx_chunks[k // CHUNK])
        if on_step is not None:
            on_step(per_step[k])
    chunks.append(outputs(carry))
    host = fetch(chunks)
    return {name: np.concatenate([chunk[name] for chunk in host])[:steps] for name in host[0]}
