"""The stand-in CUDA driver and the table fixtures of the staging tests (``test_staging.py``,
``test_stage_many.py``).

:class:`FakeDriver`: host memory for every allocation, queued copies and scatter launches that
run in order only when the host waits, so the GPU backend's real staging and commit code (the
pinned staging ring, its growth, the entry table packed by ``commit``, the staging guard) runs
without a GPU. ``fake_cuda`` routes the backend to it for one test; ``make_table`` builds a
table on the numpy backend or on the stand-in; :func:`everything` / :func:`assert_unchanged`
take and compare what a refused call must leave alone.
"""

from __future__ import annotations

import ctypes
import gc
from types import SimpleNamespace

import numpy as np
import pytest

from trace_replay_core import TraceTable, _cuda
from trace_replay_core._device_table import DeviceTable
from trace_replay_core._numpy_backend import NumpyTable
from trace_replay_core.kernels import scatter as scatter_module

__all__ = [
    "BACKENDS",
    "FakeDriver",
    "FakeScatter",
    "fake_cuda",
    "make_table",
    "committed",
    "staged_state",
    "everything",
    "assert_unchanged",
    "expect_rows",
]

BACKENDS = ["cpu", "fake_gpu"]


# A stand-in CUDA driver ---------------------------------------------------------------------
class FakeDriver:
    """The driver calls ``_cuda`` and the GPU backend make, on host memory, with a device queue.

    Copies, memsets and kernel launches are queued in order and run only when the host waits
    (event or stream synchronisation) or calls :meth:`run`: until then a queued copy has not read
    its source, as on a GPU that is still busy. Events complete once the work queued before their
    record has run. Freeing memory that queued work still uses, or queued work reaching outside
    its allocation, is recorded in ``errors`` (and skipped or kept alive: a test then fails
    instead of crashing).
    """

    CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_READY=600)
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUstreamCaptureStatus = SimpleNamespace(CU_STREAM_CAPTURE_STATUS_NONE=0)

    def __init__(self):
        self.buffers = {}  # address -> (ctypes buffer, bytes asked for): host memory for every kind
        self.freed = []  # freed buffers, kept alive
        self.errors = []
        self.queue = []  # queued device work, in order: (run, addresses it touches)
        self.ran = 0  # how many queued items have run
        self.events = {}  # handle -> queue position its work ends at (None: never recorded)
        self.contexts = []
        self._handles = iter(range(1, 1 << 30))

    def run(self, upto=None):
        upto = len(self.queue) if upto is None else upto
        while self.ran < upto:
            self.queue[self.ran][0]()
            self.ran += 1

    def enqueue(self, fn, *addresses):
        self.queue.append((fn, addresses))

    def inside(self, ptr, nbytes):
        """Whether ``[ptr, ptr + nbytes)`` lies within one live allocation."""
        return any(base <= ptr and ptr + nbytes <= base + size for base, (_, size) in self.buffers.items())

    def read(self, ptr, nbytes, dtype):
        return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype).copy()

    # context and device
    def cuInit(self, flags):
        return (0,)

    def cuDeviceGetCount(self):
        return (0, 1)

    def cuDeviceGet(self, ordinal):
        return (0, ordinal)

    def cuDevicePrimaryCtxRetain(self, device):
        return (0, 1000 + device)

    def cuCtxGetCurrent(self):
        return (0, self.contexts[-1] if self.contexts else 0)

    def cuCtxPushCurrent(self, ctx):
        self.contexts.append(int(ctx))
        return (0,)

    def cuCtxPopCurrent(self):
        return (0, self.contexts.pop())

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_FAKE")

    # memory
    def cuMemAlloc(self, nbytes):
        buf = (ctypes.c_char * (nbytes + 256))()
        ptr = (ctypes.addressof(buf) + 255) // 256 * 256
        self.buffers[ptr] = (buf, nbytes)
        return (0, ptr)

    cuMemAllocHost = cuMemAlloc

    def cuMemHostGetDevicePointer(self, ptr, flags):
        return (0, ptr)

    def cuMemFree(self, ptr):
        buf, size = self.buffers.pop(ptr)
        end = ptr + size
        if any(ptr <= a < end for _, addresses in self.queue[self.ran :] for a in addresses):
            self.errors.append(f"memory at {ptr:#x} freed while queued work still uses it")
        self.freed.append(buf)
        return (0,)

    cuMemFreeHost = cuMemFree

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self.enqueue(lambda: ctypes.memmove(dst, src, nbytes), dst, src)
        return (0,)

    def cuMemsetD8Async(self, dst, value, nbytes, stream):
        self.enqueue(lambda: ctypes.memset(dst, value, nbytes), dst)
        return (0,)

    # events and streams
    def cuEventCreate(self, flags):
        handle = next(self._handles)
        self.events[handle] = None
        return (0, handle)

    def cuEventRecord(self, handle, stream):
        self.events[handle] = len(self.queue)
        return (0,)

    def cuEventQuery(self, handle):
        end = self.events[handle]
        return (0,) if end is None or self.ran >= end else (600,)

    def cuEventSynchronize(self, handle):
        self.run(self.events[handle])
        return (0,)

    def cuEventDestroy(self, handle):
        del self.events[handle]
        return (0,)

    def cuStreamIsCapturing(self, stream):
        return (0, 0)

    def cuStreamCreate(self, flags):
        return (0, next(self._handles))

    def cuStreamDestroy(self, stream):
        return (0,)

    def cuStreamSynchronize(self, stream):
        self.run()
        return (0,)

    def cuCtxSynchronize(self):
        self.run()
        return (0,)


class FakeScatter:
    """The scatter kernel's semantics (kernels/scatter.py), queued on the fake device."""

    def __init__(self, driver):
        self.driver = driver
        self.launches = []

    def launcher(self):
        return self.launch

    def launch(self, grid, stream, meta_ptr, tokens_ptr, table_ptr, trace_len_ptr, row_stride, chunks):
        n, chunk_programs, _ = grid
        assert chunk_programs == chunks >= 1
        self.launches.append(grid)

        def scatter():
            driver = self.driver
            if not driver.inside(meta_ptr, 24 * n):
                driver.errors.append(f"scatter: entry table of {n} entries outside the staging buffer")
                return
            meta = np.frombuffer((ctypes.c_int64 * (3 * n)).from_address(meta_ptr), np.int64).reshape(n, 3)
            for slot, length, offset in meta.tolist():
                dst, src = table_ptr + 4 * slot * row_stride, tokens_ptr + 4 * offset
                if not (
                    0 <= length <= row_stride
                    and driver.inside(dst, 4 * row_stride)
                    and driver.inside(trace_len_ptr + 4 * slot, 4)
                    and driver.inside(src, 4 * length)
                ):
                    driver.errors.append(f"scatter: entry {(slot, length, offset)} outside the table or staging")
                    continue
                ctypes.memmove(dst, src, 4 * length)
                ctypes.c_int32.from_address(trace_len_ptr + 4 * slot).value = length

        self.driver.enqueue(scatter, meta_ptr, tokens_ptr, table_ptr, trace_len_ptr)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Route the GPU backend to :class:`FakeDriver` for one test (the real driver is untouched)."""
    gc.collect()  # a real table left to the collector must be closed through the real driver, not this one
    driver = FakeDriver()
    scatter = FakeScatter(driver)
    monkeypatch.setattr(_cuda, "_driver", lambda: driver)
    monkeypatch.setattr(_cuda, "_primary_contexts", {})
    monkeypatch.setattr(scatter_module, "compiled", lambda *args, **kwargs: scatter)
    driver.scatter = scatter
    yield driver
    assert driver.errors == []


@pytest.fixture(params=BACKENDS)
def make_table(request):
    """``make_table(max_slots, max_trace_len, **kw)`` on the numpy backend or the fake-driver GPU one."""
    if request.param == "cpu":
        return lambda *a, **kw: TraceTable(*a, device="cpu", **kw)
    request.getfixturevalue("fake_cuda")
    return lambda *a, **kw: TraceTable(*a, device="cuda:0", **kw)


def committed(t: TraceTable):
    """(table, trace_len) as committed, on either backend."""
    if t.device == "cpu":
        return t.snapshot()
    backend = t._backend
    assert isinstance(backend, DeviceTable)
    driver = _cuda._driver()
    driver.run()
    table = driver.read(backend.table_ptr, t.nbytes, np.int32).reshape(t.max_slots, t.max_trace_len)
    return table, driver.read(backend.trace_len_ptr, 4 * t.max_slots, np.int32)


def staged_state(t: TraceTable):
    """Everything staging keeps between calls, as plain values (to compare before and after)."""
    b = t._backend
    if isinstance(b, NumpyTable):
        return {k: (None if v is None else v.tolist()) for k, v in b._staged.items()}
    assert isinstance(b, DeviceTable)
    ring, staged = b.ring, b.ring.staged
    pair = ring.pairs[ring._open]
    return {
        "entries": dict(staged.entries),
        "fill": staged.fill,
        "open": ring._open,
        "longest": staged.longest,
        "bytes": pair.tokens[: staged.fill].tolist(),
    }


def everything(t: TraceTable):
    """(pending, staged state, committed table and lengths): what a refused call must leave alone."""
    return t.pending, staged_state(t), committed(t)


def assert_unchanged(t: TraceTable, before, case: str) -> None:
    """Fail, naming ``case``, if anything :func:`everything` took in ``before`` has changed."""
    pending0, staged0, (table0, lens0) = before
    assert t.pending == pending0, case
    assert staged_state(t) == staged0, f"{case}: staging changed"
    table1, lens1 = committed(t)
    assert np.array_equal(table0, table1) and np.array_equal(lens0, lens1), f"{case}: table changed"


def expect_rows(t: TraceTable, traces: dict):
    table, lens = committed(t)
    for slot in range(t.max_slots):
        tr = traces.get(slot)
        if tr is None:
            assert lens[slot] == 0, f"slot {slot} should be untraced"
        else:
            tr = np.asarray(tr).astype(np.int64)
            assert lens[slot] == len(tr), f"slot {slot}: length {lens[slot]} != {len(tr)}"
            assert np.array_equal(table[slot, : len(tr)].astype(np.int64), tr), f"slot {slot}: tokens differ"
