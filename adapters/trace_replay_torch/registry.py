"""Live ``TraceReplayState`` objects by integer id: how a registered torch op reaches its table.

A torch custom op takes tensors, ints, floats and strings, never an arbitrary Python object, so
the replay ops of :mod:`.ops` name their state by the int that :func:`register` handed it at
construction. Ids count up from 1 and are never reused in a process, so a stale id (a compiled
graph that outlived its state) can never reach another state's table.

The registry holds states weakly: a state that nobody references any more is not kept alive by
a compiled function that once used it; its id then looks up as closed. Thread-safe: ids are
issued and entries removed under one lock; lookups take no lock (one dict read). Host-only.
"""

from __future__ import annotations

import itertools
import threading
import weakref

__all__ = ["register", "unregister", "lookup"]

_LIVE: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_LOCK = threading.Lock()


def register(state) -> int:
    """Enter ``state`` and return its new id (unique in this process, never reused)."""
    with _LOCK:
        state_id = next(_IDS)
        _LIVE[state_id] = state
    return state_id


def unregister(state_id: int) -> None:
    """Remove ``state_id`` (idempotent): later lookups of it raise."""
    with _LOCK:
        _LIVE.pop(state_id, None)


def lookup(state_id: int):
    """The open state with id ``state_id``; ``RuntimeError`` naming the id when it was closed,
    garbage collected or never issued."""
    state = _LIVE.get(state_id)
    if state is None:
        raise RuntimeError(
            f"this TraceReplayState is closed (op id {state_id!r}: closed, garbage collected or never "
            f"opened); a compiled function cannot outlive the state it replays"
        )
    return state
