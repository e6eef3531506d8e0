"""Staging's native copy (``trace_replay_core._host_copy``) against numpy: the same bytes, the
same largest value, the same refusals; layouts it does not take are left to numpy; and without
a compiler, or switched off, staging falls back to numpy and says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from trace_replay_core import TraceTable
from trace_replay_core import _host_copy as host_copy
from trace_replay_core._staging import copy_trace

POISON = 0xA5A5A5A5
UNSIGNED = {
    np.dtype(np.int32): np.uint32,
    np.dtype(np.uint32): np.uint32,
    np.dtype(np.int64): np.uint64,
    np.dtype(np.uint64): np.uint64,
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def native(monkeypatch):
    """The native copy, loaded, taking arrays of any size."""
    if not host_copy.prepare():
        if shutil.which(os.environ.get("CC") or "cc") is None:
            pytest.skip(f"no C compiler on this machine: {host_copy.status()}")
        pytest.fail(f"a C compiler is here but the native copy did not load: {host_copy.status()}")
    monkeypatch.setattr(host_copy, "MIN_BYTES", 0)
    return host_copy


def _ids(rng, shape, dtype):
    """Random valid ids, never zero."""
    return rng.integers(1, 150_000, shape).astype(dtype)


def _check_copy(arr, out, top):
    assert top == int(arr.view(UNSIGNED[arr.dtype]).max()), (top, arr.dtype)
    got = out.view(np.int32) if arr.dtype.kind == "i" else out
    bad = np.argwhere(got.astype(np.int64) != arr.astype(np.int64))
    assert bad.size == 0, f"first differing index {bad[:5].tolist()}"


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint64])
@pytest.mark.parametrize("length", [1, 5, 31, 32, 33, 1000, 4099])
@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_trace_matches_numpy(rng, native, dtype, length, offset):
    """1-D: every length around the vector widths, the output starting at every alignment."""
    arr = _ids(rng, length, dtype)
    arr[rng.integers(0, length)] = 2**31 - 1  # the largest id that int32 holds
    buf = np.full(length + 16, POISON, dtype=np.uint32)
    out = buf[offset : offset + length]
    _check_copy(arr, out, native.copy_max(arr, out))
    assert (buf[:offset] == POISON).all() and (buf[offset + length :] == POISON).all()


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64])
@pytest.mark.parametrize("rows, cols, pad", [(3, 1, 3), (7, 93, 3), (64, 1024, 0), (5, 4099, 5)])
def test_block_matches_numpy(rng, native, dtype, rows, cols, pad):
    """2-D: output rows padded apart, source rows strided apart and in reverse order."""
    wide = _ids(rng, (rows, cols + 11), dtype)
    for arr in (wide[:, 3 : 3 + cols], wide[::-1, :cols]):
        buf = np.full((rows, cols + pad), POISON, dtype=np.uint32)
        out = buf[:, :cols]
        _check_copy(arr, out, native.copy_max(arr, out))
        assert (buf[:, cols:] == POISON).all()


@pytest.mark.parametrize(
    "dtype, value",
    [
        (np.int32, -1),
        (np.int32, -(2**31)),
        (np.int64, -7),
        (np.int64, 2**32 + 5),
        (np.uint32, 2**31),
        (np.uint64, 2**63 + 1),
        (np.int32, 150_000),
    ],
)
@pytest.mark.parametrize("vocab", [None, 150_000])
def test_refusals_as_numpy(rng, native, dtype, value, vocab):
    """A bad id anywhere in a block (a 64-bit one whose low 32 bits look valid included) is
    refused in the same words on both paths, naming the first bad trace."""
    if value == 150_000 and vocab is None:  # valid without a vocabulary: take one that is not
        value = -3 if dtype == np.int32 else 2**31
    block = _ids(rng, (64, 4096), dtype)
    row, col = int(rng.integers(1, 64)), int(rng.integers(0, 4096))
    block[row, col] = value
    messages = []
    for funcs in (native._funcs, {}):
        with native._entry_points(funcs), pytest.raises(ValueError) as info:
            copy_trace(block, np.empty(block.shape, np.uint32), vocab_size=vocab, name="traces")
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"traces[{row}] must be ")


def test_layouts_not_taken(native):
    """Byte-swapped, narrow, strided-within-a-row, 3-D or mismatched arrays: ``None``, nothing
    written (``copy_trace`` then uses numpy)."""
    out = np.full(64, POISON, dtype=np.uint32)
    src = np.arange(1, 129, dtype=np.int32)
    for arr, dst in [
        (src[:64].astype(">i4"), out),
        (src[:64].astype(np.int16), out),
        (src[::2], out),
        (src[:64].reshape(4, 4, 4), out.reshape(4, 4, 4)),
        (src[:63], out[:63].reshape(63)[:62]),
        (src[:64], out.view(np.int32)),
    ]:
        assert native.copy_max(arr, dst) is None
    assert (out == POISON).all()


def test_small_outputs_stay_on_numpy():
    """Below ``MIN_BYTES`` numpy is faster, and ``copy_max`` declines."""
    out = np.empty(host_copy.MIN_BYTES // 4 - 1, dtype=np.uint32)
    assert host_copy.copy_max(np.ones(out.size, np.int32), out) is None


def test_stage_many_large_blocks_on_both_paths(rng, native):
    """A table staged through the native copy holds what numpy's path gives (CPU backend)."""
    tables, seed = [], int(rng.integers(2**32))
    for funcs in (native._funcs, {}):
        with native._entry_points(funcs):
            t = TraceTable(96, 4096, device="cpu", vocab_size=150_000)
            seeded = np.random.default_rng(seed)
            for dtype in (np.int32, np.int64):
                slots = seeded.permutation(96)[:64]
                t.stage_many(slots, _ids(seeded, (64, 4096), dtype))
                t.commit(stream=0)
            tables.append(t.snapshot())
            t.close()
    assert np.array_equal(tables[0][1], tables[1][1]) and np.array_equal(tables[0][0], tables[1][0])
    assert (tables[0][1] == 4096).sum() >= 64


def _fresh_process(tmp_path, **env):
    """Run, in a new interpreter, a table that stages a large block; return its report."""
    code = textwrap.dedent("""
        import numpy as np
        from trace_replay_core import TraceTable, _host_copy as host_copy
        t = TraceTable(64, 4096, device="cpu", vocab_size=100)
        block = np.random.default_rng(1).integers(1, 100, (64, 4096), dtype=np.int32)
        t.stage_many(range(64), block)
        t.commit(stream=0)
        assert np.array_equal(t.snapshot()[0], block)
        block[3, 9] = 100
        try:
            t.stage_many(range(64), block)
        except ValueError as exc:
            print("refused:", exc)
        print("status:", host_copy.status())
    """)
    full = dict(os.environ, PYTHONPATH=ROOT, TRACE_REPLAY_CACHE_DIR=str(tmp_path), **env)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["refused"] == "traces[3] must be below vocab_size=100 (got 100 at index 9)"
    return lines["status"]


def test_without_a_compiler_staging_uses_numpy(tmp_path):
    status = _fresh_process(tmp_path, CC="no-such-compiler-here")
    assert status == "numpy: no C compiler: 'no-such-compiler-here' is not on PATH (set CC to one)"
    assert not os.listdir(tmp_path)


def test_failing_compiler_is_reported(tmp_path):
    status = _fresh_process(tmp_path, CC="false")
    assert status.startswith("numpy: `") and "exited 1" in status, status
    assert not os.listdir(tmp_path)  # no half-written library is left behind


def test_switched_off(tmp_path):
    assert _fresh_process(tmp_path, TRACE_REPLAY_NATIVE_COPY="0") == "numpy: turned off by TRACE_REPLAY_NATIVE_COPY=0"


def test_built_once_then_loaded(tmp_path, native):
    """The first process builds into the cache folder; the next loads that build as it is."""
    first = _fresh_process(tmp_path)
    assert first.startswith(f"native: {tmp_path}")
    path = first.split(": ", 1)[1]
    stamp = os.stat(path).st_mtime_ns
    assert _fresh_process(tmp_path) == first
    assert os.stat(path).st_mtime_ns == stamp
    assert os.listdir(tmp_path) == [os.path.basename(path)]


def test_damaged_build_is_built_again(tmp_path, native):
    """A cached library that does not load (a file cut short) is replaced by a fresh build."""
    path = _fresh_process(tmp_path).split(": ", 1)[1]
    with open(path, "wb") as f:
        f.write(b"not a shared library")
    assert _fresh_process(tmp_path) == f"native: {path}"
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF" or os.uname().sysname != "Linux"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("placement", ["device", "host_mapped"])
def test_gpu_large_block_reaches_the_table(rng, dtype, placement):
    """On a real GPU: a 2 MiB block copied by the native path (streamed stores into pinned
    staging memory) arrives intact in the table after the commit's host-to-device copy."""
    t = TraceTable(128, 8192, device="cuda:0", placement=placement, vocab_size=150_000)
    for _ in range(3):
        slots = rng.permutation(128)[:64]
        block = _ids(rng, (64, 8192), dtype)
        t.stage_many(slots, block)
        assert host_copy.status().startswith("native: "), host_copy.status()  # prepared by the first large copy
        t.commit(stream=0)
        table, lengths = t.snapshot()
        assert (lengths[slots] == 8192).all()
        bad = np.argwhere(table[slots] != block.astype(np.int32))
        assert bad.size == 0, f"first differing (row, token): {bad[:5].tolist()}"
    t.close()


def test_portable_build_matches_numpy(rng, tmp_path, native):
    """The path for CPUs without AVX2 (and other architectures), built on its own: the same
    bytes and largest values as numpy, strided rows included."""
    path = str(tmp_path / "portable.so")
    cc = shutil.which(os.environ.get("CC") or "cc")
    subprocess.run(
        [
            cc,
            "-O3",
            "-shared",
            "-fPIC",
            "-DTRACE_REPLAY_PORTABLE",
            "-o",
            path,
            os.path.join(ROOT, "trace_replay_core", "host_copy.c"),
        ],
        check=True,
        capture_output=True,
    )
    funcs = host_copy._load(path)
    assert host_copy._self_check(funcs) is None
    with native._entry_points(funcs):
        for dtype in (np.int32, np.int64):
            wide = _ids(rng, (9, 1031), dtype)
            wide[4, 17] = -1
            buf = np.full((9, 1040), POISON, dtype=np.uint32)
            _check_copy(wide[:, :1030], buf[:, 1:1031], native.copy_max(wide[:, :1030], buf[:, 1:1031]))
            assert (buf[:, 0] == POISON).all() and (buf[:, 1031:] == POISON).all()
