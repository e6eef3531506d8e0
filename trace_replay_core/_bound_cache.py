"""``BoundCache``: bound launches kept under a key that describes the arrays they were bound to.

A decode loop hands over arrays of the same few layouts step after step (a framework's caching
allocator reuses addresses), so the table (:meth:`~trace_replay_core.TraceTable.replay_cached`)
and the adapters' logprob calls bind a launch once per layout and only launch it afterwards.
The key is whatever describes that layout completely (data pointers, dtypes, shapes, strides):
equal keys describe the same memory, so a cached launch is exactly what binding again would
give. An entry keeps only pointers, never the arrays: old arrays must be free to go. Beyond its
size the cache drops the key inserted first: insertion order, not least recently used (a lookup
does not refresh an entry; a loop of more layouts than the size binds again in turn).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["BoundCache"]


class BoundCache(dict):
    """A dict of ``key -> bound launch`` holding at most ``size`` entries: a new key beyond that
    drops the key inserted first (the dict's order; lookups do not reorder it).

    Look up with ``cache.get(key)`` (a plain dict lookup, for hot paths), or with
    :meth:`bind`, which binds on a miss. Thread-safe: lookups take no lock (a dict read is
    atomic in CPython); :meth:`bind` inserts and evicts under the cache's own lock, so
    concurrent misses on one key bind at most once each and never corrupt the order. Host-only.
    """

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self._lock = threading.Lock()

    def bind(self, key: Hashable, bind: Callable[[], Any]) -> Any:
        """The cached launch for ``key``, or ``bind()``'s result, cached. A result with a
        ``release()`` method (:class:`~trace_replay_core.BoundReplay`,
        :class:`~trace_replay_core.BoundLogprobRank`) is released first: it drops the DLPack
        capsules that would keep the arrays alive, since the key stands for them now."""
        bound = self.get(key)
        if bound is not None:
            return bound
        with self._lock:
            bound = self.get(key)
            if bound is None:
                bound = bind()
                release = getattr(bound, "release", None)
                if release is not None:
                    release()
                if len(self) >= self.size:
                    self.pop(next(iter(self)))
                self[key] = bound
        return bound
