"""The GPU backend: trace table, per-slot trace lengths and a staging ring on one device.

Memory (all owned here, freed by :meth:`DeviceTable.close`):

- ``table``: ``[max_slots, max_trace_len]`` int32, either device memory (``placement="device"``)
  or pinned host memory mapped into the device's address space (``"host_mapped"``: no GPU
  memory, every replay read crosses PCIe);
- ``trace_len``: ``[max_slots]`` int32 in device memory, 0 = untraced;
- the staging ring (:class:`~._staging.StagingRing`).

``stage`` copies tokens straight into the ring's open pinned buffer, checking the ids in the
same pass; ``commit(stream)`` queues one host-to-device copy of the used bytes and one scatter
launch (:mod:`.kernels.scatter`) on ``stream``. Replays are launches of
:mod:`.kernels.replay` on raw pointers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import _cuda
from ._dlpack import ArrayView
from ._staging import StagingRing
from .kernels.replay import bind_replay, launch_replay, replay_compiled
from .kernels.scatter import scatter_launcher

__all__ = ["DeviceTable"]


def _no_launch(stream: int) -> None:
    return None


def _ptr(view: ArrayView | None) -> int:
    return 0 if view is None else view.ptr


def _dtype(view: ArrayView | None) -> str:
    return "" if view is None else view.dtype


class DeviceTable:
    """The table of one CUDA device. Not thread-safe on its own: :class:`~._table.TraceTable`
    serialises staging and commits with its lock; replays read no host state staging changes."""

    def __init__(
        self,
        max_slots: int,
        max_trace_len: int,
        *,
        device_id: int,
        placement: str,
        staging_depth: int,
        staging_bytes: int,
    ):
        self.device_id = device_id
        self.max_slots = max_slots
        self.max_trace_len = max_trace_len
        self.placement = placement
        self._closed = False
        self._table_dev: _cuda.DeviceAllocation | None = None
        self._table_host: _cuda.PinnedAllocation | None = None
        self._trace_len: _cuda.DeviceAllocation | None = None
        self.table_ptr = self.trace_len_ptr = 0  # device addresses, set by _allocate
        self._ring: StagingRing | None = None
        self._scatter: Callable[..., None] | None = None  # the table's own scatter launcher, built on first commit
        with _cuda.on_device(device_id):
            self._allocate(staging_depth, staging_bytes)

    def _allocate(self, staging_depth: int, staging_bytes: int) -> None:
        init_stream = _cuda.create_stream()
        try:
            table_bytes = self.max_slots * self.max_trace_len * 4
            if self.placement == "device":
                table_dev = self._table_dev = _cuda.DeviceAllocation(table_bytes)
                self.table_ptr = table_dev.ptr
            else:
                table_host = self._table_host = _cuda.PinnedAllocation(table_bytes)
                self.table_ptr = table_host.device_ptr
            trace_len = self._trace_len = _cuda.DeviceAllocation(self.max_slots * 4)
            self.trace_len_ptr = trace_len.ptr
            _cuda.memset_d8_async(self.trace_len_ptr, 0, self.max_slots * 4, init_stream)
            _cuda.memset_d8_async(self.table_ptr, 0, table_bytes, init_stream)
            self._ring = StagingRing(self.device_id, staging_depth, staging_bytes)
            _cuda.synchronize_stream(init_stream)
        except BaseException:
            self.close()
            raise
        finally:
            _cuda.destroy_stream(init_stream)

    @property
    def ring(self) -> StagingRing:
        """The staging ring (built with the table; the table is unusable without one)."""
        if self._ring is None:
            raise RuntimeError("this DeviceTable has no staging ring (its construction failed)")
        return self._ring

    # staging (the caller holds the table's lock) ----------------------------------------------
    def stage(self, slot: int, tokens: np.ndarray, vocab_size: int | None) -> None:
        self.ring.entries().stage(slot, tokens, vocab_size)

    def stage_many(self, slots: list[int], traces, vocab_size: int | None) -> None:
        self.ring.entries().stage_many(slots, traces, vocab_size)

    def clear(self, slot: int) -> None:
        self.ring.entries().clear(slot)  # waits for the open buffer here, not in commit

    def pending(self) -> int:
        return len(self.ring.staged.entries)

    def commit(self, stream: int) -> None:
        if not self.ring.staged.entries:
            return
        with _cuda.on_device(self.device_id):  # any thread, any current device
            if _cuda.stream_is_capturing(stream):
                raise RuntimeError(
                    "commit() cannot be captured into a CUDA graph: its staging data changes "
                    "every time; commit outside the graph, between replays"
                )
            launch = self._scatter
            if launch is None:
                launch = self._scatter = scatter_launcher(self.device_id)
            table_ptr, trace_len_ptr, stride = self.table_ptr, self.trace_len_ptr, self.max_trace_len
            self.ring.commit(
                stream,
                lambda n, meta_ptr, tokens_ptr, longest: launch(
                    stream, n, longest, meta_ptr, tokens_ptr, table_ptr, trace_len_ptr, stride
                ),
            )

    # replay -------------------------------------------------------------------------------
    def _kernel(
        self,
        sampled: ArrayView,
        idx: ArrayView,
        total: ArrayView | None,
        prompt: ArrayView | None,
        step: ArrayView | None,
    ):
        # check_replay's views: total and prompt, or step (the others None)
        if step is not None:
            return replay_compiled(self.device_id, sampled.dtype, idx.dtype, ("", ""), step.dtype)
        return replay_compiled(self.device_id, sampled.dtype, idx.dtype, (_dtype(total), _dtype(prompt)), None)

    def bind(
        self,
        sampled: ArrayView,
        idx: ArrayView,
        total: ArrayView | None,
        prompt: ArrayView | None,
        step: ArrayView | None,
    ):
        """``launch(stream)`` replaying onto exactly these arrays (pointers fixed)."""
        kernel = self._kernel(sampled, idx, total, prompt, step)
        rows = sampled.shape[0]
        if rows == 0:
            return _no_launch
        return bind_replay(
            kernel,
            rows=rows,
            sampled_ptr=sampled.ptr,
            idx_ptr=idx.ptr,
            total_ptr=_ptr(total),
            prompt_ptr=_ptr(prompt),
            step_ptr=_ptr(step),
            table_ptr=self.table_ptr,
            trace_len_ptr=self.trace_len_ptr,
            max_slots=self.max_slots,
            row_stride=self.max_trace_len,
        )

    def replay(
        self,
        sampled: ArrayView,
        idx: ArrayView,
        total: ArrayView | None,
        prompt: ArrayView | None,
        step: ArrayView | None,
        stream: int,
    ) -> None:
        # One launch: no parameter block to pack, unlike a bound replay.
        kernel = self._kernel(sampled, idx, total, prompt, step)
        rows = sampled.shape[0]
        if rows:
            launch_replay(
                kernel,
                stream,
                rows=rows,
                sampled_ptr=sampled.ptr,
                idx_ptr=idx.ptr,
                total_ptr=_ptr(total),
                prompt_ptr=_ptr(prompt),
                step_ptr=_ptr(step),
                table_ptr=self.table_ptr,
                trace_len_ptr=self.trace_len_ptr,
                max_slots=self.max_slots,
                row_stride=self.max_trace_len,
            )

    # inspection ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        with _cuda.on_device(self.device_id):
            _cuda.synchronize_device()

    def device_views(self):
        table = ArrayView(
            self.table_ptr,
            (self.max_slots, self.max_trace_len),
            (self.max_trace_len, 1),
            "int32",
            "cuda",
            self.device_id,
        )
        lengths = ArrayView(self.trace_len_ptr, (self.max_slots,), (1,), "int32", "cuda", self.device_id)
        return table, lengths

    def snapshot(self):
        """Host-blocking copy of (table, trace_len) after all queued work on the device."""
        table = np.empty((self.max_slots, self.max_trace_len), dtype=np.int32)
        lengths = np.empty(self.max_slots, dtype=np.int32)
        with _cuda.on_device(self.device_id):
            _cuda.synchronize_device()
            _cuda.memcpy_dtoh(table.ctypes.data, self.table_ptr, table.nbytes)
            _cuda.memcpy_dtoh(lengths.ctypes.data, self.trace_len_ptr, lengths.nbytes)
        return table, lengths

    def close(self) -> None:
        """Host-blocking: waits for all queued device work, then frees everything. Idempotent.
        Every resource is released even when the synchronisation or a free fails; the first
        error is raised afterwards (:class:`~._cuda.CudaError`)."""
        if self._closed:
            return
        self._closed = True
        closers: list[Callable[[], None]] = [_cuda.synchronize_device]
        if self._ring is not None:
            closers.append(self._ring.close)
        closers += [alloc.close for alloc in (self._table_dev, self._table_host, self._trace_len) if alloc is not None]
        with _cuda.on_device(self.device_id):
            _cuda.close_all(closers)
