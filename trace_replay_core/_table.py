"""``TraceTable``: the framework-neutral trace replay state.

A table of ``max_slots`` rows of up to ``max_trace_len`` int32 tokens, one row per request
slot of a decode loop, plus the trace length of each slot. Traces are staged on the host and
committed in one stream-ordered batch; replay then overwrites sampled tokens on the device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._bound_cache import BoundCache
from ._bound_replay import BoundReplay
from ._devices import parse_device
from ._dlpack import ArrayView
from ._replay_views import ReplayViews, bound_views, check_per_slot, check_replay
from ._streams import stream_handle
from ._validate import check_distinct_slots, check_positive_int, check_slot, check_slots, trace_array, trace_block

if TYPE_CHECKING:
    from ._device_table import DeviceTable
    from ._numpy_backend import NumpyTable

__all__ = ["TraceTable", "PLACEMENTS"]

PLACEMENTS = ("device", "host_mapped")
_CLOSED = "this TraceTable is closed"
_REPLAY_CACHE_SIZE = 64


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
    (:meth:`stage`, :meth:`stage_many` and :meth:`clear` may wait for a staging buffer when
    ``staging_depth`` commits are still in flight, and grow it; a commit does neither).
    Staging methods are thread-safe (one lock); replay reads no host state that staging changes.
    On a GPU the first commit, and the first replay (or bind) for each dtype signature of its
    arrays, compile a Triton kernel: host-blocking, and not allowed while a CUDA graph is being
    captured, so make them before capturing; later calls find the kernel compiled.

    Errors: a bad argument raises ``TypeError``/``ValueError`` naming it (a rejected call
    changes nothing); on a GPU, a CUDA driver call that fails (allocation, copy, launch, wait)
    raises :class:`~trace_replay_core.CudaError`.
    """

    def __init__(
        self,
        max_slots: int,
        max_trace_len: int,
        *,
        device: Any,
        placement: str = "device",
        vocab_size: int | None = None,
        staging_depth: int = 4,
        staging_bytes: int = 1 << 20,
    ):
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
            raise ValueError(
                f"max_slots * max_trace_len must be below 2**40 tokens (got {self.max_slots} * {self.max_trace_len})"
            )
        self.device = parse_device(device)
        self.placement = placement
        self._lock = threading.Lock()
        self._closed = False
        self._backend: NumpyTable | DeviceTable | None = None  # None only if construction failed
        self._lengths: tuple[ArrayView, ArrayView] | None = None  # bound total_len, prompt_len
        self._replays = BoundCache(_REPLAY_CACHE_SIZE)  # caller key -> launch(stream)
        if self.device == "cpu":
            from ._numpy_backend import NumpyTable

            self._backend = NumpyTable(self.max_slots, self.max_trace_len)
        else:
            from ._device_table import DeviceTable

            self._backend = DeviceTable(
                self.max_slots,
                self.max_trace_len,
                device_id=int(self.device[5:]),
                placement=placement,
                staging_depth=staging_depth,
                staging_bytes=max(64, staging_bytes + 15) // 16 * 16,
            )

    # lifetime --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self) -> NumpyTable | DeviceTable:
        if self._closed or self._backend is None:
            raise RuntimeError(_CLOSED)
        return self._backend

    def close(self) -> None:
        """Free all memory. Host-blocking (waits for queued device work first); idempotent.

        The table is closed even when a driver call fails: the wait or a free that fails does
        not stop the rest from being freed, and the first error (a
        :class:`~trace_replay_core.CudaError`) is raised afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._replays.clear()
            self._lengths = None
            if self._backend is not None:
                self._backend.close()

    def __enter__(self) -> TraceTable:
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
            self._live()  # raises
        if type(slot) is not int or not 0 <= slot < self.max_slots:
            slot = check_slot(slot, self.max_slots)
        arr = trace_array(tokens, max_trace_len=self.max_trace_len)
        # The backend copies the trace into its staging memory and checks the token ids in the
        # same pass (_staging.copy_trace); it records the entry only once they pass.
        with self._lock:
            self._live().stage(slot, arr, self.vocab_size)

    def stage_many(self, slots: Any, traces: Any, *, distinct: bool = False) -> None:
        """Stage ``traces[i]`` as the trace of ``slots[i]`` for every ``i``: the same as calling
        :meth:`stage` for each pair in order, in one call. Host-only.

        ``slots``: a sequence of ints or a 1-D integer host array. ``traces``: either a 2-D integer
        host array ``[len(slots), length]`` (every trace ``length`` tokens: the whole block is
        copied into staging memory and checked in one pass, the fast way to admit many requests
        at once), or a sequence of ``len(slots)`` 1-D traces of any lengths. Each trace follows
        :meth:`stage`'s rules and is copied. A slot given twice takes its last trace, as in
        calls of :meth:`stage` in order; with ``distinct=True`` (one request per slot, as the
        adapters' ``add_requests``) it is refused instead (``ValueError`` naming the slot and
        both positions). A rejected call changes nothing: no trace of it is staged.
        """
        if self._closed:
            self._live()  # raises
        slots = check_slots(slots, self.max_slots)
        if distinct is not False:
            if distinct is not True:
                raise TypeError(f"distinct must be True or False (got {distinct!r})")
            check_distinct_slots(slots)
        if isinstance(traces, (list, tuple)):
            if len(traces) != len(slots):
                raise ValueError(f"traces has {len(traces)} traces but slots has {len(slots)} entries")
            traces = [
                trace_array(t, max_trace_len=self.max_trace_len, name=f"traces[{i}]") for i, t in enumerate(traces)
            ]
        elif isinstance(traces, np.ndarray) or hasattr(traces, "__dlpack__"):
            traces = trace_block(traces, rows=len(slots), max_trace_len=self.max_trace_len)
        else:
            raise TypeError(
                f"traces must be a 2-D integer array [traces, tokens] or a list of 1-D traces "
                f"(got {type(traces).__name__})"
            )
        if not slots:
            return
        # The backend copies every trace into its staging memory, checking the ids on the way
        # (_staging.copy_trace), and records the entries only once all of them pass.
        with self._lock:
            self._live().stage_many(slots, traces, self.vocab_size)

    def clear(self, slot: int) -> None:
        """Stage "no trace" for ``slot`` (its rows are then left alone by replay). Host-only;
        like :meth:`stage`, it may wait for a staging buffer that a commit in flight still reads."""
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

        One host-to-device copy and one scatter launch; no host synchronisation (the first commit
        on a GPU compiles the scatter kernel, host-blocking). Replays queued
        on ``stream`` after this call see the new traces; earlier ones see the old. Not
        capturable in a CUDA graph (call it between graph replays).
        """
        handle = stream_handle(stream)
        if self._closed:
            self._live()  # raises
        with self._lock:  # a close() that won the lock is seen here, as in stage and clear
            self._live().commit(handle)

    # replay ----------------------------------------------------------------------------------
    def _check_replay(
        self, sampled: Any, idx_mapping: Any, total_len: Any, prompt_len: Any, step: Any, handle: int
    ) -> ReplayViews:
        return check_replay(
            sampled,
            idx_mapping,
            total_len,
            prompt_len,
            step,
            max_slots=self.max_slots,
            device=self.device,
            handle=handle,
        )

    def bind_lengths(self, total_len: Any, prompt_len: Any, *, stream: Any) -> None:
        """Bind the per-slot length arrays that :meth:`replay_cached` reads: validated here, once
        (int32/int64, 1-D, at least ``max_slots`` entries, on the table's device, not a copy).

        The table keeps their DLPack capsules, so the memory stays alive while bound; the loop
        keeps the contents current (``total_len[slot]`` = prompt plus outputs so far), and
        replay reads them on the device. Binding again replaces them and forgets every cached
        replay. ``stream`` is the DLPack handshake's. Host-only; a rejected call changes nothing.
        """
        handle = stream_handle(stream)
        self._live()
        lengths = (
            check_per_slot(total_len, "total_len", self.max_slots, device=self.device, handle=handle, bound=True),
            check_per_slot(prompt_len, "prompt_len", self.max_slots, device=self.device, handle=handle, bound=True),
        )
        with self._lock:
            self._replays.clear()
            self._lengths = lengths

    @property
    def lengths_bound(self) -> bool:
        """Whether :meth:`bind_lengths` has bound the per-slot lengths."""
        return self._lengths is not None

    def replay(self, sampled: Any, idx_mapping: Any, total_len: Any, prompt_len: Any, *, stream: Any) -> None:
        """Overwrite traced rows of ``sampled`` in place, ordered on ``stream``; never waits for
        the device. On a GPU the first replay for a device and the dtypes of these arrays
        compiles the replay kernel (host-blocking; make it before capturing a CUDA graph).

        ``sampled``: ``[batch]`` or ``[batch, 1]`` int32/int64, writable. ``idx_mapping``:
        ``[batch]`` int32/int64 slot per row (-1: no request). ``total_len``, ``prompt_len``:
        per-slot int32/int64 arrays of at least ``max_slots`` entries, read on the device; the
        step of a row is ``total_len[slot] - prompt_len[slot]``. Arrays are DLPack objects or
        :class:`ArrayView`; they must stay alive until the queued work has run (as for any
        stream-ordered call). Validates every array on every call, a DLPack handshake each:
        loops that reuse buffers use :meth:`replay_cached` or :meth:`bind_replay`.
        """
        handle = stream_handle(stream)
        views = self._check_replay(sampled, idx_mapping, total_len, prompt_len, None, handle)
        self._live().replay(*views, handle)

    def replay_at_step(self, sampled: Any, idx_mapping: Any, step: Any, *, stream: Any) -> None:
        """As :meth:`replay`, with the step of each row given directly: ``step[b]`` (``[batch]``
        int32/int64, outputs already produced by row ``b``'s request)."""
        handle = stream_handle(stream)
        views = self._check_replay(sampled, idx_mapping, None, None, step, handle)
        self._live().replay(*views, handle)

    def replay_cached(
        self,
        key: Hashable,
        sampled: Any,
        idx_mapping: Any,
        total_len: Any = None,
        prompt_len: Any = None,
        step: Any = None,
        *,
        stream: Any,
    ) -> None:
        """The hot path of a decode loop: replay onto ``sampled``, launching the replay cached
        under ``key`` (stream-ordered, never waits for the device; a miss may compile the kernel,
        as :meth:`replay` does).

        ``key``: any hashable that the caller derives from the memory layout of the arrays it
        passes (``sampled``, ``idx_mapping`` and any of ``total_len``, ``prompt_len``, ``step``):
        data pointers, dtypes, shapes and strides. Equal keys must describe the same memory;
        then a cached replay is exactly what binding again would give. On a miss the arrays are
        validated and bound once (over DLPack; none a copy), with the step source (``total_len`` and
        ``prompt_len``, or ``step``), or else the lengths of :meth:`bind_lengths`; on a hit
        nothing is validated, so a hit costs one dict lookup and one kernel launch. The
        cache keeps pointers, never the arrays: the caller keeps them alive while work is
        queued (a framework's caching allocator does). It holds 64 keys: a miss beyond that
        drops the key bound first (insertion order; a hit does not keep a key longer).

        Thread-safe: lookups take no lock; a miss binds under the table's lock. ``stream``:
        an int handle or an object with ``__cuda_stream__``, resolved once here.
        """
        handle = stream if type(stream) is int and stream >= 0 else stream_handle(stream)
        launch = self._replays.get(key)
        if launch is None:
            launch = self._bind_cached(key, sampled, idx_mapping, total_len, prompt_len, step, handle)
        launch(handle)

    def _bind_cached(
        self, key: Hashable, sampled: Any, idx_mapping: Any, total_len: Any, prompt_len: Any, step: Any, handle: int
    ) -> Callable[[int], None]:
        backend = self._live()
        if step is None and total_len is None and prompt_len is None:
            if self._lengths is None:
                raise ValueError("total_len and prompt_len were neither given nor bound (see bind_lengths)")
            total_len, prompt_len = self._lengths
        views = bound_views(self._check_replay(sampled, idx_mapping, total_len, prompt_len, step, handle))
        with self._lock:
            self._live()
            return self._replays.bind(key, lambda: backend.bind(*views))

    def bind_replay(
        self,
        sampled: Any,
        idx_mapping: Any,
        total_len: Any = None,
        prompt_len: Any = None,
        step: Any = None,
        *,
        stream: Any,
    ) -> BoundReplay:
        """Validate the arrays once and return a :class:`BoundReplay` that replays onto them.

        For loops that reuse the same buffers every step (persistent input buffers, CUDA graphs):
        each call of the result only queues the kernel. Give ``total_len`` and ``prompt_len``, or
        ``step``. The bound replay holds the arrays' DLPack capsules, keeping them alive; an
        array whose producer exported a copy is refused (the launch keeps its pointer).
        ``stream`` is used for the DLPack handshake here; each call names its own stream.
        Host-blocking when it compiles the kernel (the first bind or replay for a device and
        these dtypes); the bound replay's calls never block.
        """
        handle = stream_handle(stream)
        views = bound_views(self._check_replay(sampled, idx_mapping, total_len, prompt_len, step, handle))
        return BoundReplay(self, self._live().bind(*views), tuple(v for v in views if v is not None))

    # inspection ------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Host-blocking: wait until all work queued on the table's device has finished."""
        self._live().synchronize()

    def device_views(self) -> tuple[ArrayView, ArrayView]:
        """Views of the table (``[max_slots, max_trace_len]`` int32) and trace lengths
        (``[max_slots]`` int32) where replay reads them, for adapters that read them inside
        their own programs (e.g. JAX, through DLPack: the views export themselves zero-copy).

        The table owns the memory: the views are valid until :meth:`close`, and a
        :meth:`commit` changes their contents in its stream order. A host-mapped table is
        described by its device address. Host-only.
        """
        return self._live().device_views()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of (table, trace_len) as committed. Host-blocking (synchronises the device)."""
        return self._live().snapshot()
