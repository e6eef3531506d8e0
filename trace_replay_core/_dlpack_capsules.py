"""The DLPack C structures (``dlpack.h``) and the capsules :class:`~._dlpack.ArrayView` exports.

An exported capsule owns one ``malloc``'d block: the managed tensor (``DLManagedTensor``, or
``DLManagedTensorVersioned`` for a consumer that asks for DLPack 1.x), then its shape and
strides. The described memory is not the capsule's: it stays owned by whoever owns it now. The
block goes back exactly once, by its ``deleter`` (``free``), called by:

- the consumer, when it took the capsule (it renames it ``"used_dltensor"`` or
  ``"used_dltensor_versioned"``) and drops what it made of it;
- the capsule's destructor, when the capsule is dropped still bearing its first name: nobody
  took it.

The capsule's destructor is numpy's: the function numpy gives the capsules it exports itself,
read from one it made at import (``PyCapsule_GetDestructor``). It is what DLPack mandates of a
producer and nothing numpy-specific (a capsule still bearing its first name has its managed
tensor's ``deleter`` called), and it is C: it runs no Python, so a capsule dropped while an
exception is in flight (an error between export and consumption) leaves that exception as it
is, and one dropped during interpreter shutdown needs nothing of this module. A destructor
written here as a ctypes callback would run Python, and a Python callback entered with an
exception in flight replaces it with a ``SystemError``. numpy before 2.1 makes no versioned
capsules: then every export is unversioned (DLPack lets a producer answer ``max_version`` with
another version). Should numpy give no destructor, the capsules have none: one dropped
unconsumed then keeps its descriptor (about 100 bytes) for the process.
"""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = [
    "DLDevice",
    "DLDataType",
    "DLTensor",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DELETER",
    "capsule_is_valid",
    "capsule_get_pointer",
    "export_capsule",
]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
capsule_is_valid.restype = ctypes.c_int
capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
capsule_get_pointer.restype = ctypes.c_void_p
capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = [ctypes.c_size_t]
DELETER = ctypes.cast(_libc.free, ctypes.c_void_p).value  # what every exported block's deleter is
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _numpy_destructors() -> tuple[int | None, int | None]:
    """numpy's capsule destructors (their addresses): ``(unversioned, versioned)``, each ``None``
    where this numpy makes no such capsule or gives it no destructor."""
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyCapsule_GetDestructor", ctypes.pythonapi))
    probe = np.empty(1, np.int8)
    unversioned = probe.__dlpack__()
    try:
        versioned = probe.__dlpack__(max_version=(1, 0))
    except TypeError:  # numpy before 2.1: no max_version
        versioned = None
    return (
        get(unversioned) if capsule_is_valid(unversioned, b"dltensor") else None,
        get(versioned) if versioned is not None and capsule_is_valid(versioned, b"dltensor_versioned") else None,
    )


_UNVERSIONED_DESTRUCTOR, _VERSIONED_DESTRUCTOR = _numpy_destructors()
# A capsule keeps a pointer to its name, and may outlive this module (interpreter shutdown):
# the names are never freed.
_UNVERSIONED_NAME = ctypes.create_string_buffer(b"dltensor")
_VERSIONED_NAME = ctypes.create_string_buffer(b"dltensor_versioned")
ctypes.pythonapi.Py_IncRef(ctypes.py_object((_UNVERSIONED_NAME, _VERSIONED_NAME)))
CAN_VERSION = _VERSIONED_DESTRUCTOR is not None  # else every export is unversioned


def export_capsule(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: tuple[int, int],
    device: tuple[int, int],
    *,
    version: tuple[int, int] | None,
    flags: int = 0,
):
    """A new capsule describing ``ptr`` (``shape`` and ``strides`` in elements, ``dtype`` as
    DLPack's ``(code, bits)``, ``device`` as ``(device_type, device_id)``): a
    ``"dltensor_versioned"`` capsule of that ``version`` carrying ``flags``, or with ``version``
    ``None`` an unversioned ``"dltensor"`` one (which has no flags)."""
    ndim = len(shape)
    dims = max(ndim, 1)
    struct = DLManagedTensor if version is None else DLManagedTensorVersioned
    head = ctypes.sizeof(struct)
    block = _malloc(head + 16 * dims)
    if not block:
        raise MemoryError("malloc failed for a DLPack descriptor")
    shape_out = (ctypes.c_int64 * dims).from_address(block + head)
    strides_out = (ctypes.c_int64 * dims).from_address(block + head + 8 * dims)
    for i in range(ndim):
        shape_out[i] = shape[i]
        strides_out[i] = strides[i]
    managed = struct.from_address(block)
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(*device)
    t.ndim = ndim
    t.dtype = DLDataType(dtype[0], dtype[1], 1)
    t.shape = ctypes.cast(shape_out, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_out, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = DELETER
    if version is None:
        return _capsule_new(block, _UNVERSIONED_NAME, _UNVERSIONED_DESTRUCTOR)
    managed.version = DLPackVersion(*version)
    managed.flags = flags
    return _capsule_new(block, _VERSIONED_NAME, _VERSIONED_DESTRUCTOR)
