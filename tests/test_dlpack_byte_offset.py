"""DLPack intake honours ``byte_offset``: the data starts at ``data + byte_offset``.

numpy, torch and JAX export a slice with the offset already added to ``data`` (``byte_offset``
0), so only a producer that uses the field can show whether the intake reads it. This one
hands out a hand-built DLPack 0.x capsule (``dltensor``) over a numpy buffer, with ``data`` at
the buffer's start and the slice's position in ``byte_offset``.
"""

from __future__ import annotations

import ctypes

import numpy as np
from helpers import POISON
from helpers.dlpack_producers import KDL_CPU, KDL_INT, NAME, DataType, Device, Managed, capsule_new

from trace_replay_core import TraceTable, as_view


class OffsetProducer:
    """``buffer[start:start + length]`` (1-D signed integers) exported with ``data`` at the
    buffer's start and ``byte_offset = start * itemsize``. Owns every structure it hands out
    (no deleter): keep it alive while a view of it is in use."""

    def __init__(self, buffer: np.ndarray, start: int, length: int):
        self.buffer = buffer
        self._shape = (ctypes.c_int64 * 1)(length)
        self._strides = (ctypes.c_int64 * 1)(1)
        self._managed = Managed()
        t = self._managed.dl_tensor
        t.data = buffer.ctypes.data
        t.device = Device(KDL_CPU, 0)
        t.ndim = 1
        t.dtype = DataType(KDL_INT, buffer.dtype.itemsize * 8, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = start * buffer.dtype.itemsize

    def __dlpack__(self, stream=None):  # a producer from before DLPack 1.0: no max_version
        return capsule_new(ctypes.addressof(self._managed), NAME, None)

    def __dlpack_device__(self):
        return (KDL_CPU, 0)


def test_the_view_starts_at_data_plus_byte_offset():
    buf = np.arange(100, dtype=np.int64)
    producer = OffsetProducer(buf, 17, 23)
    v = as_view(producer, name="a")
    assert v.ptr == buf.ctypes.data + 17 * 8
    assert v.shape == (23,) and v.dtype == "int64"


def test_replay_writes_at_the_offset_and_nowhere_else(rng):
    trace = rng.integers(1, 50_000, 6)
    with TraceTable(4, 8, device="cpu") as table:
        table.stage(2, trace)
        table.commit(stream=0)
        buf = np.full(12, POISON, np.int64)
        sampled = OffsetProducer(buf, 5, 3)  # rows 0..2 are buf[5:8]
        idx = np.array([2, -1, 2], np.int32)
        step = np.array([4, 0, 1], np.int32)
        table.replay_at_step(sampled, idx, step, stream=0)
        want = np.full(12, POISON, np.int64)
        want[5], want[7] = trace[4], trace[1]
        assert buf.tolist() == want.tolist()
