"""The GPU backend: trace table, per-slot lengths and a ring of staging buffers on one device.

Memory (all owned here, freed by :meth:`GpuBackend.close`):

- ``table``: ``[max_slots, max_trace_len]`` int32, either device memory (``placement="device"``)
  or pinned host memory mapped into the device's address space (``"host_mapped"``: no GPU
  memory, every replay read crosses PCIe).
- ``trace_len``: ``[max_slots]`` int32 in device memory, 0 = untraced.
- a ring of ``staging_depth`` staging pairs (pinned host buffer, device buffer, event).

Staging and its guard: ``stage`` copies tokens straight into the open pair's pinned buffer,
checking the token ids in the same pass (:func:`~.validate.copy_trace`), and records the entry
only once they pass: a refused trace leaves bytes past the fill mark that nothing refers to.
``stage_many`` does the same for many traces at once (a 2-D block: one copy, one check).
``commit(stream)`` appends the entry table, queues one host-to-device copy of the used bytes
and one scatter launch on ``stream``, records the pair's event and opens the next pair. A
pair is written again only after its event has completed: the first ``stage`` into a reused
pair waits for it (host-blocking, and only when ``staging_depth`` commits are still in flight).
Once the open pair is known to be free, ``stage`` makes no driver call at all.
"""

from __future__ import annotations

import struct
from itertools import chain, repeat
from typing import Dict, List, Tuple

import numpy as np

from . import _cuda
from .dlpack import ArrayView
from .kernels.launch import compiled
from .validate import copy_trace

__all__ = ["GpuBackend"]

_META_FIELDS = 3          # slot, length, offset (int64 each)
_META_BYTES = _META_FIELDS * 8
_ALIGN_TOKENS = 4         # each trace starts on a 16-byte boundary


def _no_launch(stream: int) -> None:
    return None


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class _StagingPair:
    def __init__(self, nbytes: int):
        self.host = _cuda.PinnedAllocation(nbytes)
        self.device = _cuda.DeviceAllocation(nbytes)
        self.event = _cuda.Event()
        self._views()

    def _views(self) -> None:
        self.nbytes = self.host.nbytes
        self.tokens = self.host.numpy(np.uint32)         # where stage copies tokens (int32 ids, as uint32)
        self.bytes = memoryview(self.tokens).cast("B")   # where commit packs the entry table

    def grow(self, nbytes: int, keep_tokens: int) -> None:
        """Replace both buffers with ``nbytes`` ones, keeping the first ``keep_tokens`` tokens.

        Only called on the open pair, whose last copy and scatter have completed.
        """
        host = _cuda.PinnedAllocation(nbytes)
        host.numpy(np.uint32)[:keep_tokens] = self.tokens[:keep_tokens]
        device = _cuda.DeviceAllocation(nbytes)
        self.bytes.release()
        self.host.close()
        self.device.close()
        self.host, self.device = host, device
        self._views()

    def close(self) -> None:
        self.host.close()
        self.device.close()
        self.event.close()


class GpuBackend:
    def __init__(self, max_slots: int, max_trace_len: int, *, device_id: int, placement: str,
                 staging_depth: int, staging_bytes: int):
        self.device_id = device_id
        self.max_slots = max_slots
        self.max_trace_len = max_trace_len
        self.placement = placement
        self._closed = False
        self._table_dev = self._table_host = None
        self._pairs = []
        self._trace_len = None
        with _cuda.on_device(device_id):
            self._allocate(staging_depth, staging_bytes)
        self._open = 0
        self._prepared = False                           # the open pair's last commit has completed
        self._entries: Dict[int, Tuple[int, int, int]] = {}   # slot -> (slot, length, token offset)
        self._fill = 0                                   # tokens written into the open pair
        self._longest = 0                                # longest trace staged since the last commit
        self._kernels: Dict[tuple, object] = {}
        self._scatter = None                             # (launch, block, max chunk programs)
        self.guard_waits = 0                              # times stage/commit waited on a pair

    def _allocate(self, staging_depth: int, staging_bytes: int) -> None:
        max_slots, max_trace_len, placement = self.max_slots, self.max_trace_len, self.placement
        init_stream = _cuda.create_stream()
        try:
            table_bytes = max_slots * max_trace_len * 4
            if placement == "device":
                self._table_dev = _cuda.DeviceAllocation(table_bytes)
                self.table_ptr = self._table_dev.ptr
            else:
                self._table_host = _cuda.PinnedAllocation(table_bytes)
                self.table_ptr = self._table_host.device_ptr
            self._trace_len = _cuda.DeviceAllocation(max_slots * 4)
            self.trace_len_ptr = self._trace_len.ptr
            _cuda.memset_d8_async(self.trace_len_ptr, 0, max_slots * 4, init_stream)
            _cuda.memset_d8_async(self.table_ptr, 0, table_bytes, init_stream)
            self._pairs = [_StagingPair(staging_bytes) for _ in range(staging_depth)]
            _cuda.synchronize_stream(init_stream)
        except BaseException:
            self.close()
            raise
        finally:
            _cuda.destroy_stream(init_stream)

    # staging -------------------------------------------------------------------------------
    def _prepare_open(self) -> _StagingPair:
        """The open pair, once the commit that last read it has completed (the staging guard)."""
        pair = self._pairs[self._open]
        if not self._prepared:
            with _cuda.on_device(self.device_id):  # any thread, any current device
                if not pair.event.done():
                    self.guard_waits += 1
                    pair.event.synchronize()
            self._prepared = True
        return pair

    def _reserve(self, pair: _StagingPair, tokens_needed: int, new_entries: int = 1) -> None:
        """Grow the open pair, if need be, to hold ``tokens_needed`` tokens and the entry table
        with ``new_entries`` more entries than now."""
        need = _round_up(tokens_needed * 4, 16) + (len(self._entries) + new_entries) * _META_BYTES + 16
        if need > pair.nbytes:
            with _cuda.on_device(self.device_id):
                pair.grow(max(need, 2 * pair.nbytes), self._fill)

    def stage(self, slot: int, tokens: np.ndarray, vocab_size: int | None) -> None:
        """Copy ``tokens`` (a :func:`~.validate.trace_array` result) into the open pair and check
        its ids in the same pass; record the entry only if they pass (else raise, changing no
        entry, no fill mark and no ring position). The caller holds the table's lock."""
        pair = self._pairs[self._open] if self._prepared else self._prepare_open()
        n = tokens.shape[0]
        start = self._fill
        end = start + n
        if 4 * end + _META_BYTES * len(self._entries) + 52 > pair.nbytes:   # an upper bound of _reserve's need
            self._reserve(pair, end)
        copy_trace(tokens, pair.tokens[start:end], vocab_size=vocab_size)
        self._entries[slot] = (slot, n, start)
        self._fill = (end + _ALIGN_TOKENS - 1) & -_ALIGN_TOKENS
        self._longest = max(self._longest, n)   # an upper bound (a restaged slot may shrink): sizes the grid

    def stage_many(self, slots: List[int], traces, vocab_size: int | None) -> None:
        """Stage ``traces[i]`` for ``slots[i]``, in order, as one step: a 2-D block (one copy
        and one check for all of it; rows padded to 16 bytes in the staging buffer) or a list
        of :func:`~.validate.trace_array` results. All entries are recorded only once every
        trace has passed; a refusal changes no entry, fill mark or ring position. The caller
        holds the table's lock."""
        pair = self._pairs[self._open] if self._prepared else self._prepare_open()
        start = self._fill
        if isinstance(traces, np.ndarray):
            rows, length = traces.shape
            stride = (length + _ALIGN_TOKENS - 1) & -_ALIGN_TOKENS
            end = start + rows * stride
            self._reserve(pair, end, rows)
            copy_trace(traces, pair.tokens[start:end].reshape(rows, stride)[:, :length], vocab_size=vocab_size,
                       name="traces")
            entries = zip(slots, repeat(length), range(start, end, stride))
            longest = length
        else:
            lengths = [t.shape[0] for t in traces]
            end = start + sum((n + _ALIGN_TOKENS - 1) & -_ALIGN_TOKENS for n in lengths)
            self._reserve(pair, end, len(traces))
            entries = []
            at = start
            for i, (slot, tokens, n) in enumerate(zip(slots, traces, lengths)):
                copy_trace(tokens, pair.tokens[at:at + n], vocab_size=vocab_size, name=f"traces[{i}]")
                entries.append((slot, n, at))
                at = (at + n + _ALIGN_TOKENS - 1) & -_ALIGN_TOKENS
            longest = max(lengths, default=0)
        self._entries.update(zip(slots, entries))     # a slot given twice keeps its last entry
        self._fill = end
        self._longest = max(self._longest, longest)

    def clear(self, slot: int) -> None:
        self._entries[slot] = (slot, 0, 0)

    def pending(self) -> int:
        return len(self._entries)

    def _scatter_kernel(self):
        """(scatter launcher, its block, most programs per entry); compiled on first use."""
        if self._scatter is None:
            from .kernels.scatter import SCATTER_BLOCK, SCATTER_MAX_CHUNK_PROGRAMS, SCATTER_NUM_WARPS, scatter_kernel
            kernel = compiled(scatter_kernel, self.device_id, ("int64", "int32", "int32", "int32"), 2,
                              {"BLOCK": SCATTER_BLOCK}, SCATTER_NUM_WARPS)
            # A launcher of this table's own (its parameter block is rewritten by every commit,
            # under the table's lock).
            self._scatter = (kernel.launcher(), SCATTER_BLOCK, SCATTER_MAX_CHUNK_PROGRAMS)
        return self._scatter

    def commit(self, stream: int) -> None:
        entries = self._entries
        if not entries:
            return
        with _cuda.on_device(self.device_id):  # any thread, any current device
            if _cuda.stream_is_capturing(stream):
                raise RuntimeError("commit() cannot be captured into a CUDA graph: its staging data changes "
                                   "every time; commit outside the graph, between replays")
            launch, block, max_chunks = self._scatter_kernel()
            pair = self._prepare_open()
            self._reserve(pair, self._fill)
            meta_off = _round_up(self._fill * 4, 16)
            n = len(entries)
            # The entry table, packed straight into pinned memory: (slot, length, offset) int64 each.
            # One pack_into for all entries: 64 entries cost ~7 us against ~60 us row by row in numpy.
            struct.pack_into(f"<{n * _META_FIELDS}q", pair.bytes, meta_off, *chain.from_iterable(entries.values()))
            nbytes = meta_off + n * _META_BYTES
            _cuda.memcpy_htod_async(pair.device.ptr, pair.host.ptr, nbytes, stream)
            chunks = max(1, min(-(-self._longest // block), max_chunks))
            launch((n, chunks, 1), stream, pair.device.ptr + meta_off, pair.device.ptr,
                   self.table_ptr, self.trace_len_ptr, self.max_trace_len, chunks)
            pair.event.record(stream)
            self._entries = {}
            self._fill = 0
            self._longest = 0
            self._open = (self._open + 1) % len(self._pairs)
            self._prepared = False

    # replay --------------------------------------------------------------------------------
    def replay_kernel(self, dtypes: Tuple[str, str, str, str], per_row_step: bool):
        key = (dtypes, per_row_step)
        kernel = self._kernels.get(key)
        if kernel is None:
            from .kernels.replay import REPLAY_BLOCK, REPLAY_NUM_WARPS, replay_kernel
            kernel = compiled(replay_kernel, self.device_id, dtypes + ("int32", "int32"), 3,
                              {"PER_ROW_STEP": per_row_step, "BLOCK": REPLAY_BLOCK}, REPLAY_NUM_WARPS)
            self._kernels[key] = kernel
        return kernel

    def _replay_launch(self, sampled: ArrayView, idx: ArrayView, first: ArrayView, second, per_row_step: bool):
        """(kernel, grid, args) of a replay onto these arrays; ``None`` for an empty batch."""
        from .kernels.replay import REPLAY_BLOCK
        second = first if second is None else second
        kernel = self.replay_kernel((sampled.dtype, idx.dtype, first.dtype, second.dtype), per_row_step)
        rows = sampled.shape[0]
        if rows == 0:
            return None
        return kernel, ((rows + REPLAY_BLOCK - 1) // REPLAY_BLOCK, 1, 1), (
            sampled.ptr, idx.ptr, first.ptr, second.ptr, self.table_ptr, self.trace_len_ptr, rows,
            self.max_slots, self.max_trace_len)

    def bind(self, sampled: ArrayView, idx: ArrayView, first: ArrayView, second, per_row_step: bool):
        """Return ``launch(stream)`` replaying onto exactly these arrays (pointers fixed)."""
        spec = self._replay_launch(sampled, idx, first, second, per_row_step)
        if spec is None:
            return _no_launch
        kernel, grid, args = spec
        return kernel.bind(grid, *args)

    def replay(self, sampled: ArrayView, idx: ArrayView, first: ArrayView, second, per_row_step: bool,
               stream: int) -> None:
        # One launch: no parameter block to pack, unlike a bound replay.
        spec = self._replay_launch(sampled, idx, first, second, per_row_step)
        if spec is not None:
            kernel, grid, args = spec
            kernel.launch(grid, stream, *args)

    # inspection ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        with _cuda.on_device(self.device_id):
            _cuda.synchronize_device()

    def device_views(self):
        table = ArrayView(self.table_ptr, (self.max_slots, self.max_trace_len), (self.max_trace_len, 1), "int32",
                          "cuda", self.device_id)
        lengths = ArrayView(self.trace_len_ptr, (self.max_slots,), (1,), "int32", "cuda", self.device_id)
        return table, lengths

    def snapshot(self):
        """Host-blocking copy of (table, trace_len) after all queued work on the device."""
        from cuda.bindings import driver as cu
        table = np.empty((self.max_slots, self.max_trace_len), dtype=np.int32)
        lengths = np.empty(self.max_slots, dtype=np.int32)
        with _cuda.on_device(self.device_id):
            _cuda.synchronize_device()
            _cuda._check(cu.cuMemcpyDtoH(table.ctypes.data, self.table_ptr, table.nbytes), "cuMemcpyDtoH")
            _cuda._check(cu.cuMemcpyDtoH(lengths.ctypes.data, self.trace_len_ptr, lengths.nbytes),
                         "cuMemcpyDtoH")
        return table, lengths

    def close(self) -> None:
        """Host-blocking: waits for all queued device work, then frees everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _cuda.on_device(self.device_id):
            _cuda.synchronize_device()
            for pair in self._pairs:
                pair.close()
            self._pairs = []
            for alloc in (self._table_dev, self._table_host, self._trace_len):
                if alloc is not None:
                    alloc.close()
