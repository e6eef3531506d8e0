"""The library's warning categories (one place, so that a user filters each by its class)."""

from __future__ import annotations

__all__ = ["StagedWritesWarning"]


class StagedWritesWarning(RuntimeWarning):
    """A replay was asked for while traces were staged but not committed (an adapter's
    ``add_request`` / ``remove_request`` without ``apply_staged_writes()``): the replay reads
    the traces of the last commit, so a new trace is not replayed and a removed one still is.

    The adapters' states warn with it once per state, and raise instead with ``strict=True``.
    Where staging ahead of a replay is intended (the next step's requests staged while this
    step replays), silence it by its class:
    ``warnings.filterwarnings("ignore", category=StagedWritesWarning)``.
    """
