"""Randomised decode-loop scenarios for cross-framework parity tests.

A scenario is what a continuous-batching loop does to a trace-replay state, step by step:
requests join (taking a free slot, reusing slots that earlier requests left), with or
without a trace, some still prefilling (``total_len < prompt_len``: steps before the trace),
then decode past the end of their trace or stop before it; finished slots are cleared, or
left as they are and later taken over by a request that replaces them. The batch has a
fixed number of rows in a shuffled order, padded with ``-1`` rows (and, rarely, slot indices
outside ``[0, max_slots)``, which replay must leave alone).

Every driver (the numpy reference, the torch adapter, the JAX adapter eager / jitted /
inside ``lax.fori_loop``) replays the same :class:`Scenario` and must produce bit-identical
tokens. Nothing here imports a framework: steps carry numpy arrays, and a driver converts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trace_replay_core import replay_reference

__all__ = ["Op", "Step", "Scenario", "make_scenario", "ReferenceDriver", "reference_tokens"]

# ("stage", slot, tokens) | ("clear", slot) | ("apply",)
Op = tuple


@dataclasses.dataclass
class Step:
    ops: list[Op]  # state operations, in order, before this step's replay
    sampled: np.ndarray  # [batch] int64, the sampler's draw (poison values included)
    idx_mapping: np.ndarray  # [batch] int32, -1 = padding row
    total_len: np.ndarray  # [len_entries] int32 per slot: prompt + outputs so far
    prompt_len: np.ndarray  # [len_entries] int32 per slot
    step: np.ndarray  # [batch] int32 per row: total_len[slot] - prompt_len[slot], junk on padding


@dataclasses.dataclass
class Scenario:
    seed: int
    max_slots: int
    max_trace_len: int
    vocab_size: int
    batch: int
    steps: list[Step]

    def describe(self) -> str:
        return (
            f"seed={self.seed} max_slots={self.max_slots} max_trace_len={self.max_trace_len} "
            f"batch={self.batch} steps={len(self.steps)}"
        )


@dataclasses.dataclass
class _Request:
    slot: int
    prompt_len: int
    total_len: int
    end: int  # total_len at which the request finishes


def make_scenario(
    seed: int,
    *,
    max_slots: int = 12,
    max_trace_len: int = 24,
    batch: int = 10,
    n_steps: int = 80,
    vocab_size: int = 5000,
    len_entries: int | None = None,
) -> Scenario:
    """A scenario drawn from ``np.random.default_rng(seed)``.

    ``batch`` rows per step (at most ``batch`` requests run at once); ``len_entries`` per-slot
    length entries (at least ``max_slots``; default a few more, which replay must ignore).
    """
    rng = np.random.default_rng(seed)
    len_entries = max_slots + 3 if len_entries is None else len_entries
    free = list(range(max_slots))
    running: dict[int, _Request] = {}
    total = np.zeros(len_entries, dtype=np.int32)
    prompt = np.zeros(len_entries, dtype=np.int32)
    # junk in the extra entries: replay must never read them
    total[max_slots:] = rng.integers(0, 1000, len_entries - max_slots)
    prompt[max_slots:] = rng.integers(-1000, 0, len_entries - max_slots)
    steps: list[Step] = []
    for _ in range(n_steps):
        ops: list[Op] = []
        # requests that reached their end leave; their slot is cleared or left dirty
        for slot in [s for s, r in running.items() if r.total_len >= r.end]:
            del running[slot]
            free.append(slot)
            if rng.random() < 0.5:
                ops.append(("clear", slot))
        # arrivals
        arrivals = int(rng.integers(0, 3)) if rng.random() < 0.6 else 0
        for _ in range(arrivals):
            if not free or len(running) >= batch:
                break
            slot = free.pop(int(rng.integers(0, len(free))))
            p = int(rng.integers(1, 30))
            prefill_left = int(rng.integers(0, 3)) if rng.random() < 0.3 else 0
            gen = int(rng.integers(1, 2 * max_trace_len))
            req = _Request(slot, p, p - prefill_left, p + gen)
            running[slot] = req
            if rng.random() < 0.75:
                n = int(rng.integers(1, max_trace_len + 1))
                tokens = rng.integers(0, vocab_size, n)
                if rng.random() < 0.3:  # a trace staged twice: the second one wins
                    ops.append(("stage", slot, rng.integers(0, vocab_size, int(rng.integers(1, n + 1)))))
                ops.append(("stage", slot, tokens))
            else:
                ops.append(("clear", slot))  # untraced request: the slot must not keep an old trace
        if (ops and rng.random() < 0.85) or rng.random() < 0.1:
            ops.append(("apply",))  # else: staged now, applied at a later step
        for r in running.values():
            total[r.slot], prompt[r.slot] = r.total_len, r.prompt_len
        # the batch: running requests in a shuffled order, padded with -1 rows
        slots = list(running)
        rng.shuffle(slots)
        idx = np.full(batch, -1, dtype=np.int32)
        rows = rng.permutation(batch)[: len(slots)]
        idx[rows] = slots
        pad = np.nonzero(idx < 0)[0]
        if pad.size and rng.random() < 0.1:
            idx[pad[0]] = max_slots + int(rng.integers(0, 5))  # out of range: left alone
        step = rng.integers(-5, 3 * max_trace_len, batch).astype(np.int32)  # junk on padding rows
        live = (idx >= 0) & (idx < max_slots)
        step[live] = total[idx[live]] - prompt[idx[live]]
        sampled = rng.integers(0, vocab_size, batch)
        sampled[rng.random(batch) < 0.2] = vocab_size + 7  # poison: never a trace token
        steps.append(Step(ops, sampled.astype(np.int64), idx, total.copy(), prompt.copy(), step))
        for r in running.values():
            r.total_len += 1
    return Scenario(seed, max_slots, max_trace_len, vocab_size, batch, steps)


class ReferenceDriver:
    """The numpy reference: a host mirror of the table, staged writes applied at "apply"."""

    def __init__(self, scenario: Scenario):
        self.table = np.zeros((scenario.max_slots, scenario.max_trace_len), dtype=np.int32)
        self.trace_len = np.zeros(scenario.max_slots, dtype=np.int32)
        self.staged: dict[int, np.ndarray | None] = {}

    def op(self, op: Op) -> None:
        if op[0] == "stage":
            self.staged[op[1]] = np.asarray(op[2])
        elif op[0] == "clear":
            self.staged[op[1]] = None
        else:
            for slot, tokens in self.staged.items():
                if tokens is None:
                    self.trace_len[slot] = 0
                else:
                    self.table[slot, : tokens.shape[0]] = tokens
                    self.trace_len[slot] = tokens.shape[0]
            self.staged.clear()

    def replay(self, step: Step, per_row: bool) -> np.ndarray:
        if per_row:
            return replay_reference(step.sampled, step.idx_mapping, self.table, self.trace_len, step=step.step)
        return replay_reference(
            step.sampled, step.idx_mapping, self.table, self.trace_len, step.total_len, step.prompt_len
        )


def reference_tokens(scenario: Scenario, per_row: bool = False) -> list[np.ndarray]:
    """Expected tokens of every step (int64)."""
    ref = ReferenceDriver(scenario)
    out = []
    for step in scenario.steps:
        for op in step.ops:
            ref.op(op)
        out.append(ref.replay(step, per_row))
    return out
