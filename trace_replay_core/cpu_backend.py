"""The CPU backend: the trace table in numpy, replay vectorised, same semantics as the GPU.

Used when the table is created with ``device="cpu"``: on a machine without a GPU, or for
arrays that live in host memory. Every call completes before it returns (there is no stream
to order against; the ``stream`` a caller passes is validated and otherwise unused).
"""

from __future__ import annotations

import ctypes
from typing import Dict, List, Optional

import numpy as np

from .dlpack import ArrayView
from .validate import copy_trace

__all__ = ["CpuBackend", "numpy_of"]


def numpy_of(view: ArrayView) -> np.ndarray:
    """A numpy array over a contiguous CPU view's memory (no copy; writes go to the producer)."""
    if view.size == 0:
        return np.empty(view.shape, dtype=view.dtype)
    nbytes = view.size * view.itemsize
    buf = (ctypes.c_char * nbytes).from_address(view.ptr)
    return np.frombuffer(buf, dtype=view.dtype).reshape(view.shape)


class CpuBackend:
    def __init__(self, max_slots: int, max_trace_len: int):
        self.table = np.zeros((max_slots, max_trace_len), dtype=np.int32)
        self.trace_len = np.zeros(max_slots, dtype=np.int32)
        self._staged: Dict[int, Optional[np.ndarray]] = {}

    # staging -------------------------------------------------------------------------------
    def stage(self, slot: int, tokens: np.ndarray, vocab_size: int | None) -> None:
        """Copy ``tokens`` (a :func:`~.validate.trace_array` result) and check its ids in one pass;
        the copy becomes the staged trace of ``slot`` only if they pass (else this raises)."""
        staged = np.empty(tokens.shape[0], dtype=np.uint32)
        copy_trace(tokens, staged, vocab_size=vocab_size)
        self._staged[slot] = staged.view(np.int32)

    def stage_many(self, slots: List[int], traces, vocab_size: int | None) -> None:
        """``stage`` for each pair in order, recorded only once every trace has passed; a 2-D
        block is copied and checked in one pass."""
        if isinstance(traces, np.ndarray):
            block = np.empty(traces.shape, dtype=np.uint32)
            copy_trace(traces, block, vocab_size=vocab_size, name="traces")
            staged = list(block.view(np.int32))
        else:
            staged = []
            for i, tokens in enumerate(traces):
                out = np.empty(tokens.shape[0], dtype=np.uint32)
                copy_trace(tokens, out, vocab_size=vocab_size, name=f"traces[{i}]")
                staged.append(out.view(np.int32))
        self._staged.update(zip(slots, staged))

    def clear(self, slot: int) -> None:
        self._staged[slot] = None

    def pending(self) -> int:
        return len(self._staged)

    def commit(self, stream: int) -> None:
        for slot, tokens in self._staged.items():
            if tokens is None:
                self.trace_len[slot] = 0
            else:
                self.table[slot, : tokens.shape[0]] = tokens
                self.trace_len[slot] = tokens.shape[0]
        self._staged.clear()

    # replay --------------------------------------------------------------------------------
    def bind(self, sampled: ArrayView, idx: ArrayView, first: ArrayView, second: Optional[ArrayView],
             per_row_step: bool):
        def launch(stream: int) -> None:
            self.replay(sampled, idx, first, second, per_row_step, stream)
        return launch

    def replay(self, sampled: ArrayView, idx: ArrayView, first: ArrayView, second: Optional[ArrayView],
               per_row_step: bool, stream: int) -> None:
        out = numpy_of(sampled).reshape(-1)
        slot = numpy_of(idx).astype(np.int64)
        max_slots = self.table.shape[0]
        active = (slot >= 0) & (slot < max_slots)
        s = np.where(active, slot, 0)
        n = self.trace_len[s].astype(np.int64)
        if per_row_step:
            step = numpy_of(first).astype(np.int64)
        else:
            step = numpy_of(first)[s].astype(np.int64) - numpy_of(second)[s].astype(np.int64)
        active &= (n > 0) & (step >= 0) & (step < n)
        rows = np.nonzero(active)[0]
        out[rows] = self.table[s[rows], step[rows]].astype(out.dtype)

    # inspection ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        return None

    def device_views(self):
        def view(a):
            return ArrayView(a.ctypes.data, a.shape, tuple(x // a.itemsize for x in a.strides), "int32", "cpu", 0,
                             keepalive=a)
        return view(self.table), view(self.trace_len)

    def snapshot(self):
        return self.table.copy(), self.trace_len.copy()

    def close(self) -> None:
        self._staged.clear()
