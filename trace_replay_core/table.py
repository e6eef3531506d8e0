"""``TraceTable``: the framework-neutral trace replay state.

A table of ``max_slots`` rows of up to ``max_trace_len`` int32 tokens, one row per request
slot of a decode loop, plus the trace length of each slot. Traces are staged on the host and
committed in one stream-ordered batch; replay then overwrites sampled tokens on the device.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

import numpy as np

from . import host_copy
from .dlpack import ArrayView, as_view, check_view
from .streams import stream_handle
from .validate import check_positive_int, check_slot, check_slots, trace_array, trace_block

__all__ = ["TraceTable", "BoundReplay", "PLACEMENTS", "INDEX_DTYPES", "TOKEN_DTYPES", "parse_device", "default_device"]

PLACEMENTS = ("device", "host_mapped")
TOKEN_DTYPES = ("int32", "int64")
INDEX_DTYPES = ("int32", "int64")


def default_device() -> str:
    """``"cuda:0"`` when a CUDA device is visible, else ``"cpu"``. Host-only."""
    from ._cuda import gpu_count
    return "cuda:0" if gpu_count() > 0 else "cpu"


def parse_device(device: Any) -> str:
    """Normalise ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or an int N to ``"cpu"`` / ``"cuda:N"``."""
    if isinstance(device, bool):
        raise TypeError(f"device must be 'cpu', 'cuda', 'cuda:N' or an int (got bool {device!r})")
    if isinstance(device, int):
        device = f"cuda:{device}"
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu', 'cuda', 'cuda:N' or an int (got {type(device).__name__})")
    if device == "cpu":
        return device
    if device == "cuda":
        device = "cuda:0"
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or an int (got {device!r})")
    from ._cuda import gpu_count
    count = gpu_count()
    if int(index) >= count:
        raise ValueError(f"device {device!r} is not available: this process sees {count} CUDA device(s); "
                         f"use device='cpu' for the CPU backend")
    return device


class TraceTable:
    """Trace storage and replay for one device.

    Parameters
    ----------
    max_slots, max_trace_len:
        Table shape: request slots, and tokens per trace (a trace may fill its row).
    device:
        ``"cpu"`` (numpy backend), ``"cuda"``, ``"cuda:N"`` or an int. Keyword-only, required.
    placement:
        ``"device"``: table in device memory (``4 * max_slots * max_trace_len`` bytes of GPU
        memory). ``"host_mapped"``: table in pinned host memory mapped into the device's address
        space; no GPU memory, every replay read crosses PCIe. Ignored on the CPU backend.
    vocab_size:
        When given, staged tokens must be below it.
    staging_depth, staging_bytes:
        Ring of staging buffers (commits that may be in flight before ``stage`` waits) and the
        initial size of each (grown on demand).

    Ownership and blocking: the table owns all its memory. Construction and :meth:`close` are
    host-blocking; :meth:`stage`, :meth:`stage_many` and :meth:`clear` are host-only;
    :meth:`commit` and :meth:`replay` are stream-ordered and never synchronise with the device
    (staging may wait for a staging buffer when ``staging_depth`` commits are still in flight).
    Staging methods are thread-safe (one lock); replay reads no host state that staging changes.
    The first table of a process loads staging's native copy (:mod:`~.host_copy`), compiling
    it first when this machine has no cached build (a C compiler run, well under a second).
    """

    def __init__(self, max_slots: int, max_trace_len: int, *, device: Any, placement: str = "device",
                 vocab_size: Optional[int] = None, staging_depth: int = 4, staging_bytes: int = 1 << 20):
        self.max_slots = check_positive_int(max_slots, name="max_slots")
        self.max_trace_len = check_positive_int(max_trace_len, name="max_trace_len")
        if vocab_size is not None:
            vocab_size = check_positive_int(vocab_size, name="vocab_size")
        self.vocab_size = vocab_size
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS} (got {placement!r})")
        staging_depth = check_positive_int(staging_depth, name="staging_depth", maximum=1024)
        staging_bytes = check_positive_int(staging_bytes, name="staging_bytes", maximum=2**40)
        if self.max_slots * self.max_trace_len >= 2**40:
            raise ValueError(f"max_slots * max_trace_len must be below 2**40 tokens "
                             f"(got {self.max_slots} * {self.max_trace_len})")
        self.device = parse_device(device)
        self.placement = placement
        host_copy.prepare()           # staging's native copy: built once per machine, loaded once per process
        self._lock = threading.Lock()
        self._closed = False
        self._backend = None
        if self.device == "cpu":
            from .cpu_backend import CpuBackend
            self._backend = CpuBackend(self.max_slots, self.max_trace_len)
        else:
            from .gpu_backend import GpuBackend
            self._backend = GpuBackend(self.max_slots, self.max_trace_len, device_id=int(self.device[5:]),
                                       placement=placement, staging_depth=staging_depth,
                                       staging_bytes=max(64, staging_bytes + 15) // 16 * 16)

    # lifetime --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self):
        if self._closed:
            raise RuntimeError("this TraceTable is closed")
        return self._backend

    def close(self) -> None:
        """Free all memory. Host-blocking (waits for queued device work first); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._backend is not None:
                self._backend.close()

    def __enter__(self) -> "TraceTable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may already be gone
            pass

    @property
    def nbytes(self) -> int:
        """Bytes of table memory (device memory, or pinned host memory when host-mapped)."""
        return self.max_slots * self.max_trace_len * 4

    # staging ---------------------------------------------------------------------------------
    def stage(self, slot: int, tokens: Any) -> None:
        """Stage ``tokens`` as the trace of ``slot`` for the next :meth:`commit`. Host-only.

        ``tokens``: 1-D integer host data (list, numpy array, CPU tensor), non-empty,
        non-negative, at most ``max_trace_len`` long, below ``vocab_size`` when set; it is
        copied, so the caller may reuse it at once. Staging a slot again before the commit
        replaces the earlier trace. A rejected call changes nothing.
        """
        if self._closed:
            self._live()                              # raises
        if type(slot) is not int or not 0 <= slot < self.max_slots:
            slot = check_slot(slot, self.max_slots)
        arr = trace_array(tokens, max_trace_len=self.max_trace_len)
        # The backend copies the trace into its staging memory and checks the token ids in the
        # same pass (validate.copy_trace); it records the entry only once they pass.
        with self._lock:
            if self._closed:
                self._live()
            self._backend.stage(slot, arr, self.vocab_size)

    def stage_many(self, slots: Any, traces: Any) -> None:
        """Stage ``traces[i]`` as the trace of ``slots[i]`` for every ``i``: the same as calling
        :meth:`stage` for each pair in order, in one call. Host-only.

        ``slots``: a sequence of ints or a 1-D integer host array. ``traces``: either a 2-D integer
        host array ``[len(slots), length]`` (every trace ``length`` tokens: the whole block is
        copied into staging memory and checked in one pass, the fast way to admit many requests
        at once), or a sequence of ``len(slots)`` 1-D traces of any lengths. Each trace follows
        :meth:`stage`'s rules and is copied. A slot given twice takes its last trace. A
        rejected call changes nothing: no trace of it is staged.
        """
        if self._closed:
            self._live()                              # raises
        slots = check_slots(slots, self.max_slots)
        if isinstance(traces, (list, tuple)):
            if len(traces) != len(slots):
                raise ValueError(f"traces has {len(traces)} traces but slots has {len(slots)} entries")
            traces = [trace_array(t, max_trace_len=self.max_trace_len, name=f"traces[{i}]")
                      for i, t in enumerate(traces)]
        elif isinstance(traces, np.ndarray) or hasattr(traces, "__dlpack__"):
            traces = trace_block(traces, rows=len(slots), max_trace_len=self.max_trace_len)
        else:
            raise TypeError(f"traces must be a 2-D integer array [traces, tokens] or a list of 1-D traces "
                            f"(got {type(traces).__name__})")
        if not slots:
            return
        # The backend copies every trace into its staging memory, checking the ids on the way
        # (validate.copy_trace), and records the entries only once all of them pass.
        with self._lock:
            if self._closed:
                self._live()
            self._backend.stage_many(slots, traces, self.vocab_size)

    def clear(self, slot: int) -> None:
        """Stage "no trace" for ``slot`` (its rows are then left alone by replay). Host-only."""
        backend = self._live()
        if type(slot) is not int or not 0 <= slot < self.max_slots:
            slot = check_slot(slot, self.max_slots)
        with self._lock:
            self._live()
            backend.clear(slot)

    @property
    def pending(self) -> int:
        """Number of slots staged since the last commit."""
        return self._live().pending()

    def commit(self, *, stream: Any) -> None:
        """Apply everything staged since the last commit, ordered on ``stream``.

        One host-to-device copy and one scatter launch; no host synchronisation. Replays queued
        on ``stream`` after this call see the new traces; earlier ones see the old. Not
        capturable in a CUDA graph (call it between graph replays).
        """
        handle = stream_handle(stream)
        backend = self._live()
        with self._lock:
            backend.commit(handle)

    # replay ----------------------------------------------------------------------------------
    def _sampled(self, sampled: Any, handle: int) -> ArrayView:
        v = as_view(sampled, name="sampled", stream=handle)
        if v.ndim == 2 and v.shape[1] != 1:
            raise ValueError(f"sampled has {v.shape[1]} tokens per row (shape {list(v.shape)}): speculative "
                             f"decoding is not supported; replay takes exactly one token per request per step")
        if v.ndim not in (1, 2):
            raise ValueError(f"sampled must be 1-D [batch] or [batch, 1] (got shape {list(v.shape)})")
        return check_view(v, name="sampled", dtypes=TOKEN_DTYPES, device=self.device, writable=True)

    def views(self, sampled: Any, idx_mapping: Any, total_len: Any = None, prompt_len: Any = None,
              step: Any = None, *, stream: Any) -> Tuple[ArrayView, ...]:
        """Validate replay arguments and return their views (host-only). Raises on bad input."""
        handle = stream_handle(stream)
        s = self._sampled(sampled, handle)
        rows = s.shape[0]
        idx = check_view(as_view(idx_mapping, name="idx_mapping", stream=handle), name="idx_mapping",
                         dtypes=INDEX_DTYPES, device=self.device, ndim=1, length=rows)
        if step is not None:
            st = check_view(as_view(step, name="step", stream=handle), name="step", dtypes=INDEX_DTYPES,
                            device=self.device, ndim=1, length=rows)
            return s, idx, st
        tl = check_view(as_view(total_len, name="total_len", stream=handle), name="total_len",
                        dtypes=INDEX_DTYPES, device=self.device, ndim=1, min_length=self.max_slots)
        pl = check_view(as_view(prompt_len, name="prompt_len", stream=handle), name="prompt_len",
                        dtypes=INDEX_DTYPES, device=self.device, ndim=1, min_length=self.max_slots)
        return s, idx, tl, pl

    def replay(self, sampled: Any, idx_mapping: Any, total_len: Any, prompt_len: Any, *, stream: Any) -> None:
        """Overwrite traced rows of ``sampled`` in place, ordered on ``stream``; never blocks.

        ``sampled``: ``[batch]`` or ``[batch, 1]`` int32/int64, writable. ``idx_mapping``:
        ``[batch]`` int32/int64 slot per row (-1: no request). ``total_len``, ``prompt_len``:
        per-slot int32/int64 arrays of at least ``max_slots`` entries, read on the device; the
        step of a row is ``total_len[slot] - prompt_len[slot]``. Arrays are DLPack objects or
        :class:`ArrayView`; they must stay alive until the queued work has run (as for any
        stream-ordered call).
        """
        handle = stream_handle(stream)
        s, idx, tl, pl = self.views(sampled, idx_mapping, total_len, prompt_len, stream=handle)
        self._live().replay(s, idx, tl, pl, False, handle)

    def replay_at_step(self, sampled: Any, idx_mapping: Any, step: Any, *, stream: Any) -> None:
        """As :meth:`replay`, with the step of each row given directly: ``step[b]`` (``[batch]``
        int32/int64, outputs already produced by row ``b``'s request)."""
        handle = stream_handle(stream)
        s, idx, st = self.views(sampled, idx_mapping, step=step, stream=handle)
        self._live().replay(s, idx, st, None, True, handle)

    def bind_replay(self, sampled: Any, idx_mapping: Any, total_len: Any = None, prompt_len: Any = None,
                    step: Any = None, *, stream: Any) -> "BoundReplay":
        """Validate the arrays once and return a :class:`BoundReplay` that replays onto them.

        For loops that reuse the same buffers every step (persistent input buffers, CUDA graphs):
        each call of the result only queues the kernel. Give ``total_len`` and ``prompt_len``, or
        ``step``. The bound replay holds the arrays' DLPack capsules, keeping them alive.
        ``stream`` is used for the DLPack handshake here; each call names its own stream.
        """
        handle = stream_handle(stream)
        views = self.views(sampled, idx_mapping, total_len, prompt_len, step, stream=handle)
        backend = self._live()
        if step is not None:
            return BoundReplay(self, backend.bind(views[0], views[1], views[2], None, True), views)
        return BoundReplay(self, backend.bind(views[0], views[1], views[2], views[3], False), views)

    # inspection ------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Host-blocking: wait until all work queued on the table's device has finished."""
        self._live().synchronize()

    def device_views(self) -> Tuple[ArrayView, ArrayView]:
        """Views of the table (``[max_slots, max_trace_len]`` int32) and trace lengths
        (``[max_slots]`` int32) where replay reads them, for adapters that read them inside
        their own programs (e.g. JAX, through DLPack: the views export themselves zero-copy).

        The table owns the memory: the views are valid until :meth:`close`, and a
        :meth:`commit` changes their contents in its stream order. A host-mapped table is
        described by its device address. Host-only.
        """
        return self._live().device_views()

    def snapshot(self) -> Tuple[np.ndarray, np.ndarray]:
        """Host copies of (table, trace_len) as committed. Host-blocking (synchronises the device)."""
        return self._live().snapshot()


class BoundReplay:
    """A replay whose arrays were validated and fixed by :meth:`TraceTable.bind_replay`.

    ``bound(stream=s)`` queues the replay on stream ``s`` (stream-ordered, never blocks): the
    cheapest way to replay, a single kernel launch. ``views`` holds the validated arrays.
    """

    __slots__ = ("_table", "_launch", "views")

    def __init__(self, table: TraceTable, launch, views):
        self._table = table
        self._launch = launch
        self.views = views

    def __call__(self, *, stream: Any) -> None:
        if self._table._closed:
            raise RuntimeError("this TraceTable is closed")
        self._launch(stream if type(stream) is int and stream >= 0 else stream_handle(stream))
