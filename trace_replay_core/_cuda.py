"""Thin, checked wrappers over NVIDIA's CUDA driver bindings (cuda-bindings).

Everything here is imported lazily by the GPU backend, so that importing the core on a
machine without a GPU (or without a driver) costs nothing and fails nowhere.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "CudaError",
    "gpu_count",
    "on_device",
    "DeviceAllocation",
    "PinnedAllocation",
    "Event",
    "memcpy_htod_async",
    "memset_d8_async",
    "stream_is_capturing",
    "synchronize_device",
    "create_stream",
    "destroy_stream",
    "synchronize_stream",
    "close_all",
]


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@functools.cache
def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    cu = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err}")
    if isinstance(result, tuple):
        rest = result[1:]
        return rest[0] if len(rest) == 1 else rest
    return None


def gpu_count() -> int:
    """Number of CUDA devices visible to this process (0 when there is no driver). Host-only."""
    try:
        cu = _driver()
        if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
            return 0
        err, n = cu.cuDeviceGetCount()
        return int(n) if err == cu.CUresult.CUDA_SUCCESS else 0
    except Exception:  # noqa: BLE001 - no driver library, no device: no GPU
        return 0


@functools.cache
def compute_capability(device_id: int) -> tuple:
    """``(major, minor)`` of CUDA device ``device_id``. Host-only, cached."""
    cu = _driver()
    _check(cu.cuInit(0), "cuInit")
    device = _check(cu.cuDeviceGet(device_id), "cuDeviceGet")
    attr = cu.CUdevice_attribute
    major = _check(
        cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute"
    )
    minor = _check(
        cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute"
    )
    return int(major), int(minor)


_primary_contexts: dict[int, Any] = {}  # device id -> the retained CUcontext
_context_lock = threading.Lock()


def _primary_context(device_id: int):
    ctx = _primary_contexts.get(device_id)
    if ctx is None:
        cu = _driver()
        with _context_lock:
            ctx = _primary_contexts.get(device_id)
            if ctx is None:
                _check(cu.cuInit(0), "cuInit")
                device = _check(cu.cuDeviceGet(device_id), "cuDeviceGet")
                ctx = _check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
                _primary_contexts[device_id] = ctx
    return ctx


@contextlib.contextmanager
def on_device(device_id: int):
    """Run the body with ``device_id``'s primary context current, then restore the caller's.

    Host-only. The common case (that context already current in this thread) costs one driver
    query; otherwise the primary context is pushed and popped, so the calling thread's current
    context (and what frameworks read from it as "the current device") is left as it was.
    """
    cu = _driver()
    primary = _primary_context(device_id)
    if int(_check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == int(primary):
        yield
        return
    _check(cu.cuCtxPushCurrent(primary), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")


class DeviceAllocation:
    """``nbytes`` of device memory (cuMemAlloc). Owns it; :meth:`close` is idempotent.

    The caller guarantees no queued work still uses the memory when it closes it.
    """

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.ptr = int(_check(_driver().cuMemAlloc(max(self.nbytes, 1)), f"cuMemAlloc({self.nbytes})"))

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _check(_driver().cuMemFree(ptr), "cuMemFree")


class PinnedAllocation:
    """``nbytes`` of page-locked host memory (cuMemAllocHost), mapped into every device's address
    space (unified addressing). ``ptr`` is the host address, ``device_ptr`` the address kernels
    use. Owns it; :meth:`close` is idempotent and must only run once no queued copy or kernel
    still touches it.
    """

    def __init__(self, nbytes: int):
        cu = _driver()
        self.nbytes = int(nbytes)
        self.ptr = int(_check(cu.cuMemAllocHost(max(self.nbytes, 1)), f"cuMemAllocHost({self.nbytes})"))
        self.device_ptr = int(_check(cu.cuMemHostGetDevicePointer(self.ptr, 0), "cuMemHostGetDevicePointer"))

    def numpy(self, dtype):
        """A numpy view of the whole allocation (host writes go straight into pinned memory)."""
        import ctypes

        import numpy as np

        buf = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        return np.frombuffer(buf, dtype=dtype)

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr, self.device_ptr = self.ptr, 0, 0
            _check(_driver().cuMemFreeHost(ptr), "cuMemFreeHost")


class Event:
    """A CUDA event without timing (cheap to record and query)."""

    def __init__(self):
        cu = _driver()
        self.handle = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.recorded = False

    def record(self, stream: int) -> None:
        _check(_driver().cuEventRecord(self.handle, stream), "cuEventRecord")
        self.recorded = True

    def done(self) -> bool:
        if not self.recorded:
            return True
        cu = _driver()
        err = cu.cuEventQuery(self.handle)[0]
        if err == cu.CUresult.CUDA_SUCCESS:
            return True
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((err,), "cuEventQuery")
        return False

    def synchronize(self) -> None:
        """Host-blocking: wait until the work before the last record has finished."""
        if self.recorded:
            _check(_driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def close(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            _check(_driver().cuEventDestroy(h), "cuEventDestroy")


def memcpy_htod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_driver().cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def memcpy_dtoh(dst: int, src: int, nbytes: int) -> None:
    """Host-blocking copy from device (or host-mapped) memory to host memory."""
    _check(_driver().cuMemcpyDtoH(dst, src, nbytes), "cuMemcpyDtoH")


def memset_d8_async(dst: int, value: int, nbytes: int, stream: int) -> None:
    _check(_driver().cuMemsetD8Async(dst, value, nbytes, stream), "cuMemsetD8Async")


def stream_is_capturing(stream: int) -> bool:
    cu = _driver()
    status = _check(cu.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def synchronize_device() -> None:
    """Host-blocking: wait for all work queued on the current context."""
    _check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")


def create_stream() -> int:
    cu = _driver()
    return int(_check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))


def destroy_stream(stream: int | None) -> None:
    if stream:
        _check(_driver().cuStreamDestroy(stream), "cuStreamDestroy")


def synchronize_stream(stream: int) -> None:
    _check(_driver().cuStreamSynchronize(stream), "cuStreamSynchronize")


def close_all(closers: Iterable[Callable[[], None]]) -> None:
    """Call every closer in order, each even when one before it raised, then raise the first
    error (host-only). For resources that must all be released: a failed synchronisation or
    free leaves nothing else behind."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - re-raised once the rest are released
            if first is None:
                first = exc
    if first is not None:
        raise first
