"""Shapes and host buffers the JAX decode loops of every family share (numpy only).

A loop keeps its per-step outputs on the device in chunks of :data:`CHUNK` steps (a fixed shape,
so one compiled step serves any run length) and pads prompts, traces and the KV cache to
:func:`bucket` sizes (a few compiled shapes instead of one per length).
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

__all__ = ["CHUNK", "bucket", "fresh_outputs", "outputs"]

MIN_BUCKET = 8
CHUNK = 256          # decode steps per chunk of on-device outputs


def bucket(n: int, limit: int) -> int:
    """The power of two >= ``n`` (at least :data:`MIN_BUCKET`), capped at ``limit``."""
    return min(limit, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))


def fresh_outputs(rows: int) -> Dict[str, np.ndarray]:
    """Host zeros for one chunk of per-step outputs, and the step counter at its start."""
    shape = (CHUNK, rows)
    return {"step": np.zeros((), np.int32), "tokens": np.zeros(shape, np.int32),
            "argmax": np.zeros(shape, np.int32), "logprobs": np.zeros(shape, np.float32),
            "ranks": np.zeros(shape, np.int32)}


def outputs(carry: Any) -> Dict[str, Any]:
    """The per-step output arrays of a loop's carry (any record with these four fields)."""
    return {"tokens": carry.tokens, "argmax": carry.argmax, "logprobs": carry.logprobs, "ranks": carry.ranks}
