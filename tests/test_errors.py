"""CPU tier: bad input is refused with a clear message, and a refused call changes nothing.

Each case is id -> (call, exception type, anchored message pattern). Every case runs against a
table with committed and still-staged traces; afterwards the table, the trace lengths, what is
staged and the caller's arrays must be exactly as before.
"""

import numpy as np
import pytest

from trace_replay_core import ArrayView, TraceTable

MAX_SLOTS, MAX_LEN, VOCAB = 8, 6, 100


def _env():
    t = TraceTable(MAX_SLOTS, MAX_LEN, device="cpu", vocab_size=VOCAB)
    t.stage(1, [5, 6, 7])
    t.stage(4, [9])
    t.commit(stream=0)
    t.stage(2, [1, 2])  # staged, not committed
    t.clear(4)
    arrays = dict(
        sampled=np.arange(4, dtype=np.int64),
        idx=np.array([1, 2, -1, 4], np.int32),
        total=np.arange(MAX_SLOTS, dtype=np.int32),
        prompt=np.zeros(MAX_SLOTS, np.int32),
        step=np.zeros(4, np.int32),
    )
    return t, arrays


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


CORE = {
    "trace-empty": (
        lambda t, a: t.stage(0, []),
        ValueError,
        r"^tokens must not be empty \(got 0 tokens\); use clear\(slot\) to untrace a slot$",
    ),
    "trace-2d": (lambda t, a: t.stage(0, [[1, 2]]), ValueError, r"^tokens must be 1-D \(got shape \[1, 2\]\)$"),
    "trace-float": (
        lambda t, a: t.stage(0, [1.0, 2.0]),
        TypeError,
        r"^tokens must have an integer dtype \(got float64\)$",
    ),
    "trace-bool": (
        lambda t, a: t.stage(0, np.array([True])),
        TypeError,
        r"^tokens must have an integer dtype \(got bool\)$",
    ),
    "trace-negative": (
        lambda t, a: t.stage(0, [3, -1]),
        ValueError,
        r"^tokens must be non-negative \(got -1 at index 1\)$",
    ),
    "trace-too-long": (
        lambda t, a: t.stage(0, list(range(MAX_LEN + 1))),
        ValueError,
        r"^tokens has 7 tokens; the table holds at most max_trace_len=6$",
    ),
    "trace-above-vocab": (
        lambda t, a: t.stage(0, [1, VOCAB]),
        ValueError,
        r"^tokens must be below vocab_size=100 \(got 100 at index 1\)$",
    ),
    "trace-string": (
        lambda t, a: t.stage(0, "abc"),
        TypeError,
        r"^tokens must be a 1-D sequence of token ids \(list, numpy array or CPU tensor\); got str$",
    ),
    "trace-nested": (
        lambda t, a: t.stage(0, [1, [2]]),
        TypeError,
        r"^tokens must be a 1-D sequence of int token ids \(tokens\[1\] is list \[2\]\)$",
    ),
    "trace-none-entry": (
        lambda t, a: t.stage(0, (4, None)),
        TypeError,
        r"^tokens must be a 1-D sequence of int token ids \(tokens\[1\] is NoneType None\)$",
    ),
    "trace-beyond-64-bits": (
        lambda t, a: t.stage(0, [3, 2**64]),
        ValueError,
        r"^tokens must be below 2\*\*31 \(got 18446744073709551616 at index 1\)$",
    ),
    "trace-mixed-sign-wide": (  # numpy reads [-1, 2**63] as float64
        lambda t, a: t.stage(0, [2**63, -1]),
        ValueError,
        r"^tokens must be non-negative \(got -1 at index 1\)$",
    ),
    "stage-many-nested": (
        lambda t, a: t.stage_many([0, 3], [[1, 2], [5, [6, 7]]]),
        TypeError,
        r"^traces\[1\] must be a 1-D sequence of int token ids \(traces\[1\]\[1\] is list \[6, 7\]\)$",
    ),
    "slot-too-large": (lambda t, a: t.stage(MAX_SLOTS, [1]), ValueError, r"^slot must be in \[0, 8\) \(got 8\)$"),
    "slot-negative": (lambda t, a: t.stage(-1, [1]), ValueError, r"^slot must be in \[0, 8\) \(got -1\)$"),
    "slot-float": (lambda t, a: t.stage(1.0, [1]), TypeError, r"^slot must be an int \(got float 1\.0\)$"),
    "slot-bool": (lambda t, a: t.stage(True, [1]), TypeError, r"^slot must be an int \(got bool True\)$"),
    "slot-str": (lambda t, a: t.clear("3"), TypeError, r"^slot must be an int \(got str '3'\)$"),
    "clear-out-of-range": (lambda t, a: t.clear(99), ValueError, r"^slot must be in \[0, 8\) \(got 99\)$"),
    "commit-stream-none": (
        lambda t, a: t.commit(stream=None),
        TypeError,
        r"^stream must be given explicitly: .*\(got None\); pass 0 for the legacy default stream$",
    ),
    "commit-stream-negative": (
        lambda t, a: t.commit(stream=-1),
        ValueError,
        r"^stream must be a non-negative CUDA stream handle \(got -1\)$",
    ),
    "commit-stream-str": (
        lambda t, a: t.commit(stream="s"),
        TypeError,
        r"^stream must be an int CUDA stream handle or an object with __cuda_stream__ \(got str\)$",
    ),
    "commit-stream-positional": (lambda t, a: t.commit(0), TypeError, r"takes 1 positional argument"),
    "replay-stream-none": (
        lambda t, a: t.replay(a["sampled"], a["idx"], a["total"], a["prompt"], stream=None),
        TypeError,
        r"^stream must be given explicitly",
    ),
    "sampled-float": (
        lambda t, a: t.replay(a["sampled"].astype(np.float32), a["idx"], a["total"], a["prompt"], stream=0),
        TypeError,
        r"^sampled must have dtype int32 or int64 \(got float32\)$",
    ),
    "sampled-speculative": (
        lambda t, a: t.replay(np.zeros((4, 3), np.int64), a["idx"], a["total"], a["prompt"], stream=0),
        ValueError,
        r"^sampled has 3 tokens per row \(shape \[4, 3\]\): speculative decoding is not supported; "
        r"replay takes exactly one token per request per step$",
    ),
    "sampled-3d": (
        lambda t, a: t.replay(np.zeros((4, 1, 1), np.int64), a["idx"], a["total"], a["prompt"], stream=0),
        ValueError,
        r"^sampled must be 1-D \[batch\] or \[batch, 1\] \(got shape \[4, 1, 1\]\)$",
    ),
    "sampled-read-only": (
        lambda t, a: t.replay(_readonly(a["sampled"]), a["idx"], a["total"], a["prompt"], stream=0),
        ValueError,
        r"^sampled is written in place and must be writable \(got a read-only array\)$",
    ),
    "sampled-non-contiguous": (
        lambda t, a: t.replay(np.zeros(8, np.int64)[::2], a["idx"], a["total"], a["prompt"], stream=0),
        ValueError,
        r"^sampled must be contiguous \(got shape \[4\] with element strides \[2\]\)$",
    ),
    "sampled-wrong-device": (
        lambda t, a: t.replay(
            ArrayView(0x1000, (4,), (1,), "int64", "cuda", 0), a["idx"], a["total"], a["prompt"], stream=0
        ),
        ValueError,
        r"^sampled must be on cpu \(got cuda:0\)$",
    ),
    "idx-float": (
        lambda t, a: t.replay(a["sampled"], a["idx"].astype(np.float64), a["total"], a["prompt"], stream=0),
        TypeError,
        r"^idx_mapping must have dtype int32 or int64 \(got float64\)$",
    ),
    "idx-batch-mismatch": (
        lambda t, a: t.replay(a["sampled"], a["idx"][:3], a["total"], a["prompt"], stream=0),
        ValueError,
        r"^idx_mapping must have 4 rows \(got shape \[3\]\)$",
    ),
    "idx-2d": (
        lambda t, a: t.replay(a["sampled"], a["idx"].reshape(2, 2), a["total"], a["prompt"], stream=0),
        ValueError,
        r"^idx_mapping must be 1-D \(got shape \[2, 2\]\)$",
    ),
    "total-too-short": (
        lambda t, a: t.replay(a["sampled"], a["idx"], a["total"][:5], a["prompt"], stream=0),
        ValueError,
        r"^total_len must have at least 8 entries \(got shape \[5\]\)$",
    ),
    "prompt-int16": (
        lambda t, a: t.replay(a["sampled"], a["idx"], a["total"], a["prompt"].astype(np.int16), stream=0),
        TypeError,
        r"^prompt_len must have dtype int32 or int64 \(got int16\)$",
    ),
    "step-batch-mismatch": (
        lambda t, a: t.replay_at_step(a["sampled"], a["idx"], a["step"][:2], stream=0),
        ValueError,
        r"^step must have 4 rows \(got shape \[2\]\)$",
    ),
    "step-not-array": (
        lambda t, a: t.replay_at_step(a["sampled"], a["idx"], [0, 0, 0, 0], stream=0),
        TypeError,
        r"^step must be an array supporting DLPack \(__dlpack__ and __dlpack_device__\); got list$",
    ),
}


@pytest.mark.parametrize("case", sorted(CORE))
def test_core_refusals_change_nothing(case):
    call, exc, pattern = CORE[case]
    t, a = _env()
    table0, lens0 = t.snapshot()
    staged0 = {k: (None if v is None else v.copy()) for k, v in t._backend._staged.items()}
    arrays0 = {k: v.copy() for k, v in a.items()}
    with pytest.raises(exc, match=pattern):
        call(t, a)
    table1, lens1 = t.snapshot()
    assert np.array_equal(table0, table1) and np.array_equal(lens0, lens1)
    staged1 = t._backend._staged
    assert staged1.keys() == staged0.keys()
    assert all((staged0[k] is None and staged1[k] is None) or np.array_equal(staged0[k], staged1[k]) for k in staged0)
    assert all(np.array_equal(arrays0[k], a[k]) for k in a)
    t.close()


CONSTRUCTOR = {
    "max-slots-zero": (dict(max_slots=0), ValueError, r"^max_slots must be between 1 and 2147483647 \(got 0\)$"),
    "max-len-float": (dict(max_trace_len=2.5), TypeError, r"^max_trace_len must be an int \(got float 2\.5\)$"),
    "placement": (
        dict(placement="managed"),
        ValueError,
        r"^placement must be one of \('device', 'host_mapped'\) \(got 'managed'\)$",
    ),
    "device-bogus": (
        dict(device="tpu"),
        ValueError,
        r"^device must be 'cpu', 'cuda', 'cuda:N' or an int \(got 'tpu'\)$",
    ),
    "vocab-negative": (dict(vocab_size=-3), ValueError, r"^vocab_size must be between 1 and 2147483647 \(got -3\)$"),
    "device-missing": (
        dict(device=None),
        TypeError,
        r"^device must be 'cpu', 'cuda', 'cuda:N' or an int \(got NoneType\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCTOR))
def test_constructor_refusals(case):
    overrides, exc, pattern = CONSTRUCTOR[case]
    kw = dict(max_slots=4, max_trace_len=4, device="cpu")
    kw.update(overrides)
    with pytest.raises(exc, match=pattern):
        TraceTable(kw.pop("max_slots"), kw.pop("max_trace_len"), **kw)


def test_use_after_close():
    t, a = _env()
    t.close()
    for call in (
        lambda: t.stage(0, [1]),
        lambda: t.clear(0),
        lambda: t.commit(stream=0),
        lambda: t.replay(a["sampled"], a["idx"], a["total"], a["prompt"], stream=0),
        lambda: t.snapshot(),
    ):
        with pytest.raises(RuntimeError, match=r"^this TraceTable is closed$"):
            call()


def test_bound_replay_after_close():
    t, a = _env()
    bound = t.bind_replay(a["sampled"], a["idx"], a["total"], a["prompt"], stream=0)
    t.close()
    with pytest.raises(RuntimeError, match=r"^this TraceTable is closed$"):
        bound(stream=0)
