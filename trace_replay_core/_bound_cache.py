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
from collections.abc import Callable, Hashable, Iterator
from typing import Any

__all__ = ["BoundCache"]


class BoundCache:
    """At most ``size`` entries of ``key -> bound launch``: a new key beyond that drops the key
    inserted first (insertion order; lookups do not reorder it).

    Look up with ``cache.get(key)`` (``get(key, default=None)``: the wrapped dict's own
    ``get``, a plain dict lookup, for hot paths), or with :meth:`bind`, which binds on a miss.
    Entries go in only through :meth:`bind`: the cache is no dict, so no item assignment or
    ``update`` can pass its size limit or its lock. It reads as a mapping otherwise: ``key in
    cache``, ``len(cache)``, iteration over the keys (oldest first), :meth:`clear`.
    Thread-safe: lookups take no lock (a dict read is atomic in CPython); :meth:`bind` inserts
    and evicts, and :meth:`clear` empties, under the cache's own lock, so concurrent misses on
    one key bind at most once each and never corrupt the order. Host-only.
    """

    __slots__ = ("size", "get", "_entries", "_lock")

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int (got {type(size).__name__} {size!r})")
        self.size = size
        self._entries: dict[Hashable, Any] = {}
        self.get = self._entries.get  # bound once: a lookup is the dict's own, no Python frame
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
            entries = self._entries
            bound = entries.get(key)
            if bound is None:
                bound = bind()
                release = getattr(bound, "release", None)
                if release is not None:
                    release()
                if len(entries) >= self.size:
                    del entries[next(iter(entries))]
                entries[key] = bound
        return bound

    def clear(self) -> None:
        """Drop every entry (host-only)."""
        with self._lock:
            self._entries.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))
