"""Host-side validation of slots and traces.

``check_*`` and :func:`trace_array` only read their input. :func:`copy_trace` copies a trace
into storage the caller owns and checks the token ids on the way: staging reads the caller's
int32 (or narrower) data once, validates exactly the bytes it keeps, and refuses an id that
int32 cannot hold instead of wrapping it.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np

__all__ = ["check_positive_int", "check_slot", "check_trace", "copy_trace", "trace_array"]

INT32_MAX = 2**31 - 1
TOKEN_LIMIT = INT32_MAX + 1     # token ids are stored as int32: without a vocabulary, below 2**31

_UINT64 = np.dtype(np.uint64)


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


def trace_array(tokens: Any, *, max_trace_len: int, name: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a 1-D integer host numpy array of 1 to ``max_trace_len`` elements, or
    raise naming what is wrong. Token values are not looked at: :func:`copy_trace` checks them.

    The result may share memory with ``tokens`` (a numpy array is returned as it is).
    """
    arr = tokens if type(tokens) is np.ndarray else _host_array(tokens, name)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (got shape {list(arr.shape)})")
    n = arr.shape[0]
    if n == 0:
        raise ValueError(f"{name} must not be empty (got 0 tokens); use clear(slot) to untrace a slot")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype (got {arr.dtype})")
    if n > max_trace_len:
        raise ValueError(f"{name} has {n} tokens; the table holds at most max_trace_len={max_trace_len}")
    return arr


def _value_error(values: np.ndarray, vocab_size: int | None, name: str) -> ValueError:
    """The refusal of ``values``, which break a rule: non-negative first, then the upper limit."""
    lo = int(values.min())
    if lo < 0:
        return ValueError(f"{name} must be non-negative (got {lo} at index {int(np.argmin(values))})")
    at = int(np.argmax(values))
    what = f"vocab_size={vocab_size}" if vocab_size is not None else "2**31"
    return ValueError(f"{name} must be below {what} (got {int(values[at])} at index {at})")


def copy_trace(arr: np.ndarray, out: np.ndarray, *, vocab_size: int | None, name: str = "tokens") -> None:
    """Copy the token ids of ``arr`` (a :func:`trace_array` result) into ``out``, refusing any id
    that is negative, or at least ``vocab_size`` (``2**31`` when ``None``). Host-only.

    ``out``: ``uint32``, as long as ``arr``; a uint32 view of the int32 storage that keeps the
    trace (an id below ``2**31`` has the same bits in both). ``arr`` is read once when its
    integers have 4 bytes or fewer. On a refusal ``out`` holds unspecified values: the caller
    publishes it only when this returns. A value that does not fit int32 is refused, never
    wrapped.
    """
    limit = TOKEN_LIMIT if vocab_size is None else vocab_size
    if arr.dtype.itemsize <= 4:
        # Up to 4 bytes the copy keeps every bit that matters: as uint32 a negative id becomes
        # >= 2**31 >= limit, so the largest staged value checks both bounds, on exactly the bytes
        # that were staged, read back from cache. argmax, not max(): ~0.5 us less call overhead.
        out[...] = arr          # a C cast, like np.copyto(casting="unsafe") without its dispatch
        if out[out.argmax()] < limit:
            return
        raise _value_error(out if arr.dtype.kind == "u" else out.view(np.int32), vocab_size, name)
    # 8 bytes: check before the casting copy, which keeps only the low 32 bits. As uint64 a
    # negative id becomes >= 2**63, so again the largest value checks both bounds.
    if arr.dtype.kind == "i":
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        wide = arr.view(_UINT64)
    else:
        wide = arr
    if wide[wide.argmax()] >= limit:
        raise _value_error(arr, vocab_size, name)
    out[...] = arr


def check_trace(tokens: Any, *, max_trace_len: int, vocab_size: Optional[int],
                name: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a validated 1-D integer numpy array, or raise naming what is wrong.

    The result may share memory with ``tokens``: callers copy it into storage they own
    (:func:`copy_trace` validates while it copies, for staging's hot path).

    A trace is 1-D, non-empty, of an integer dtype, non-negative, at most ``max_trace_len`` long
    and below ``vocab_size`` when one is set.
    """
    arr = trace_array(tokens, max_trace_len=max_trace_len, name=name)
    limit = TOKEN_LIMIT if vocab_size is None else vocab_size
    if int(arr.min()) < 0 or int(arr.max()) >= limit:
        raise _value_error(arr, vocab_size, name)
    return arr
