"""What a decode run needs on its device, checked against what is free before anything is allocated (numpy only).

The drivers size every buffer from the work (:func:`trace_replay_app.schedule.plan`'s slots,
the requests' prompt + new tokens), estimate the bytes here, and call :func:`check_fits` with
the device's free bytes (torch: ``torch.cuda.mem_get_info``; JAX: the device's memory stats)
before the first allocation there. The estimate counts what a run holds for its whole length
(weights in the compute dtype, the KV cache, the per-step outputs, the replay table) plus the
largest per-step work (the float32 logits and their temporaries, the sampling noise); it is a
lower bound of the peak, not an exact figure.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..records import DeviceMemoryError

__all__ = ["estimate_bytes", "check_fits"]

_OUTPUT_BYTES = 8 + 8 + 4 + 8  # per step and slot: token, argmax (int64), logprob (float32), rank (int64)
_LOGITS_COPIES = 4  # logits in the compute dtype, their float32 copy, and two float32 temporaries


def estimate_bytes(
    *,
    weights: Mapping[str, np.ndarray],
    itemsize: int,
    cache_elements: int,
    slots: int,
    steps: int,
    vocab_size: int,
    longest_trace: int,
    sampling: bool,
) -> int:
    """Bytes a decode run needs on its device: ``weights`` (numpy arrays; counted at
    ``itemsize`` bytes per element, the compute dtype's), ``cache_elements`` KV-cache entries
    of ``itemsize`` bytes, ``steps`` x ``slots`` recorded outputs, a replay table of ``slots`` x
    ``longest_trace`` int64 tokens, and per step ``slots`` x ``vocab_size`` float32 logits
    (and uniform noise when ``sampling``). Host-only."""
    total = sum(int(np.asarray(w).size) for w in weights.values()) * itemsize
    total += cache_elements * itemsize
    total += steps * slots * _OUTPUT_BYTES
    total += slots * longest_trace * 8
    total += slots * vocab_size * 4 * (_LOGITS_COPIES + (1 if sampling else 0))
    return int(total)


def check_fits(device: str, needed: int, free: int | None) -> None:
    """Raise :class:`~trace_replay_app.records.DeviceMemoryError` ``(device, needed, free)``
    when ``needed`` bytes exceed ``free`` (``None``: the device does not report free memory,
    e.g. a CPU; nothing is checked). Host-only."""
    if free is not None and needed > free:
        raise DeviceMemoryError(device, int(needed), int(free))
