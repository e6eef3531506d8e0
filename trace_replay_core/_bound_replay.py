"""``BoundReplay``: a replay whose arrays were checked once and fixed, launched by a call.

Made by :meth:`~._table.TraceTable.bind_replay` (and kept, released, in the table's cache of
bound launches by :meth:`~._table.TraceTable.replay_cached`). Each call queues one kernel
launch on the stream it names: stream-ordered, never blocks, no array is looked at again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._dlpack import ArrayView
from ._streams import stream_handle

if TYPE_CHECKING:
    from ._table import TraceTable

__all__ = ["BoundReplay"]


class BoundReplay:
    """A replay whose arrays were validated and fixed by :meth:`TraceTable.bind_replay`.

    ``bound(stream=s)`` queues the replay on stream ``s`` (stream-ordered, never blocks): the
    cheapest way to replay, a single kernel launch (a failing launch raises
    :class:`~trace_replay_core.CudaError`). ``views`` holds the validated arrays, whose DLPack
    capsules keep their memory alive while the bound replay lives.
    """

    __slots__ = ("_table", "_launch", "views")

    def __init__(self, table: TraceTable, launch: Callable[[int], None], views: tuple[ArrayView, ...]):
        self._table = table
        self._launch = launch
        self.views = views

    def release(self) -> None:
        """Drop this object's views and with them its hold on the arrays' DLPack capsules: the
        arrays may then be freed, and the caller must keep them alive while it uses this bound
        replay (a cache keyed by address does). The views themselves are not changed (one may
        be the caller's own :class:`ArrayView`). Host-only."""
        self.views = ()

    def __call__(self, *, stream: Any) -> None:
        if self._table.closed:
            raise RuntimeError("this TraceTable is closed")
        self._launch(stream if type(stream) is int and stream >= 0 else stream_handle(stream))
