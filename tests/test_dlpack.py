"""CPU tier: DLPack intake from numpy, torch CPU and JAX CPU arrays, and every refusal."""

import gc
import weakref

import numpy as np
import pytest
from helpers.dlpack_producers import CopyingProducer

from trace_replay_core import ArrayView, as_view
from trace_replay_core._validate import check_view


class LegacyProducer:
    """A producer from before DLPack 1.0: ``__dlpack__`` knows no ``max_version``."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, stream=None):
        return self.arr.__dlpack__()

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def test_numpy_view_fields():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    v = as_view(a, name="a")
    assert v.ptr == a.ctypes.data
    assert v.shape == (3, 4) and v.strides == (4, 1)
    assert v.dtype == "int32" and v.itemsize == 4
    assert v.device == "cpu" and not v.readonly and v.is_c_contiguous


def test_byte_offset_is_included():
    a = np.arange(100, dtype=np.int64)
    v = as_view(a[17:40], name="a")
    assert v.ptr == a.ctypes.data + 17 * 8
    assert v.shape == (23,)


def test_strided_view_is_seen_and_refused():
    a = np.arange(100, dtype=np.int64)
    v = as_view(a[::3], name="a")
    assert v.strides == (3,) and not v.is_c_contiguous
    with pytest.raises(ValueError, match=r"^a must be contiguous \(got shape \[34\] with element strides \[3\]\)$"):
        check_view(v, name="a", dtypes=["int64"])


def test_read_only_numpy_is_flagged_by_versioned_capsule():
    a = np.arange(8, dtype=np.int32)
    a.flags.writeable = False
    v = as_view(a, name="sampled")
    assert v.readonly
    with pytest.raises(
        ValueError, match=r"^sampled is written in place and must be writable \(got a read-only array\)$"
    ):
        check_view(v, name="sampled", dtypes=["int32"], writable=True)
    check_view(v, name="sampled", dtypes=["int32"])  # reading is fine


def test_unversioned_capsule_fallback():
    a = np.arange(5, dtype=np.int64)
    v = as_view(LegacyProducer(a), name="x")
    assert v.ptr == a.ctypes.data and v.shape == (5,) and v.dtype == "int64"


def test_view_keeps_producer_memory_alive():
    a = np.arange(1000, dtype=np.int64) * 3
    alive = weakref.ref(a)
    v = as_view(a, name="x")
    del a  # the view is now the array's only owner
    gc.collect()
    assert alive() is not None, "the array was freed while a view of it lives"
    assert v.ptr == alive().ctypes.data
    del v
    gc.collect()
    assert alive() is None, "the array outlived its last view"


def test_torch_cpu_views():
    import torch

    t = torch.arange(40, dtype=torch.int64).reshape(8, 5)
    v = as_view(t[2:, 1], name="col")
    assert v.ptr == t.data_ptr() + (2 * 5 + 1) * 8
    assert v.shape == (6,) and v.strides == (5,)
    assert v.dtype == "int64" and v.device == "cpu"
    v2 = as_view(torch.zeros(3, dtype=torch.bfloat16), name="b")
    assert v2.dtype == "bfloat16" and v2.itemsize == 2


def test_jax_cpu_views():
    import jax.numpy as jnp

    x = jnp.arange(10, dtype=jnp.int32)
    v = as_view(x, name="x")
    assert v.shape == (10,) and v.dtype == "int32" and v.device == "cpu"
    assert v.ptr == x.unsafe_buffer_pointer()


def test_array_view_passes_through():
    v = ArrayView(0x1000, (4,), (1,), "int32", "cuda", 0)
    assert as_view(v, name="x") is v
    assert v.device == "cuda:0"


REFUSALS = {
    "not-an-array": (
        lambda: as_view([1, 2], name="sampled"),
        TypeError,
        r"^sampled must be an array supporting DLPack \(__dlpack__ and __dlpack_device__\); got list$",
    ),
    "wrong-dtype": (
        lambda: check_view(
            as_view(np.zeros(3, np.float32), name="idx_mapping"), name="idx_mapping", dtypes=["int32", "int64"]
        ),
        TypeError,
        r"^idx_mapping must have dtype int32 or int64 \(got float32\)$",
    ),
    "wrong-device": (
        lambda: check_view(
            as_view(np.zeros(3, np.int32), name="sampled"), name="sampled", dtypes=["int32"], device="cuda:0"
        ),
        ValueError,
        r"^sampled must be on cuda:0 \(got cpu\)$",
    ),
    "wrong-rank": (
        lambda: check_view(
            as_view(np.zeros((2, 2), np.int32), name="idx_mapping"), name="idx_mapping", dtypes=["int32"], ndim=1
        ),
        ValueError,
        r"^idx_mapping must be 1-D \(got shape \[2, 2\]\)$",
    ),
    "wrong-length": (
        lambda: check_view(
            as_view(np.zeros(3, np.int32), name="idx_mapping"), name="idx_mapping", dtypes=["int32"], length=4
        ),
        ValueError,
        r"^idx_mapping must have 4 rows \(got shape \[3\]\)$",
    ),
    "too-short": (
        lambda: check_view(
            as_view(np.zeros(3, np.int32), name="total_len"), name="total_len", dtypes=["int32"], min_length=8
        ),
        ValueError,
        r"^total_len must have at least 8 entries \(got shape \[3\]\)$",
    ),
    "unsupported-dtype": (lambda: as_view(np.zeros(3, np.complex64), name="x"), (TypeError, ValueError), r"^x "),
    "misaligned": (
        lambda: check_view(ArrayView(0x1002, (4,), (1,), "int32", "cpu", 0), name="sampled", dtypes=["int32"]),
        ValueError,
        r"^sampled must be aligned to its 4-byte elements \(got address 0x1002\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(case):
    call, exc, pattern = REFUSALS[case]
    with pytest.raises(exc, match=pattern):
        call()


CONSTRUCTOR_REFUSALS = {  # ArrayView(ptr, shape, strides, dtype, device_type, device_id) built by hand
    "dtype-unknown": (
        (0x1000, (4,), (1,), "int128", "cuda", 0),
        TypeError,
        r"^dtype must be one of int8, .* \(got 'int128'\)$",
    ),
    "dtype-not-a-name": ((0x1000, (4,), (1,), None, "cuda", 0), TypeError, r"^dtype must be one of .* \(got None\)$"),
    "strides-short": (
        (0x1000, (4, 3), (3,), "int32", "cuda", 0),
        ValueError,
        r"^strides must have one entry per dimension of shape \[4, 3\] \(got strides \[3\]\)$",
    ),
    "device-type-unknown": (
        (0x1000, (4,), (1,), "int32", "gpu", 0),
        ValueError,
        r"^device_type must be 'cpu' or 'cuda' \(got 'gpu'\)$",
    ),
    "shape-negative": (
        (0x1000, (4, -2), (1, 1), "int32", "cpu", 0),
        ValueError,
        r"^shape must hold non-negative ints \(got -2\)$",
    ),
    "ptr-negative": (
        (-16, (4,), (1,), "int32", "cpu", 0),
        ValueError,
        r"^ptr must be a non-negative int \(got -16\)$",
    ),
    "device-id-negative": (
        (0x1000, (4,), (1,), "int32", "cuda", -1),
        ValueError,
        r"^device_id must be a non-negative int \(got -1\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCTOR_REFUSALS))
def test_constructor_refusals(case):
    args, exc, pattern = CONSTRUCTOR_REFUSALS[case]
    with pytest.raises(exc, match=pattern):
        ArrayView(*args)


def test_as_view_builds_the_same_view_as_the_constructor():
    """as_view skips the constructor's checks (its fields come from a checked capsule): the view
    is the one the constructor gives for the same fields."""
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[1:, ::2]
    v = as_view(a, name="a")
    w = ArrayView(v.ptr, v.shape, v.strides, v.dtype, v.device_type, v.device_id, v.readonly, v.keepalive)
    fields = ArrayView.__slots__
    assert [getattr(v, f) for f in fields] == [getattr(w, f) for f in fields]
    assert type(v) is ArrayView and v.itemsize == 4 and v.strides == (6, 2)


def _copied_calls():
    """name -> (call writing into a copied export, the argument it names). Each output in turn."""
    from trace_replay_core import TraceTable, token_logprob_rank, token_logprob_rank_backward

    table = TraceTable(4, 8, device="cpu")
    table.stage(1, [5, 6, 7])
    table.commit(stream=0)
    logits = np.linspace(-2.0, 2.0, 30, dtype=np.float32).reshape(3, 10)
    ids, lp, rk = np.array([1, 4, 9]), np.full(3, 7.0, np.float32), np.full(3, 7, np.int64)
    am, ent = np.full(3, 7, np.int32), np.full(3, 7.0, np.float32)
    idx, total, prompt = np.array([1, 0, -1], np.int32), np.array([0, 3, 0, 0], np.int32), np.zeros(4, np.int32)
    sampled = np.full(3, 7, np.int64)

    def logprob(**swap):
        a = dict(out_logprobs=lp, out_ranks=rk, out_argmax=am, out_entropy=ent) | swap
        return lambda: token_logprob_rank(logits, ids, stream=0, **a)

    def backward(grad):
        return lambda: token_logprob_rank_backward(logits, ids, lp, out_grad_logits=grad, stream=0)

    grad = np.full((3, 10), 7.0, np.float32)
    return {
        "sampled": (lambda: table.replay(CopyingProducer(sampled), idx, total, prompt, stream=0), "sampled"),
        "bind-sampled": (lambda: table.bind_replay(CopyingProducer(sampled), idx, total, prompt, stream=0), "sampled"),
        "out_logprobs": (logprob(out_logprobs=CopyingProducer(lp)), "out_logprobs"),
        "out_ranks": (logprob(out_ranks=CopyingProducer(rk)), "out_ranks"),
        "out_argmax": (logprob(out_argmax=CopyingProducer(am)), "out_argmax"),
        "out_entropy": (logprob(out_entropy=CopyingProducer(ent)), "out_entropy"),
        "out_grad_logits": (backward(CopyingProducer(grad)), "out_grad_logits"),
    }, (sampled, lp, rk, am, ent, grad)


@pytest.mark.parametrize("case", sorted(_copied_calls()[0]))
def test_copied_exports_are_refused_where_written(case):
    """Writes into a producer's copy would be lost: an array written in place (sampled, the
    outputs) whose capsule carries DLPack's IS_COPIED flag is refused, naming it; nothing is written."""
    calls, arrays = _copied_calls()
    call, name = calls[case]
    with pytest.raises(ValueError, match=rf"^{name} is written in place, but its producer exported a copy"):
        call()
    assert all(np.all(a == 7) for a in arrays)


def test_copied_exports_are_read_where_only_read():
    """Reading a copy is harmless: idx_mapping and the lengths may come as copies."""
    from trace_replay_core import TraceTable

    with TraceTable(4, 8, device="cpu") as table:
        table.stage(1, [5, 6, 7])
        table.commit(stream=0)
        sampled = np.full(2, 9, np.int64)
        idx, total, prompt = np.array([1, 0], np.int32), np.array([0, 3, 0, 0], np.int32), np.zeros(4, np.int32)
        table.replay(sampled, CopyingProducer(idx), CopyingProducer(total), CopyingProducer(prompt + 2), stream=0)
        assert sampled.tolist() == [6, 9]
