"""Host-side validation of slots and traces. Pure functions: they read, never modify."""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np

__all__ = ["check_slot", "check_trace", "check_positive_int"]

INT32_MAX = 2**31 - 1


def check_positive_int(value: Any, *, name: str, maximum: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    if not 1 <= int(value) <= maximum:
        raise ValueError(f"{name} must be between 1 and {maximum} (got {value})")
    return int(value)


def check_slot(slot: Any, max_slots: int, *, name: str = "slot") -> int:
    if isinstance(slot, bool) or not isinstance(slot, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(slot).__name__} {slot!r})")
    if not 0 <= int(slot) < max_slots:
        raise ValueError(f"{name} must be in [0, {max_slots}) (got {slot})")
    return int(slot)


def _host_array(tokens: Any, name: str) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return tokens
    if hasattr(tokens, "__dlpack_device__"):
        dev_type = int(tokens.__dlpack_device__()[0])
        if dev_type not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise ValueError(f"{name} must be host data (a list, a numpy array or a CPU tensor); got an "
                             f"array on a device (DLPack device type {dev_type}): copy it to the host first")
        return np.from_dlpack(tokens)
    if isinstance(tokens, (list, tuple, range)):
        return np.asarray(tokens)
    raise TypeError(f"{name} must be a 1-D sequence of token ids (list, numpy array or CPU tensor); "
                    f"got {type(tokens).__name__}")


def check_trace(tokens: Any, *, max_trace_len: int, vocab_size: Optional[int],
                name: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a validated 1-D integer numpy array, or raise naming what is wrong.

    The result may share memory with ``tokens``: callers copy it into storage they own.

    A trace is 1-D, non-empty, of an integer dtype, non-negative, at most ``max_trace_len`` long
    and below ``vocab_size`` when one is set.
    """
    arr = _host_array(tokens, name)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (got shape {list(arr.shape)})")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} must not be empty (got 0 tokens); use clear(slot) to untrace a slot")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype (got {arr.dtype})")
    if arr.shape[0] > max_trace_len:
        raise ValueError(f"{name} has {arr.shape[0]} tokens; the table holds at most "
                         f"max_trace_len={max_trace_len}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"{name} must be non-negative (got {lo} at index {int(np.argmin(arr))})")
    limit = vocab_size if vocab_size is not None else INT32_MAX + 1
    if hi >= limit:
        what = f"vocab_size={vocab_size}" if vocab_size is not None else "2**31"
        raise ValueError(f"{name} must be below {what} (got {hi} at index {int(np.argmax(arr))})")
    return arr
