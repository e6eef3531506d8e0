"""``BoundCache``: bound launches kept by the layout of the arrays they were bound to.

A decode loop hands over arrays of the same few layouts step after step (a framework's caching
allocator reuses addresses), so adapters bind a launch (:class:`~trace_replay_core.BoundReplay`,
:class:`~trace_replay_core.BoundLogprobRank`) once per layout and only launch it afterwards.
The key is whatever describes that layout completely (data pointers, dtypes, shapes, strides):
equal keys describe the same memory, so a cached launch is exactly what binding again would
give. An entry keeps only pointers, never the arrays: old arrays must be free to go.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

__all__ = ["BoundCache"]


class BoundCache(dict):
    """A dict of ``key -> bound launch`` holding at most ``size`` entries, oldest dropped first.

    Look up with ``cache.get(key)`` (a plain dict lookup, for hot paths), or with
    :meth:`bind`, which binds on a miss. Host-only; not thread-safe (one per caller state).
    """

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def bind(self, key: Hashable, bind: Callable[[], Any]) -> Any:
        """The cached launch for ``key``, or ``bind()``'s result, cached without its views (the
        DLPack capsules that would keep the arrays alive)."""
        bound = self.get(key)
        if bound is None:
            bound = bind()
            for v in bound.views:
                v.keepalive = None
            bound.views = ()
            if len(self) >= self.size:
                self.pop(next(iter(self)))
            self[key] = bound
        return bound
