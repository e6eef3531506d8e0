"""A small progress bar for long command-line runs, drawn on stderr.

It draws only when its stream is a terminal and the caller did not ask for quiet output, and
only once a run has lasted ``delay_s`` (short runs print nothing). It redraws at most
``1 / min_interval_s`` times a second and erases its line when it closes, so it never mixes
with the summary printed afterwards.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """Counts ``done`` out of ``total`` units (decoded tokens) under a ``label``.

    ``enabled=None`` (default) means: draw when ``stream`` is a terminal. ``update(n)`` adds
    ``n`` units (the decode loops' ``on_step`` callback fits it directly); ``close()`` erases
    the bar; the object is also a context manager. Host-only, never blocks on anything.
    """

    def __init__(self, total: int, label: str, *, stream: Optional[TextIO] = None, enabled: Optional[bool] = None,
                 width: int = 30, delay_s: float = 0.5, min_interval_s: float = 0.1):
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.delay_s = delay_s
        self.min_interval_s = min_interval_s
        self.done = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False

    def update(self, n: int = 1) -> None:
        """Add ``n`` finished units and redraw if the bar is due."""
        self.done += int(n)
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._start < self.delay_s or now - self._last_draw < self.min_interval_s:
            return
        self._last_draw = now
        self._draw(now)

    def line(self, now: Optional[float] = None) -> str:
        """The bar as text: ``label [#####-----] done/total tokens, rate tokens/s``."""
        now = time.perf_counter() if now is None else now
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = round(frac * self.width)
        rate = self.done / max(now - self._start, 1e-9)
        return (f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] "
                f"{self.done}/{self.total} tokens, {rate:.0f} tokens/s")

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.line(now) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the bar if one was drawn (idempotent)."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
