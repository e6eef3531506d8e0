"""DLPack intake: any object with ``__dlpack__`` becomes a validated :class:`ArrayView`.

Why by hand: maintained intakes exist (cuda.core's ``StridedMemoryView``), but they cost more
than a decode step can spend: 12 us per torch tensor against about 3.5 us for the bare
``__dlpack__()`` call this module builds on, and a replay hands over four or five arrays. The
hot paths go further and skip DLPack after the first call (bound launches cached by layout,
:meth:`~trace_replay_core.TraceTable.replay_cached`).

The core never sees framework types. It asks the producer for a DLPack capsule (a versioned
1.x capsule when the producer offers one, else the older unversioned kind), reads the
``DLTensor`` it describes and keeps the capsule alive for as long as the view lives: while a
view exists, the producer's memory cannot be freed under it.

A view records the data pointer (``data + byte_offset``, in bytes), shape and strides (in
elements), the dtype as a name (``"int32"``, ``"bfloat16"`` ...), the device and whether the
producer marked the memory read-only or exported a copy (both refused where a call writes).

Consuming a capsule is host-only and never blocks on the device. The ``stream`` handed to the
producer is the consumer stream of the DLPack handshake: the producer makes that stream wait
for its pending writes (``-1`` asks for no ordering at all).
"""

from __future__ import annotations

import numbers
from typing import Any

from ._dlpack_capsules import (
    CAN_VERSION,
    DLManagedTensor,
    DLManagedTensorVersioned,
    capsule_get_pointer,
    capsule_is_valid,
    export_capsule,
)

__all__ = [
    "ArrayView",
    "as_view",
    "CPU",
    "CUDA",
]

CPU = "cpu"
CUDA = "cuda"

# DLDeviceType values (dlpack.h), and the names of the kinds a view may come from.
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST = 1, 2, 3
_DEVICE_NAMES = {
    1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
    11: "rocm_host", 13: "cuda_managed", 14: "oneapi",
}  # fmt: skip

# (code, bits) -> dtype name. DLDataTypeCode: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
_DTYPES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16", (6, 8): "bool",
}  # fmt: skip
ITEMSIZE = {name: bits // 8 for (_, bits), name in _DTYPES.items()}

_FLAG_READ_ONLY = 1 << 0
_FLAG_IS_COPIED = 1 << 1  # the producer exported a copy: writes through the view would be lost


_DTYPE_CODES = {name: key for key, name in _DTYPES.items()}
_VERSIONED = b"dltensor_versioned"
_UNVERSIONED = b"dltensor"
_MAX_VERSION = (1, 1)


class ArrayView:
    """A validated description of someone else's array memory.

    Attributes: ``ptr`` (int, bytes, already ``data + byte_offset``), ``shape`` and ``strides``
    (tuples; strides in elements), ``dtype`` (name), ``itemsize`` (bytes), ``device_type``
    (``"cpu"`` or ``"cuda"``; a view that :func:`as_view` read from another kind of device
    names it, e.g. ``"rocm"``, and every check refuses it), ``device_id`` (int), ``readonly``
    (bool), ``copied`` (bool: the producer exported a copy, DLPack 1.x's ``IS_COPIED`` flag;
    False for a view built by hand).

    The view does not own the memory; it holds the DLPack capsule (``keepalive``), which keeps
    the producer's buffer alive until the view is dropped. Building one by hand (``keepalive``
    ``None``) is for callers that keep the memory alive themselves; the constructor checks its
    arguments (``TypeError``/``ValueError`` naming the one at fault). :func:`as_view` builds its
    views from a capsule it has checked already, without the constructor's checks.
    """

    __slots__ = (
        "ptr", "shape", "strides", "dtype", "itemsize", "device_type", "device_id", "readonly", "copied", "keepalive"
    )  # fmt: skip

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: str,
        device_type: str,
        device_id: int,
        readonly: bool = False,
        keepalive: Any = None,
    ):
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise TypeError(f"dtype must be one of {', '.join(ITEMSIZE)} (got {dtype!r})")
        if device_type not in (CPU, CUDA):
            raise ValueError(f"device_type must be {CPU!r} or {CUDA!r} (got {device_type!r})")
        self.ptr = _non_negative(ptr, "ptr must be a non-negative int")
        self.device_id = _non_negative(device_id, "device_id must be a non-negative int")
        self.shape = tuple(_non_negative(n, "shape must hold non-negative ints") for n in shape)
        self.strides = tuple(int(s) for s in strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(
                f"strides must have one entry per dimension of shape {list(self.shape)} (got strides {list(strides)})"
            )
        self.dtype = dtype
        self.itemsize = ITEMSIZE[dtype]
        self.device_type = device_type
        self.readonly = bool(readonly)
        self.copied = False
        self.keepalive = keepalive

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return "cpu" if self.device_type == CPU else f"{self.device_type}:{self.device_id}"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_c_contiguous(self) -> bool:
        if self.size == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def describe(self) -> str:
        ro = ", read-only" if self.readonly else ""
        return f"{self.dtype}{list(self.shape)} on {self.device}{ro}"

    # DLPack producer ---------------------------------------------------------------------
    def __dlpack_device__(self):
        if self.device_type == CPU:
            return (_KDL_CPU, 0)
        if self.device_type == CUDA:
            return (_KDL_CUDA, self.device_id)
        raise BufferError(f"cannot export a view on {self.device} over DLPack")

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export the described memory as a DLPack capsule, in place (zero-copy).

        ``max_version`` ``(1, 0)`` or later gives a versioned capsule (DLPack 1.x) whose flags
        carry ``readonly`` and ``copied``; else an unversioned one, which has no flags (a
        read-only view exports as writable memory there). ``dl_device`` may only name the
        view's own device and ``copy`` may not be True (``BufferError``): the view makes no
        copies. ``stream`` is accepted and ignored: the owner orders its own writes.

        The capsule's descriptor is freed once, by the consumer that takes it or, dropped
        unconsumed, by the capsule itself (:mod:`._dlpack_capsules`). The memory stays owned by
        whoever owns it now (for :meth:`TraceTable.device_views`, the table), which must
        outlive every consumer.
        """
        if copy:
            raise BufferError("an ArrayView exports its memory in place; import it with copy=False")
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(
                f"an ArrayView on {self.device} exports its memory only there, in place (got dl_device {dl_device})"
            )
        version = None
        if max_version is not None and max_version[0] >= 1 and CAN_VERSION:
            version = _MAX_VERSION if tuple(max_version) >= _MAX_VERSION else (1, 0)
        flags = (_FLAG_READ_ONLY if self.readonly else 0) | (_FLAG_IS_COPIED if self.copied else 0)
        dtype = _DTYPE_CODES[self.dtype]
        return export_capsule(self.ptr, self.shape, self.strides, dtype, device, version=version, flags=flags)

    def __repr__(self) -> str:
        return (
            f"ArrayView(ptr=0x{self.ptr:x}, shape={self.shape}, strides={self.strides}, "
            f"dtype={self.dtype}, device={self.device}, readonly={self.readonly})"
        )


def _non_negative(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what} (got {value!r})")
    return int(value)


def _view(ptr, shape, strides, dtype, device_type, device_id, readonly, copied, keepalive) -> ArrayView:
    """An :class:`ArrayView` of fields known to be valid, without the constructor's checks: the
    path of every :func:`as_view` (a replay or logprob call that is not bound reads four to
    fourteen arrays), whose fields come from a capsule it has checked."""
    v = object.__new__(ArrayView)
    v.ptr, v.shape, v.strides, v.dtype, v.itemsize = ptr, shape, strides, dtype, ITEMSIZE[dtype]
    v.device_type, v.device_id, v.readonly, v.copied, v.keepalive = device_type, device_id, readonly, copied, keepalive
    return v


def _dlpack_stream_arg(device_type: int, stream: int | None) -> int | None:
    """The ``stream`` argument of the DLPack handshake for a producer on ``device_type``.

    CPU producers take ``None``. For CUDA, handle 0 (the legacy default stream) is spelled 1
    in DLPack, 0 being reserved; -1 means "no ordering".
    """
    if device_type != _KDL_CUDA or stream is None:
        return None
    return 1 if stream == 0 else stream


def _capsule_of(obj: Any, name: str, stream: int | None):
    try:
        dev_type, _ = obj.__dlpack_device__()
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument named
        raise TypeError(f"{name}: __dlpack_device__() failed on {type(obj).__name__}: {exc}") from exc
    dev_type = int(dev_type)
    kwargs = {}
    s = _dlpack_stream_arg(dev_type, stream)
    if s is not None:
        kwargs["stream"] = s
    try:
        return obj.__dlpack__(max_version=_MAX_VERSION, **kwargs)
    except TypeError:
        # A producer from before DLPack 1.0 does not know max_version.
        return obj.__dlpack__(**kwargs)


def as_view(obj: Any, *, name: str, stream: int | None = None) -> ArrayView:
    """Return an :class:`ArrayView` of ``obj`` (host-only; never blocks on the device).

    ``obj`` is an :class:`ArrayView` (returned as is) or any object implementing
    ``__dlpack__`` and ``__dlpack_device__``. ``name`` is the argument name used in error
    messages. ``stream`` (int handle, optional) is the consumer stream passed to the producer
    so that it orders its pending writes before work on that stream; ``-1`` asks for none.
    """
    if isinstance(obj, ArrayView):
        return obj
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise TypeError(
            f"{name} must be an array supporting DLPack (__dlpack__ and __dlpack_device__); got {type(obj).__name__}"
        )
    try:
        capsule = _capsule_of(obj, name, stream)
    except BufferError as exc:
        raise ValueError(f"{name} could not be exported over DLPack ({exc})") from exc
    managed: DLManagedTensorVersioned | DLManagedTensor
    if capsule_is_valid(capsule, _VERSIONED):
        managed = DLManagedTensorVersioned.from_address(capsule_get_pointer(capsule, _VERSIONED))
        if managed.version.major > 1:
            raise ValueError(
                f"{name} came as a DLPack {managed.version.major}.{managed.version.minor} "
                f"capsule; this library reads DLPack 1.x"
            )
        flags = managed.flags
        readonly, copied = bool(flags & _FLAG_READ_ONLY), bool(flags & _FLAG_IS_COPIED)
    elif capsule_is_valid(capsule, _UNVERSIONED):
        managed = DLManagedTensor.from_address(capsule_get_pointer(capsule, _UNVERSIONED))
        readonly = copied = False
    else:
        raise TypeError(f"{name}.__dlpack__() returned {capsule!r}, not an unconsumed DLPack capsule")
    t = managed.dl_tensor
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _DTYPES.get((code, bits))
    if dtype is None or lanes != 1:
        raise TypeError(
            f"{name} has a DLPack dtype this library does not handle (code={code}, bits={bits}, lanes={lanes})"
        )
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(ndim))
    else:  # NULL strides: compact row-major
        compact, acc = [], 1
        for s in reversed(shape):
            compact.append(acc)
            acc *= s
        strides = tuple(reversed(compact))
    dev_type = t.device.device_type
    if dev_type in (_KDL_CPU, _KDL_CUDA_HOST):
        device_type, device_id = CPU, 0
    elif dev_type == _KDL_CUDA:
        device_type, device_id = CUDA, t.device.device_id
    else:
        device_type, device_id = _DEVICE_NAMES.get(dev_type, f"dldevice{dev_type}"), t.device.device_id
    ptr = (t.data or 0) + t.byte_offset
    return _view(ptr, shape, strides, dtype, device_type, device_id, readonly, copied, capsule)


def without_capsules(values: tuple) -> tuple:
    """``values`` with each :class:`ArrayView` replaced by a copy that holds no capsule (the
    others as they are): what a bound launch keeps, pointers only, so that dropping the bound
    object's views lets the arrays go. The views given are left unchanged."""
    return tuple(
        _view(v.ptr, v.shape, v.strides, v.dtype, v.device_type, v.device_id, v.readonly, v.copied, None)
        if isinstance(v, ArrayView)
        else v
        for v in values
    )
