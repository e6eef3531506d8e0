"""The arrays of one replay, checked: what :class:`~._table.TraceTable` launches or binds on.

A replay takes ``sampled`` (``[batch]`` or ``[batch, 1]`` int32/int64, writable), ``idx_mapping``
(``[batch]`` int32/int64, the slot of each row) and the step source: either the per-slot
``total_len`` and ``prompt_len`` (int32/int64, at least ``max_slots`` entries) or a per-row
``step`` (``[batch]`` int32/int64). Every array must be contiguous and on the table's device.
Each check reads the array over DLPack (:func:`~._dlpack.as_view`, with ``handle`` as the
handshake's consumer stream) and raises naming the argument and what it received. Host-only;
the views keep the producers' capsules, so the memory stays alive while a view lives.
"""

from __future__ import annotations

from typing import Any

from ._dlpack import ArrayView, as_view
from ._dtypes import INDEX_DTYPES, TOKEN_DTYPES
from ._validate import check_not_copied, check_view

__all__ = ["ReplayViews", "bound_views", "check_per_slot", "check_replay"]

# (sampled, idx_mapping, total_len, prompt_len, step): step None for the per-slot step, else
# total_len and prompt_len None.
ReplayViews = tuple[ArrayView, ArrayView, ArrayView | None, ArrayView | None, ArrayView | None]
_NAMES = ("sampled", "idx_mapping", "total_len", "prompt_len", "step")


def _check_sampled(sampled: Any, *, device: str, handle: int) -> ArrayView:
    v = as_view(sampled, name="sampled", stream=handle)
    if v.ndim == 2 and v.shape[1] != 1:
        raise ValueError(
            f"sampled has {v.shape[1]} tokens per row (shape {list(v.shape)}): speculative "
            f"decoding is not supported; replay takes exactly one token per request per step"
        )
    if v.ndim not in (1, 2):
        raise ValueError(f"sampled must be 1-D [batch] or [batch, 1] (got shape {list(v.shape)})")
    return check_view(v, name="sampled", dtypes=TOKEN_DTYPES, device=device, writable=True)


def _check_rows(arr: Any, name: str, rows: int, *, device: str, handle: int) -> ArrayView:
    view = as_view(arr, name=name, stream=handle)
    return check_view(view, name=name, dtypes=INDEX_DTYPES, device=device, ndim=1, length=rows)


def check_per_slot(arr: Any, name: str, max_slots: int, *, device: str, handle: int, bound: bool = False) -> ArrayView:
    """``arr`` as a per-slot length array: int32/int64, 1-D, at least ``max_slots`` entries; with
    ``bound`` (lengths kept for later replays), not a copy (:func:`~._validate.check_not_copied`)."""
    view = as_view(arr, name=name, stream=handle)
    check_view(view, name=name, dtypes=INDEX_DTYPES, device=device, ndim=1, min_length=max_slots)
    if bound:
        check_not_copied(((name, view),))
    return view


def check_replay(
    sampled: Any,
    idx_mapping: Any,
    total_len: Any,
    prompt_len: Any,
    step: Any,
    *,
    max_slots: int,
    device: str,
    handle: int,
) -> ReplayViews:
    """The checked views of one replay's arrays. Give ``total_len`` and ``prompt_len``, or
    ``step`` (the others ``None``); anything else is refused with ``ValueError``."""
    s = _check_sampled(sampled, device=device, handle=handle)
    rows = s.shape[0]
    idx = _check_rows(idx_mapping, "idx_mapping", rows, device=device, handle=handle)
    if step is not None:
        if total_len is not None or prompt_len is not None:
            raise ValueError("give either total_len and prompt_len (per slot) or step (per row), not both")
        return s, idx, None, None, _check_rows(step, "step", rows, device=device, handle=handle)
    if total_len is None or prompt_len is None:
        raise ValueError("give both total_len and prompt_len (per slot), or step (per row)")
    return (
        s,
        idx,
        check_per_slot(total_len, "total_len", max_slots, device=device, handle=handle),
        check_per_slot(prompt_len, "prompt_len", max_slots, device=device, handle=handle),
        None,
    )


def bound_views(views: ReplayViews) -> ReplayViews:
    """``views`` (of :func:`check_replay`) for a replay that is bound, whose launch keeps their
    pointers: refused, naming the array, when one is a copy (:func:`~._validate.check_not_copied`)."""
    check_not_copied(zip(_NAMES, views))
    return views
