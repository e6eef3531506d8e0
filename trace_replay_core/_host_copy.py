"""Staging's copy of token ids in native code, built on first use when a C compiler is at hand.

Staging copies every trace into memory the table owns and refuses ids out of range
(:func:`~._staging.copy_trace`). numpy does that in two passes, a copy and then a max over the
copy. ``host_copy.c`` loads each id once, folds it into a running max and stores it; on x86-64
with AVX2 the stores bypass the cache (the GPU's copy engine reads the staging buffer next, not
this CPU). ``stage_many`` of 64 traces of 8K int32 tokens (2 MiB) in the staging benchmark's
loop on an H200 host took 274 and 411 us against 422 and 556 us with numpy (p50, two runs);
the copy alone, 64-bit ids narrowed into the same 2 MiB: 640 against 813 us. Outputs below
:data:`MIN_BYTES` stay on numpy.

:func:`prepare` (called by the first copy of :data:`MIN_BYTES` or more of a process, or by
the caller; host-blocking, once per process) compiles ``host_copy.c`` with the C compiler (``$CC``, else ``cc``; Triton's
GPU backend needs one at run time too) into a cache folder (``$TRACE_REPLAY_CACHE_DIR``, else
``$XDG_CACHE_HOME/trace-replay``, else ``~/.cache/trace-replay``), loads it with ctypes and
checks it on a known input. Later processes load the cached build (about 1 ms). Without a
compiler or a writable cache folder, or with ``TRACE_REPLAY_NATIVE_COPY=0``, staging stays on
numpy: the same results and the same refusals, only slower. :func:`status` says which path is
in use and why. The library is plain C (no Python API); ctypes releases the GIL during a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import numpy as np

__all__ = ["MIN_BYTES", "copy_max", "prepare", "status"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_copy.c")
_FLAGS = ("-O3", "-shared", "-fPIC")
_PORTABLE = "-DTRACE_REPLAY_PORTABLE"  # a retry without the x86-64 AVX2 path, for compilers that lack it
_ENV_SWITCH = "TRACE_REPLAY_NATIVE_COPY"

# Below this many bytes of output numpy is as fast or faster (H200 host, fresh source, staging
# ring not in cache, p50 us native / numpy): int32 ids 128 KiB 27.6 / 14.6, 512 KiB 74.2 / 72.5,
# 2 MiB 233.6 / 320.5; int64 ids narrowed into 256 KiB 55.9 / 50.6, into 512 KiB 99.4 / 109.2.
# What stays in L2 costs numpy little, streamed stores go to memory at once, and a ctypes call
# costs ~5 us.
MIN_BYTES = 1 << 20

_lock = threading.Lock()
_prepared = False
_status = "not prepared: no staging copy of MIN_BYTES or more yet (prepared at the first one)"
_funcs: dict = {}  # source dtype -> entry point of the loaded, checked library; empty: numpy


def status() -> str:
    """Which copy staging uses (``"native: <library path>"`` or ``"numpy: <why>"``)."""
    return _status


def _cache_dir() -> str:
    explicit = os.environ.get("TRACE_REPLAY_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trace-replay")


def _build(cc: str, source: bytes, folder: str) -> str:
    """Path of the compiled library for this source, compiler and machine; compiled if absent.
    Raises ``RuntimeError`` naming the command when compiling fails."""
    key = hashlib.sha256(
        b"\0".join(
            [source, cc.encode(), " ".join(_FLAGS).encode(), platform.system().encode(), platform.machine().encode()]
        )
    ).hexdigest()[:16]
    path = os.path.join(folder, f"host_copy-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    errors = []
    for extra in ((), (_PORTABLE,)):
        fd, tmp = tempfile.mkstemp(prefix=".host_copy-", suffix=".so", dir=folder)
        os.close(fd)
        cmd = [cc, *_FLAGS, *extra, "-o", tmp, _SOURCE]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, path)  # atomic: a process that races us loads one or the other
                return path
            errors.append(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[:300]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("; ".join(errors))


def _load(path: str):
    lib = ctypes.CDLL(path)
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    u32, u64 = lib.trace_replay_copy_u32, lib.trace_replay_copy_u64
    u32.argtypes, u32.restype = args, ctypes.c_uint32
    u64.argtypes, u64.restype = args, ctypes.c_uint64
    return {np.dtype(np.int32): u32, np.dtype(np.uint32): u32, np.dtype(np.int64): u64, np.dtype(np.uint64): u64}


def _self_check(funcs: dict) -> str | None:
    """Why the loaded library cannot be trusted, or ``None``: a strided block and a wide trace
    with negative ids, against numpy."""
    src = (np.arange(3 * 5001, dtype=np.int32).reshape(3, 5001) * 7919) % 150_000
    src[1, 4999] = -3
    out = np.full((3, 5004), 0xA5A5A5A5, dtype=np.uint32)
    top = _run(funcs, src, out[:, :5001])
    if top != 2**32 - 3 or not np.array_equal(out[:, :5001].view(np.int32), src) or (out[:, 5001:] != 0xA5A5A5A5).any():
        return "the compiled copy failed its check against numpy"
    wide = np.arange(1001, dtype=np.int64) * 104729 % 150_000
    wide[[3, 500, 997]] = [2**40 + 9, -1, 2**33]
    out = np.zeros(1003, dtype=np.uint32)
    if (
        _run(funcs, wide, out[1:1002]) != 2**64 - 1
        or not np.array_equal(out[1:1002], wide.astype(np.uint32))
        or out[0]
        or out[1002]
    ):
        return "the compiled 64-bit copy failed its check against numpy"
    return None


def prepare() -> bool:
    """Build (first time on this machine) or load the native copy; ``True`` when staging uses it.

    Host-blocking; thread-safe; does the work once per process. Never raises for a missing or
    failing compiler: staging then uses numpy and :func:`status` says why.
    """
    global _prepared, _status, _funcs
    if _prepared:
        return bool(_funcs)
    with _lock:
        if _prepared:
            return bool(_funcs)
        try:
            if os.environ.get(_ENV_SWITCH, "1") == "0":
                raise RuntimeError(f"turned off by {_ENV_SWITCH}=0")
            cc = os.environ.get("CC") or "cc"
            cc_path = shutil.which(cc)
            if cc_path is None:
                raise RuntimeError(f"no C compiler: {cc!r} is not on PATH (set CC to one)")
            with open(_SOURCE, "rb") as f:
                source = f.read()
            path = _build(cc_path, source, _cache_dir())
            try:
                funcs = _load(path)
            except OSError:  # a damaged build in the cache (cut short, say): once more
                os.unlink(path)
                path = _build(cc_path, source, _cache_dir())
                funcs = _load(path)
            why = _self_check(funcs)
            if why is not None:
                raise RuntimeError(f"{why} ({path})")
            _funcs, _status = funcs, f"native: {path}"
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            _funcs, _status = {}, f"numpy: {exc}"
        _prepared = True
    return bool(_funcs)


def _run(funcs: dict, arr: np.ndarray, out: np.ndarray) -> int | None:
    fn = funcs.get(arr.dtype)
    if fn is None or out.dtype != np.uint32 or arr.shape != out.shape or not (arr.flags.aligned and out.flags.aligned):
        return None
    item = arr.itemsize
    if arr.ndim == 1:
        n = arr.shape[0]
        if (arr.strides[0] != item or out.strides[0] != 4) and n > 1:
            return None
        return fn(out.__array_interface__["data"][0], n, arr.__array_interface__["data"][0], n, 1, n)
    if arr.ndim == 2:
        rows, cols = arr.shape
        (s_row, s_col), (d_row, d_col) = arr.strides, out.strides
        if ((s_col != item or d_col != 4) and cols > 1) or s_row % item or d_row % 4:
            return None
        return fn(
            out.__array_interface__["data"][0],
            d_row // 4,
            arr.__array_interface__["data"][0],
            s_row // item,
            rows,
            cols,
        )
    return None


def copy_max(arr: np.ndarray, out: np.ndarray) -> int | None:
    """Copy ``arr`` into ``out`` and return the largest value read, as an unsigned integer of
    ``arr``'s width (a negative id reads as at least ``2**31`` or ``2**63``); or return ``None``,
    copying nothing, when the native copy is not loaded, ``out`` is smaller than
    :data:`MIN_BYTES` (numpy is faster there), or the arrays are not of a layout it takes.

    Taken: ``arr`` of native-order int32, uint32, int64 or uint64, 1-D or 2-D, each row
    contiguous; ``out`` uint32 of the same shape, each row contiguous (rows may be padded
    apart). 64-bit ids keep their low 32 bits in ``out``. Host-only; the caller owns both
    arrays and must not let another thread write them during the call.
    """
    if out.size < MIN_BYTES // 4:
        return None
    if not _prepared:
        prepare()  # the first copy that needs it builds or loads the native code
    if not _funcs:
        return None
    return _run(_funcs, arr, out)


@contextlib.contextmanager
def _entry_points(funcs: dict):
    """For benchmarks and tests: staging copies with ``funcs`` (``{}``: numpy's copy; or the
    entry points of another build, from ``_load``) inside the block, process-wide, then with the
    loaded library again. Not thread-safe: nothing else may stage meanwhile."""
    global _funcs
    prepare()  # so that no copy inside the block prepares (and replaces funcs)
    saved, _funcs = _funcs, funcs
    try:
        yield
    finally:
        _funcs = saved
