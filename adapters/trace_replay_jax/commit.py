"""Apply staged writes on XLA's own stream, from inside a tiny jitted program.

On a GPU, replay reads the table inside XLA programs (see ``jnp_replay.py``), all queued on the
device's compute stream in dispatch order. A commit must land after every program already
queued (they may still read the old traces: write-after-read) and before every program
queued later (read-after-write). :class:`XlaCommit` gets exactly that by being one of those
programs: ``jax.experimental.buffer_callback`` runs a Python callback when XLA reaches the op
on the host, with XLA's stream in ``ctx.stream``; the callback calls
``TraceTable.commit(stream=ctx.stream)``, which queues one host-to-device copy and one scatter
launch on that stream and returns. Nothing waits for the device.

The op is not ``command_buffer_compatible``: a command buffer would record the callback once
and replay the recorded copy of old staging data forever. So XLA runs the callback every time
(tens of microseconds of host time), but only on steps that staged something.

The callback runs on a thread XLA chooses, possibly after :meth:`XlaCommit.__call__` returns.
``__call__`` therefore marks a commit in flight and :meth:`XlaCommit.wait` (called before any
new staging) waits until the callback has taken the staged writes, so a trace staged after
``apply_staged_writes()`` never leaks into the commit before it. That wait is host-only: the
callback runs when the op is queued, not when the device reaches it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

__all__ = ["XlaCommit"]


def _xla_stream(ctx) -> int:
    return int(ctx.stream)


class XlaCommit:
    """Calls ``table.commit(stream=<XLA's stream>)`` as a side-effecting op of a jitted program.

    ``table``: anything with ``commit(*, stream)``. ``stream_of(ctx)`` extracts the stream from
    the buffer-callback context (the default reads ``ctx.stream``, which exists on GPUs only).
    Calling the instance with ``anchor`` (a small array on the table's device, which places the
    program there and is not read) queues one commit; stream-ordered, never blocks on the device,
    but first blocks the host as :meth:`wait` does.
    """

    def __init__(self, table: Any, stream_of: Callable[[Any], int] = _xla_stream):
        self._table = table
        self._stream_of = stream_of
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._token: jax.Array | None = None
        op = buffer_callback(self._callback, jax.ShapeDtypeStruct((), np.int32), has_side_effect=True)
        self._run = jax.jit(op)

    def _callback(self, ctx, out, anchor) -> None:
        if getattr(ctx, "stage", ExecutionStage.EXECUTE) != ExecutionStage.EXECUTE:
            return  # only the execute stage queues work
        try:
            self._table.commit(stream=self._stream_of(ctx))
        except BaseException as exc:  # noqa: BLE001 - reported at the next call, on the caller's thread
            self._error = exc
        finally:
            self._idle.set()

    def wait(self) -> None:
        """Block the host until XLA's thread has run the last queued commit's callback (which takes
        the staged writes), not until the device has run the commit; re-raise its error, if it
        had one. The state calls it before staging, reading ``pending`` and applying."""
        while not self._idle.wait(0.05):
            token = self._token
            if token is not None and token.is_ready() and not self._idle.is_set():
                self._idle.set()
                token.block_until_ready()  # raises XLA's error for the program that never ran the op
                raise RuntimeError("the commit queued by apply_staged_writes() finished without running")
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"applying staged writes failed on the device stream: {error}") from error

    def __call__(self, anchor: jax.Array) -> None:
        self.wait()
        self._idle.clear()
        try:
            self._token = self._run(anchor)
        except BaseException:
            self._idle.set()
            raise
