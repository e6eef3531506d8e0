"""Host-side validation of slots, traces and the arrays read over DLPack (the logprob op's own
checks are in :mod:`._logprob_checks`).

``check_*``, :func:`trace_array` and :func:`trace_block` only read their input; the token ids
are checked later, while staging copies them (:func:`~._staging.copy_trace`): it validates
exactly the bytes it keeps, and refuses an id that int32 cannot hold instead of wrapping it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._dlpack import ArrayView

__all__ = [
    "check_int",
    "check_positive_int",
    "check_slot",
    "check_slots",
    "check_trace",
    "check_view",
    "check_not_copied",
    "trace_array",
    "trace_block",
    "token_error",
    "INT32_MAX",
    "TOKEN_LIMIT",
]

INT32_MAX = 2**31 - 1
TOKEN_LIMIT = INT32_MAX + 1  # token ids are stored as int32: without a vocabulary, below 2**31


def check_int(value: Any, *, name: str, minimum: int, maximum: int) -> int:
    """``value`` as an int in ``[minimum, maximum]``, or raise naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    if not minimum <= int(value) <= maximum:
        raise ValueError(f"{name} must be between {minimum} and {maximum} (got {value})")
    return int(value)


def check_positive_int(value: Any, *, name: str, maximum: int = INT32_MAX) -> int:
    return check_int(value, name=name, minimum=1, maximum=maximum)


def check_slot(slot: Any, max_slots: int, *, name: str = "slot") -> int:
    if isinstance(slot, bool) or not isinstance(slot, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(slot).__name__} {slot!r})")
    if not 0 <= int(slot) < max_slots:
        raise ValueError(f"{name} must be in [0, {max_slots}) (got {slot})")
    return int(slot)


def check_slots(slots: Any, max_slots: int, *, name: str = "slots") -> list:
    """Return ``slots`` (a sequence of ints, or a 1-D integer host array: numpy, or a CPU tensor
    over DLPack) as a list of Python ints, each in ``[0, max_slots)``, or raise naming the first
    bad entry."""
    if not isinstance(slots, (np.ndarray, list, tuple, range)) and hasattr(slots, "__dlpack__"):
        slots = _host_array(slots, name)
    if isinstance(slots, np.ndarray):
        if slots.ndim != 1 or (slots.dtype.kind not in "iu" and slots.size):
            raise TypeError(f"{name} must be a 1-D sequence of ints (got a {slots.ndim}-D array of {slots.dtype})")
        values = slots.tolist()
    elif isinstance(slots, (list, tuple, range)):
        values = list(slots)
    else:
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer array (got {type(slots).__name__})")
    for i, slot in enumerate(values):
        if type(slot) is not int or not 0 <= slot < max_slots:
            values[i] = check_slot(slot, max_slots, name=f"{name}[{i}]")
    return values


def check_distinct_slots(slots: list, *, name: str = "slots") -> None:
    """Raise ``ValueError`` naming the earliest slot that ``slots`` (valid ints, from
    :func:`check_slots`) gives a second time, and both of its positions."""
    seen: dict = {}
    for i, slot in enumerate(slots):
        if slot in seen:
            raise ValueError(
                f"{name} gives slot {slot} twice (positions {seen[slot]} and {i}): each request takes its own slot"
            )
        seen[slot] = i


def _host_array(tokens: Any, name: str) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return tokens
    if hasattr(tokens, "__dlpack_device__"):
        dev_type = int(tokens.__dlpack_device__()[0])
        if dev_type not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise ValueError(
                f"{name} must be host data (a list, a numpy array or a CPU tensor); got an "
                f"array on a device (DLPack device type {dev_type}): copy it to the host first"
            )
        try:
            return np.from_dlpack(tokens)
        except (BufferError, TypeError, RuntimeError) as exc:  # e.g. torch: a tensor that requires grad
            dtype = getattr(tokens, "dtype", None)
            raise TypeError(
                f"{name} must be 1-D integer token ids on the host; could not read the "
                f"{type(tokens).__name__}{'' if dtype is None else f' of dtype {dtype}'} over DLPack: {exc}"
            ) from None
    if isinstance(tokens, (list, tuple, range)):
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError):  # ragged or nested: numpy's message names nothing
            raise _sequence_error(tokens, name) from None
        # object: an int no 64-bit type holds; float64 from ints: int64 and uint64 together
        if arr.dtype.kind == "O" or (
            arr.dtype.kind == "f" and arr.size and all(isinstance(x, numbers.Integral) for x in tokens)
        ):
            raise _sequence_error(tokens, name)
        return arr
    raise TypeError(
        f"{name} must be a 1-D sequence of token ids (list, numpy array or CPU tensor); got {type(tokens).__name__}"
    )


def _sequence_error(tokens: Any, name: str) -> Exception:
    """The refusal of a sequence numpy could not read as one integer array, naming the entry at
    fault: one that is no int, else the ids out of range (as :func:`token_error` words it)."""
    for i, x in enumerate(tokens):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            shown = repr(x) if len(repr(x)) <= 40 else repr(x)[:37] + "..."
            return TypeError(
                f"{name} must be a 1-D sequence of int token ids ({name}[{i}] is {type(x).__name__} {shown})"
            )
    return token_error(np.array([int(x) for x in tokens], dtype=object), None, name)


def trace_array(tokens: Any, *, max_trace_len: int, name: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a 1-D integer host numpy array of 1 to ``max_trace_len`` elements, or
    raise naming what is wrong. Token values are not looked at: staging's copy checks them
    (:func:`~._staging.copy_trace`).

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


def trace_block(tokens: Any, *, rows: int, max_trace_len: int, name: str = "traces") -> np.ndarray:
    """Return ``tokens`` as a 2-D integer host numpy array ``[rows, length]`` (``rows`` traces of
    1 to ``max_trace_len`` tokens each), or raise naming what is wrong. Token values are not
    looked at: :func:`~._staging.copy_trace` checks them. The result may share memory with ``tokens``."""
    arr = tokens if type(tokens) is np.ndarray else _host_array(tokens, name)
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-D array [traces, tokens] or a list of 1-D traces "
            f"(got an array of shape {list(arr.shape)})"
        )
    if arr.shape[0] != rows:
        raise ValueError(f"{name} has {arr.shape[0]} traces but slots has {rows} entries")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype (got {arr.dtype})")
    n = arr.shape[1]
    if n == 0:
        raise ValueError(f"{name} must not be empty (got 0 tokens per trace); use clear(slot) to untrace a slot")
    if n > max_trace_len:
        raise ValueError(f"{name} has {n} tokens per trace; the table holds at most max_trace_len={max_trace_len}")
    return arr


def token_error(values: np.ndarray, vocab_size: int | None, name: str) -> ValueError:
    """The refusal of ``values``, which break a rule: non-negative first, then the upper limit.
    For a 2-D block the message names the first trace (row) that breaks one."""
    if values.ndim == 2:
        limit = TOKEN_LIMIT if vocab_size is None else vocab_size
        bad = np.nonzero(((values < 0) | (values >= limit)).any(axis=1))[0]
        row = int(bad[0]) if bad.size else 0
        return token_error(values[row], vocab_size, f"{name}[{row}]")
    lo = int(values.min())
    if lo < 0:
        return ValueError(f"{name} must be non-negative (got {lo} at index {int(np.argmin(values))})")
    at = int(np.argmax(values))
    what = f"vocab_size={vocab_size}" if vocab_size is not None else "2**31"
    return ValueError(f"{name} must be below {what} (got {int(values[at])} at index {at})")


def check_trace(tokens: Any, *, max_trace_len: int, vocab_size: int | None, name: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a validated 1-D integer numpy array, or raise naming what is wrong.

    The result may share memory with ``tokens``: callers copy it into storage they own
    (:func:`~._staging.copy_trace` validates while it copies, for staging's hot path).

    A trace is 1-D, non-empty, of an integer dtype, non-negative, at most ``max_trace_len`` long
    and below ``vocab_size`` when one is set.
    """
    arr = trace_array(tokens, max_trace_len=max_trace_len, name=name)
    limit = TOKEN_LIMIT if vocab_size is None else vocab_size
    if int(arr.min()) < 0 or int(arr.max()) >= limit:
        raise token_error(arr, vocab_size, name)
    return arr


# -- arrays ----------------------------------------------------------------------------------------
# One array read over DLPack, checked (host-only: it reads the view and never writes).


def check_view(
    view: ArrayView,
    *,
    name: str,
    dtypes: Iterable[str],
    device: str | None = None,
    ndim: int | None = None,
    length: int | None = None,
    min_length: int | None = None,
    writable: bool = False,
    contiguous: bool = True,
) -> ArrayView:
    """Validate ``view`` and raise with ``name`` and what was received; return it unchanged.

    ``device`` is ``"cpu"`` or ``"cuda:N"``; ``length``/``min_length`` apply to dimension 0.
    """
    dtypes = tuple(dtypes)
    if view.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(dtypes)} (got {view.dtype})")
    if device is not None and view.device != device:
        raise ValueError(f"{name} must be on {device} (got {view.device})")
    if ndim is not None and view.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D (got shape {list(view.shape)})")
    if length is not None and view.shape[0] != length:
        raise ValueError(f"{name} must have {length} rows (got shape {list(view.shape)})")
    if min_length is not None and view.shape[0] < min_length:
        raise ValueError(f"{name} must have at least {min_length} entries (got shape {list(view.shape)})")
    if contiguous and not view.is_c_contiguous:
        raise ValueError(
            f"{name} must be contiguous (got shape {list(view.shape)} with element strides {list(view.strides)})"
        )
    if writable and (view.readonly or view.copied):
        if view.readonly:
            raise ValueError(f"{name} is written in place and must be writable (got a read-only array)")
        raise ValueError(
            f"{name} is written in place, but its producer exported a copy over DLPack (the IS_COPIED "
            f"flag): the writes would be lost; pass an array whose own memory it exports"
        )
    if view.size and view.ptr % view.itemsize:
        raise ValueError(f"{name} must be aligned to its {view.itemsize}-byte elements (got address 0x{view.ptr:x})")
    return view


def check_not_copied(named: Iterable[tuple[str, ArrayView | None]]) -> None:
    """Refuse, for a call that is bound, each ``(name, view)`` whose producer exported a copy over
    DLPack (the ``IS_COPIED`` flag; a ``None`` view skipped). A bound call keeps the pointer and
    reads it at every call: after ``release()`` (or in a cache that keeps pointers only) the copy
    may be freed, and it never sees what is written to the array later. An unbound call reads a
    copy while it holds its capsule, so it takes copies."""
    for name, view in named:
        if view is not None and view.copied:
            raise ValueError(
                f"{name}'s producer exported a copy over DLPack (the IS_COPIED flag): a bound call keeps its "
                f"pointer and reads it at every call, when the copy may be freed and never sees later writes "
                f"to the array; pass an array whose own memory its producer exports, or make an unbound call"
            )
