"""CPU tier: ArrayView's own DLPack export (``ArrayView.__dlpack__``): each capsule's descriptor
is freed once, whether a consumer takes it or it is dropped unconsumed; a versioned capsule when
the consumer asks for one; consumers read the memory in place; refusals of what it cannot do."""

import ctypes
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.dlpack_producers import CopyingProducer

from trace_replay_core import _dlpack_capsules, as_view

ROOT = Path(__file__).resolve().parents[1]
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_free = ctypes.CDLL(None).free
_free.argtypes = [ctypes.c_void_p]


class Capsule:
    """A producer handing out one capsule made beforehand."""

    def __init__(self, capsule, device=(1, 0)):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


@pytest.fixture
def deleter_calls(monkeypatch):
    """The descriptors' deleter swapped for one that counts its calls (then frees, as the real
    one does): the evidence that a capsule's memory went back, independent of the allocator."""
    calls = []

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def deleter(managed):
        calls.append(managed)
        _free(managed)

    monkeypatch.setattr(_dlpack_capsules, "DELETER", ctypes.cast(deleter, ctypes.c_void_p).value)
    yield calls
    gc.collect()  # every capsule made with this deleter is gone before it is


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["unversioned", "versioned"])
def test_capsules_dropped_unconsumed_are_freed(deleter_calls, max_version):
    view = as_view(np.arange(6, dtype=np.int32).reshape(2, 3), name="a")
    for _ in range(1000):
        view.__dlpack__(max_version=max_version)
    held = [view.__dlpack__(max_version=max_version) for _ in range(10)]
    assert len(deleter_calls) == 1000
    del held
    assert len(deleter_calls) == 1010


@pytest.mark.parametrize("consumer", ["numpy", "torch"])
def test_consumers_read_in_place_and_each_descriptor_is_freed_once(deleter_calls, consumer):
    """numpy and torch take the capsule (versioned: both ask for DLPack 1.x), read the memory in
    place, and call the deleter when their array goes; the capsule's destructor then does not."""
    a = np.arange(24, dtype=np.int64).reshape(4, 6)[1:, ::2]
    view = as_view(a, name="a")
    out = np.from_dlpack(view) if consumer == "numpy" else torch.from_dlpack(view)
    ptr = out.ctypes.data if consumer == "numpy" else out.data_ptr()
    assert out.tolist() == a.tolist() and ptr == view.ptr and tuple(out.shape) == (3, 3)
    out[0, 0] = -7
    assert a[0, 0] == -7 and deleter_calls == []
    del out
    gc.collect()
    assert len(deleter_calls) == 1


def test_a_capsule_dropped_while_an_error_propagates_leaves_the_error_alone():
    """An error between export and consumption drops the capsule while that error propagates
    (here: from the stack of a frame that has no handler). The destructor frees the descriptor
    without running Python, so the caller still gets its own error, not a SystemError."""
    view = as_view(np.arange(4, dtype=np.int32), name="a")

    def export_then_fail(max_version):
        return view.__dlpack__(max_version=max_version), 1 // 0

    for max_version in (None, (1, 0)):
        with pytest.raises(ZeroDivisionError, match=r"^integer division or modulo by zero$"):
            export_then_fail(max_version)


def test_versioned_capsule_when_asked_for_with_the_views_flags():
    """max_version >= (1, 0): a "dltensor_versioned" capsule carrying the view's read-only and
    copied flags (read back by as_view and honoured by numpy); else the unversioned kind."""
    a = np.arange(4, dtype=np.int32)
    a.flags.writeable = False
    readonly = as_view(a, name="a")
    copied = as_view(CopyingProducer(np.arange(5, dtype=np.int64)), name="b")
    for view, flags in ((readonly, (True, False)), (copied, (False, True))):
        capsule = view.__dlpack__(max_version=(1, 2))
        assert _is_valid(capsule, b"dltensor_versioned")
        again = as_view(Capsule(capsule), name="c")
        assert (again.readonly, again.copied) == flags and (again.ptr, again.shape) == (view.ptr, view.shape)
    for max_version in (None, (0, 8)):
        assert _is_valid(readonly.__dlpack__(max_version=max_version), b"dltensor")
    assert not np.from_dlpack(readonly).flags.writeable


def test_refuses_another_device_and_a_copy():
    view = as_view(np.arange(4, dtype=np.int32), name="a")
    elsewhere = r"^an ArrayView on cpu exports its memory only there, in place \(got dl_device \(2, 0\)\)$"
    with pytest.raises(BufferError, match=elsewhere):
        view.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match=r"^an ArrayView exports its memory in place; import it with copy=False$"):
        view.__dlpack__(copy=True)
    assert np.from_dlpack(view, device="cpu", copy=False).tolist() == [0, 1, 2, 3]  # dl_device=(1, 0)


def test_capsules_alive_at_interpreter_exit_are_freed_quietly():
    """Capsules that outlive the core's modules (kept in builtins, in a cycle) run their
    destructor during interpreter shutdown without an error, a message or a crash."""
    code = (
        "import builtins, numpy as np\n"
        "from trace_replay_core import as_view\n"
        "v = as_view(np.arange(4, dtype=np.int32), name='a')\n"
        "builtins.kept = [v.__dlpack__(max_version=m) for m in (None, (1, 0)) for _ in range(100)]\n"
        "cycle = [v.__dlpack__(), v.__dlpack__(max_version=(1, 0))]\n"
        "cycle.append(cycle)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
