"""Expected replay tokens computed apart from the library.

The library's own numpy code (``trace_replay_core.replay_reference``, the numpy backend) also
serves as the CPU path of some methods under test (``method="kernel"`` on the CPU runs the
core's numpy replay), so a test that takes its expected values from there compares the code
with itself. These functions rebuild the committed traces from what the test itself staged and
apply the replay rule with vectorised numpy written here, sharing no code with the library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["expected_replay", "scenario_tokens"]


def expected_replay(
    sampled, idx, traces: Mapping[int, Sequence[int]], total=None, prompt=None, step=None
) -> np.ndarray:
    """``sampled`` (any shape whose first axis is the batch; not modified) with each traced row
    replaced by its trace token, as a new array of ``sampled``'s dtype.

    ``traces``: slot -> committed tokens (slots absent: untraced). The step of row ``b`` is
    ``step[b]``, or ``total[slot] - prompt[slot]`` (in int64, so no wrap-around).
    """
    got = np.array(sampled, copy=True)
    flat = got.reshape(got.shape[0], -1)
    slots = np.asarray(idx).astype(np.int64).reshape(-1)
    if step is not None:
        at = np.asarray(step).astype(np.int64).reshape(-1)
    else:
        tl, pl = np.asarray(total).astype(np.int64), np.asarray(prompt).astype(np.int64)
        safe = np.clip(slots, 0, max(tl.shape[0] - 1, 0))
        at = tl[safe] - pl[safe] if tl.shape[0] else np.zeros_like(slots)
    lengths = {int(s): len(t) for s, t in traces.items()}
    n = np.array([lengths.get(int(s), 0) for s in slots], dtype=np.int64)
    hit = (n > 0) & (at >= 0) & (at < n)
    for b in np.flatnonzero(hit):
        flat[b, :] = int(traces[int(slots[b])][int(at[b])])
    return got


def scenario_tokens(scenario, per_row: bool = False) -> list[np.ndarray]:
    """The expected tokens (int64) of every step of a ``helpers.scenarios.Scenario``."""
    committed: dict[int, list[int]] = {}
    pending: dict[int, list[int] | None] = {}
    out = []
    for step in scenario.steps:
        for op in step.ops:
            if op[0] == "stage":
                pending[int(op[1])] = [int(t) for t in np.asarray(op[2]).reshape(-1)]
            elif op[0] == "clear":
                pending[int(op[1])] = None
            else:
                for slot, tokens in pending.items():
                    if tokens is None:
                        committed.pop(slot, None)
                    else:
                        committed[slot] = tokens
                pending.clear()
        live = {s: t for s, t in committed.items() if 0 <= s < scenario.max_slots}
        if per_row:
            got = expected_replay(step.sampled, step.idx_mapping, live, step=step.step)
        else:
            got = expected_replay(step.sampled, step.idx_mapping, live, step.total_len, step.prompt_len)
        out.append(np.asarray(got).reshape(-1).astype(np.int64))
    return out
