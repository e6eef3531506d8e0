"""Hand-built DLPack structures (``DLTensor``, the unversioned ``DLManagedTensor`` and the versioned
``DLManagedTensorVersioned``) for tests whose producer must set fields numpy, torch and JAX never
set (``byte_offset``, flags), and :class:`CopyingProducer`, a DLPack 1.x producer that exports a copy."""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = [
    "Device", "DataType", "Tensor", "Managed", "ManagedVersioned", "CopyingProducer", "capsule_new", "NAME",
    "VERSIONED_NAME", "IS_COPIED", "KDL_INT", "KDL_CPU",
]  # fmt: skip


class Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", Device),
        ("ndim", ctypes.c_int32),
        ("dtype", DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


capsule_new = ctypes.pythonapi.PyCapsule_New
capsule_new.restype = ctypes.py_object
capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
NAME = ctypes.create_string_buffer(b"dltensor")
KDL_INT, KDL_CPU = 0, 1


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("version", Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", Tensor),
    ]


IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED
VERSIONED_NAME = ctypes.create_string_buffer(b"dltensor_versioned")


class CopyingProducer:
    """Exports a versioned capsule of a compact copy of ``arr`` (a numpy array) flagged as a
    copy, as a DLPack 1.x producer does when it could not hand out the array's own memory. Keeps
    every structure it hands out (no deleter)."""

    def __init__(self, arr: np.ndarray):
        self.arr, self.copy = arr, np.ascontiguousarray(arr).copy()
        self._shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
        self._strides = (ctypes.c_int64 * arr.ndim)(*(s // arr.itemsize for s in self.copy.strides))
        self._managed = m = ManagedVersioned()
        m.version, m.flags = Version(1, 1), IS_COPIED
        t = m.dl_tensor
        t.data, t.device, t.ndim = self.copy.ctypes.data, Device(1, 0), arr.ndim
        t.dtype = DataType({"i": 0, "u": 1, "f": 2}[arr.dtype.kind], arr.dtype.itemsize * 8, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return capsule_new(ctypes.addressof(self._managed), VERSIONED_NAME, None)

    def __dlpack_device__(self):
        return (1, 0)
