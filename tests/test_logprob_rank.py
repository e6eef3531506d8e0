"""token_logprob_rank: the numpy backend, the checks, the plan; and the data, reference and
tolerance that ``test_logprob_rank_interpreter.py`` (the Triton kernels in Triton's interpreter),
``test_gpu_logprob_rank.py`` (the GPU), ``test_logprob_topk.py`` and ``test_jax_logprob.py`` share.

Every result is checked against ``token_logprob_rank_reference`` (float64 numpy) on random
logits that are never zero, with ties planted on purpose, ``-inf`` entries, NaN/``+inf`` rows and
out-of-range token ids. Ranks must match exactly.

Logprob tolerance (the same for every logits dtype, on purpose): bfloat16 and float16 logits
convert exactly to float32, so the only error is float32 arithmetic. ``lse = max + log(sum)``
with ``sum`` of at most 2**18 terms in ``[0, 1]`` accumulated per lane (at most 64 terms) and
then by a tree: relative error of ``sum`` <= ~(64 + 18) * 2**-24 ~ 5e-6, which is the absolute
error of ``log(sum)``; the exp2/log approximations add <= 2**-21 relative per term; the two
float32 roundings of ``max + log(sum)`` and ``chosen - lse`` add <= 2**-24 * |value| each. Hence
``|logprob - ref| <= 2e-5 + 3e-7 * (|chosen| + |lse|)``. A wrongly converted bfloat16 or float16
logit would miss this by orders of magnitude.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trace_replay_core import bind_logprob_rank, token_logprob_rank, token_logprob_rank_reference  # noqa: E402
from trace_replay_core._logprob import logprob_rank_workspace_bytes  # noqa: E402
from trace_replay_core.kernels.logprob_rank import (  # noqa: E402
    LOGPROB_BLOCK,
    LogprobRankArgs,
    LogprobRankDtypes,
    _chunk_group,
    launch_specs,
    plan_logprob_rank,
    workspace_layout,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BATCHES = (1, 7, 256, 1024)
VOCABS = (1, 1000, 32000, 151936, 262144)
POISON_LOGPROB = 777.0
POISON_RANK = -999


# -- data --------------------------------------------------------------------------------------


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to ``dtype`` (returned as float32; exact in both)."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(TORCH_DTYPES[dtype]).float().numpy()


def make_case(rng: np.random.Generator, batch: int, vocab: int, dtype: str, *, neg_inf: bool = True):
    """Random logits (never zero) in ``dtype`` as exact float32, planted ties, and token ids.

    Row ``r`` by ``r % 4``: 0 = the token is the unique argmax (rank 1); 1 = the token ties the
    row maximum with one or more other entries; 2 = a few other entries equal the token's logit;
    3 = untouched random token. Rows ``r % 3 == 0`` get ~1% ``-inf`` entries (never the planted
    ones); in a batch of 5 or more, row 4's token itself is ``-inf``.
    """
    x = rng.standard_normal((batch, vocab), dtype=np.float32) * 4.0
    x = round_to(x, dtype)
    x[x == 0] = 0.5
    ids = rng.integers(0, vocab, size=batch).astype(np.int64)
    for r in range(batch):
        t = ids[r]
        if neg_inf and r % 3 == 0 and vocab > 8:
            holes = rng.integers(0, vocab, size=max(1, vocab // 100))
            holes = holes[holes != t]
            x[r, holes] = -np.inf
        others = np.flatnonzero(np.arange(vocab) != t)
        kind = r % 4
        if kind == 0:
            x[r, t] = np.max(x[r]) + 1.0
        elif kind == 1 and others.size:
            k = rng.choice(others, size=min(others.size, int(rng.integers(1, 4))), replace=False)
            x[r, t] = np.max(x[r])
            x[r, k] = x[r, t]
        elif kind == 2 and others.size:
            k = rng.choice(others, size=min(others.size, int(rng.integers(1, 6))), replace=False)
            x[r, k] = x[r, t]
    if batch >= 5 and vocab > 1:
        x[4, ids[4]] = -np.inf
    return round_to(x, dtype), ids


def reference(x: np.ndarray, ids: np.ndarray):
    """The float64 reference, by chunks of rows (bounded memory)."""
    rows = max(1, (1 << 22) // max(1, x.shape[1]))
    parts = [token_logprob_rank_reference(x[r : r + rows], ids[r : r + rows]) for r in range(0, x.shape[0], rows)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def assert_matches_reference(x: np.ndarray, ids: np.ndarray, logprobs, ranks, what: str) -> None:
    """Ranks exact; logprobs within the documented float32 bound; NaN/inf exactly where expected."""
    ref_lp, ref_rank = reference(x, ids)
    logprobs = np.asarray(logprobs, dtype=np.float64)
    ranks = np.asarray(ranks).astype(np.int64)
    bad = np.flatnonzero(ranks != ref_rank)
    assert bad.size == 0, (
        f"{what}: {bad.size} rank mismatches, rows {bad[:10].tolist()}: "
        f"got {ranks[bad[:10]].tolist()}, want {ref_rank[bad[:10]].tolist()}"
    )
    nan_got, nan_ref = np.isnan(logprobs), np.isnan(ref_lp)
    bad = np.flatnonzero(nan_got != nan_ref)
    assert bad.size == 0, f"{what}: NaN mismatch at rows {bad[:10].tolist()}: got {logprobs[bad[:10]].tolist()}"
    inf_ref = np.isinf(ref_lp)
    bad = np.flatnonzero(inf_ref & (logprobs != ref_lp))
    assert bad.size == 0, f"{what}: -inf expected at rows {bad[:10].tolist()}, got {logprobs[bad[:10]].tolist()}"
    fin = np.isfinite(ref_lp)
    rows = np.arange(x.shape[0])
    chosen = np.where(fin, x[rows, np.clip(ids, 0, x.shape[1] - 1)], 0.0).astype(np.float64)
    lse = np.where(fin, chosen - np.where(fin, ref_lp, 0.0), 0.0)  # the reference's log-sum-exp
    tol = 2e-5 + 3e-7 * (np.abs(chosen) + np.abs(lse))
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(logprobs - ref_lp), 0.0)
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, (
        f"{what}: logprob error above bound at rows {bad[:10].tolist()}: "
        f"err {err[bad[:10]].tolist()}, tol {tol[bad[:10]].tolist()}"
    )


def assert_planted(x: np.ndarray, ids: np.ndarray, ranks) -> None:
    """The planting did what it says (so the exact-rank check really covers ties)."""
    ranks = np.asarray(ranks).astype(np.int64)
    batch, vocab = x.shape
    if vocab < 8:
        return
    for r in range(batch):
        if r == 4:
            continue
        if r % 4 == 0:
            assert ranks[r] == 1, f"row {r}: planted unique argmax has rank {ranks[r]}"
        elif r % 4 == 1:
            assert ranks[r] >= 2, f"row {r}: planted tie at the maximum has rank {ranks[r]}"


# -- the numpy backend ------------------------------------------------------------------------


def run_core_cpu(x_f32: np.ndarray, ids: np.ndarray, dtype: str, *, rank_dtype=np.int64):
    logits = torch.from_numpy(x_f32).to(TORCH_DTYPES[dtype]) if dtype != "float32" else x_f32
    lp = np.full(x_f32.shape[0], POISON_LOGPROB, dtype=np.float32)
    rk = np.full(x_f32.shape[0], POISON_RANK, dtype=rank_dtype)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    return lp, rk


CPU_GRID = [(b, v, d) for d in TORCH_DTYPES for b in BATCHES for v in VOCABS if b * v <= 1 << 25]


@pytest.mark.parametrize("batch,vocab,dtype", CPU_GRID, ids=[f"b{b}-v{v}-{d}" for b, v, d in CPU_GRID])
def test_cpu_backend_matches_reference(batch, vocab, dtype):
    # Sizes above 2**25 logits (e.g. 1024 x 262,144) run in the GPU tier; the numpy backend
    # processes rows in fixed-size chunks, so larger batches exercise nothing new here.
    rng = np.random.default_rng(batch * 1_000_003 + vocab)
    x, ids = make_case(rng, batch, vocab, dtype)
    lp, rk = run_core_cpu(x, ids, dtype)
    assert_matches_reference(x, ids, lp, rk, f"cpu {batch}x{vocab} {dtype}")
    assert_planted(x, ids, rk)


def test_cpu_backend_hand_computed():
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, -np.inf, 4.0, -1.5]], dtype=np.float32)
    lp = np.full(8, POISON_LOGPROB, dtype=np.float32)
    rk = np.full(8, POISON_RANK, dtype=np.int64)
    logits = np.repeat(x, 4, axis=0)
    ids = np.array([1, 2, 0, 3, 0, 2, 1, 3], dtype=np.int32)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    lse0 = np.log(np.exp(1.0) + 2 * np.exp(3.0) + np.exp(2.0))
    lse1 = np.log(np.exp(5.0) + np.exp(4.0) + np.exp(-1.5))
    # Ties count against the token: both 3.0 entries have rank 2; the unique argmax has rank 1.
    assert rk.tolist() == [2, 2, 4, 3, 1, 2, 4, 3]
    want = [3 - lse0, 3 - lse0, 1 - lse0, 2 - lse0, 5 - lse1, 4 - lse1, -np.inf, -1.5 - lse1]
    np.testing.assert_allclose(lp, np.array(want, dtype=np.float32), rtol=0, atol=2e-6)


def special_case(vocab: int = 300, *, rng_seed: int = 7):
    """Rows with special values, and what the contract says about each (None: use reference).

    0 NaN somewhere in the row, 1 +inf in the row, 2 only -inf, 3 the token's logit is -inf,
    4 the token's own logit is NaN, 5 id -1, 6 id == vocab, 7 id huge, 8 plain row, 9 the
    token's logit is -inf in a row of only -inf except one entry.
    """
    rng = np.random.default_rng(rng_seed)
    x = rng.standard_normal((10, vocab), dtype=np.float32) * 3.0
    x[x == 0] = 0.5
    ids = rng.integers(0, vocab, size=10).astype(np.int64)
    x[0, (ids[0] + 7) % vocab] = np.nan
    x[1, (ids[1] + 11) % vocab] = np.inf
    x[2, :] = -np.inf
    x[3, ids[3]] = -np.inf
    x[4, ids[4]] = np.nan
    ids[5], ids[6], ids[7] = -1, vocab, 2**40
    x[9, :] = -np.inf
    x[9, (ids[9] + 1) % vocab] = 2.0
    expect = {
        0: (np.nan, None),
        1: (np.nan, None),
        2: (np.nan, vocab),
        3: (-np.inf, vocab),
        4: (np.nan, 0),
        5: (np.nan, -1),
        6: (np.nan, -1),
        7: (np.nan, -1),
        9: (-np.inf, vocab),
    }
    return x, ids, expect


BF16_MIN = -3.3895313892515355e38  # torch.finfo(torch.bfloat16).min, exact in every dtype here


def huge_case(vocab: int = 3000, *, rng_seed: int = 5):
    """Rows whose logits reach beyond 2**20 in magnitude, where the bfloat16 fast path's clamped
    exponent offsets lose terms (its chunk kernel flags a chunk whose maximum is beyond 2**20;
    the combine kernel re-sums the flagged chunks that can matter to the row): 0 masked with
    bfloat16's finfo.min except 5 entries (the token among them), 1 only finfo.min, 2 one logit
    of 3e38 (not the token), 3 the same with that logit as the token, 4 all near -1.5e38, 5
    -2.5e38 in the first half, -inf in the rest, one plain entry, 6 a plain row, 7 masked with
    -1e9 except every 97th entry, 8 all within 1 of -1e6 (inside the clamp, near its edge)."""
    rng = np.random.default_rng(rng_seed)
    x = rng.standard_normal((9, vocab), dtype=np.float32) * 3.0
    ids = rng.integers(0, vocab, size=9).astype(np.int64)
    keep = rng.choice(vocab, size=5, replace=False)
    x[0, :] = BF16_MIN
    x[0, keep] = rng.standard_normal(5) * 3.0
    ids[0] = keep[2]
    x[1, :] = BF16_MIN
    x[2, (ids[2] + 5) % vocab] = 3e38
    x[3, ids[3]] = 3e38
    x[4, :] = -1.5e38 * (1.0 + rng.random(vocab, dtype=np.float32) * 0.01)
    x[5, : vocab // 2] = -2.5e38
    x[5, vocab // 2 :] = -np.inf
    x[5, vocab - 7] = 1.0
    ids[5] = vocab - 7
    x[7, np.arange(vocab) % 97 != 0] = -1e9
    ids[7] = 97 * (ids[7] // 97)
    x[8, :] = -1e6 + rng.random(vocab, dtype=np.float32)
    return x, ids


def assert_special(x, ids, lp, rk, expect, what):
    lp = np.asarray(lp, dtype=np.float64)
    rk = np.asarray(rk).astype(np.int64)
    for row, (want_lp, want_rank) in expect.items():
        if np.isnan(want_lp):
            assert np.isnan(lp[row]), f"{what}: row {row} logprob {lp[row]}, want NaN"
        else:
            assert lp[row] == want_lp, f"{what}: row {row} logprob {lp[row]}, want {want_lp}"
        if want_rank is not None:
            assert rk[row] == want_rank, f"{what}: row {row} rank {rk[row]}, want {want_rank}"
    # NaN entries never count: row 0's rank is the count over its non-NaN entries.
    assert rk[0] == np.sum(x[0] >= x[0, ids[0]])
    assert_matches_reference(x, ids, lp, rk, what)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_cpu_backend_special_values(dtype):
    x, ids, expect = special_case()
    x = round_to(x, dtype)
    lp, rk = run_core_cpu(x, ids, dtype, rank_dtype=np.int32)
    assert_special(x, ids, lp, rk, expect, f"cpu special {dtype}")


def test_reference_special_values():
    x, ids, expect = special_case()
    lp, rk = token_logprob_rank_reference(x, ids)
    for row, (want_lp, want_rank) in expect.items():
        assert np.isnan(lp[row]) if np.isnan(want_lp) else lp[row] == want_lp, (row, lp[row])
        if want_rank is not None:
            assert rk[row] == want_rank, (row, rk[row])


def test_cpu_backend_strided_rows_and_column_ids():
    rng = np.random.default_rng(3)
    x, ids = make_case(rng, 9, 1000, "bfloat16")
    wide = torch.full((9, 1013), float("nan"), dtype=torch.bfloat16)  # padding would poison a misread
    wide[:, 5:1005] = torch.from_numpy(x).to(torch.bfloat16)
    logits = wide[:, 5:1005]
    assert logits.stride() == (1013, 1)
    lp = torch.full((9,), POISON_LOGPROB)
    rk = torch.full((9,), POISON_RANK, dtype=torch.int64)
    token_logprob_rank(logits, torch.from_numpy(ids)[:, None], out_logprobs=lp, out_ranks=rk, stream=0)
    assert_matches_reference(x, ids, lp.numpy(), rk.numpy(), "cpu strided")
    # Broadcast rows (row stride 0) are fine too.
    row = torch.from_numpy(x[:1]).expand(4, 1000)
    lp4, rk4 = torch.empty(4), torch.empty(4, dtype=torch.int32)
    ids4 = torch.tensor([0, 1, 2, 999])
    token_logprob_rank(row, ids4, out_logprobs=lp4, out_ranks=rk4, stream=0)
    assert_matches_reference(np.repeat(x[:1], 4, axis=0), ids4.numpy(), lp4.numpy(), rk4.numpy(), "cpu broadcast")


def test_cpu_backend_empty_batch_and_read_only_logits():
    lp, rk = np.empty(0, np.float32), np.empty(0, np.int64)
    token_logprob_rank(np.ones((0, 5), np.float32), np.empty(0, np.int64), out_logprobs=lp, out_ranks=rk, stream=0)
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    x.flags.writeable = False
    lp, rk = np.empty(2, np.float32), np.empty(2, np.int64)
    token_logprob_rank(x, np.array([2, 0]), out_logprobs=lp, out_ranks=rk, stream=0)
    assert rk.tolist() == [1, 3]


def test_bound_call_repeats_the_call_on_new_contents():
    """bind_logprob_rank validates once; each call recomputes from the arrays' current contents."""
    rng = np.random.default_rng(12)
    x, ids = make_case(rng, 6, 700, "float32")
    logits, ids_buf = x.copy(), ids.copy()
    lp = np.full(6, POISON_LOGPROB, np.float32)
    rk = np.full(6, POISON_RANK, np.int64)
    bound = bind_logprob_rank(logits, ids_buf, out_logprobs=lp, out_ranks=rk, stream=0)
    assert np.all(lp == POISON_LOGPROB)  # binding computes nothing
    for k in range(3):
        x, ids = make_case(np.random.default_rng(100 + k), 6, 700, "float32")
        logits[...] = x
        ids_buf[...] = ids
        bound(stream=0)
        assert_matches_reference(x, ids, lp, rk, f"bound call {k}")
    with pytest.raises(TypeError, match=r"^stream must be given explicitly"):
        bound(stream=None)
    with pytest.raises(ValueError, match=r"^out_logprobs must have 6 rows"):
        bind_logprob_rank(logits, ids_buf, out_logprobs=lp[:5], out_ranks=rk, stream=0)


def _bad_inputs():
    good = dict(logits=np.ones((3, 10), np.float32) * 0.5, token_ids=np.zeros(3, np.int64))
    ro = np.empty(3, np.int64)
    ro.flags.writeable = False
    shared = np.zeros(16, np.float32)
    return {
        "stream-none": (dict(stream=None), TypeError, r"^stream must be given explicitly"),
        "logits-1d": (dict(logits=np.ones(10, np.float32)), ValueError, r"^logits must be 2-D \(got shape \[10\]\)"),
        "logits-f64": (
            dict(logits=np.ones((3, 10))),
            TypeError,
            r"^logits must have dtype float32 or bfloat16 or float16 \(got float64\)",
        ),
        "logits-int": (dict(logits=np.ones((3, 10), np.int32)), TypeError, r"^logits must have dtype .*\(got int32\)"),
        "logits-empty-vocab": (
            dict(logits=np.ones((3, 0), np.float32)),
            ValueError,
            r"^logits must have between 1 and 1073741824 columns .*got shape \[3, 0\]",
        ),
        "logits-column-stride": (
            dict(logits=np.ones((3, 20), np.float32)[:, ::2]),
            ValueError,
            r"^logits must be contiguous along the vocabulary .*strides \[20, 2\]",
        ),
        "logits-not-array": (dict(logits=[[1.0, 2.0]] * 3), TypeError, r"^logits must be an array supporting DLPack"),
        "ids-length": (
            dict(token_ids=np.zeros(4, np.int64)),
            ValueError,
            r"^token_ids must have 3 rows \(got shape \[4\]\)",
        ),
        "ids-float": (
            dict(token_ids=np.zeros(3, np.float32)),
            TypeError,
            r"^token_ids must have dtype int32 or int64 \(got float32\)",
        ),
        "ids-two-per-row": (
            dict(token_ids=np.zeros((3, 2), np.int64)),
            ValueError,
            r"^token_ids must be 1-D \[batch\] or \[batch, 1\], one token per row "
            r"\(got shape \[3, 2\]\)",
        ),
        "out-lp-dtype": (
            dict(out_logprobs=np.empty(3, np.float64)),
            TypeError,
            r"^out_logprobs must have dtype float32 \(got float64\)",
        ),
        "out-lp-length": (
            dict(out_logprobs=np.empty(2, np.float32)),
            ValueError,
            r"^out_logprobs must have 3 rows \(got shape \[2\]\)",
        ),
        "out-rank-dtype": (
            dict(out_ranks=np.empty(3, np.float32)),
            TypeError,
            r"^out_ranks must have dtype int32 or int64 \(got float32\)",
        ),
        "out-rank-strided": (dict(out_ranks=np.empty(6, np.int64)[::2]), ValueError, r"^out_ranks must be contiguous"),
        "out-rank-read-only": (dict(out_ranks=ro), ValueError, r"^out_ranks is written in place and must be writable"),
        "out-aliases-logits": (
            dict(logits=shared[:12].reshape(3, 4), out_logprobs=shared[9:12]),
            ValueError,
            r"^out_logprobs and logits overlap in memory",
        ),
        "workspace-2d": (dict(workspace=np.empty((2, 8), np.uint8)), ValueError, r"^workspace must be 1-D"),
        "out-argmax-dtype": (
            dict(out_argmax=np.empty(3, np.float32)),
            TypeError,
            r"^out_argmax must have dtype int32 or int64 \(got float32\)",
        ),
        "out-argmax-length": (
            dict(out_argmax=np.empty(4, np.int64)),
            ValueError,
            r"^out_argmax must have 3 rows \(got shape \[4\]\)",
        ),
        "out-argmax-read-only": (
            dict(out_argmax=ro),
            ValueError,
            r"^out_argmax is written in place and must be writable",
        ),
        "out-argmax-aliases-ids": (
            dict(token_ids=shared.view(np.int32)[:3], out_argmax=shared.view(np.int32)[2:5]),
            ValueError,
            r"^out_argmax and token_ids overlap in memory",
        ),
    }, good


BAD, _GOOD = _bad_inputs()


@pytest.mark.parametrize("case", list(BAD))
def test_errors_name_the_argument_and_change_nothing(case):
    override, exc, pattern = BAD[case]
    kwargs = dict(
        _GOOD,
        out_logprobs=np.full(3, POISON_LOGPROB, np.float32),
        out_ranks=np.full(3, POISON_RANK, np.int64),
        stream=0,
    )
    kwargs.update(override)
    lp, rk = kwargs["out_logprobs"], kwargs["out_ranks"]
    before_lp, before_rk = np.array(lp, copy=True), np.array(rk, copy=True)
    with pytest.raises(exc, match=pattern):
        token_logprob_rank(kwargs.pop("logits"), kwargs.pop("token_ids"), **kwargs)
    np.testing.assert_array_equal(lp, before_lp)
    np.testing.assert_array_equal(rk, before_rk)


def test_plan_depends_on_the_vocabulary_only_and_workspace_size():
    # Rows are cut into chunks of whole blocks of a size chosen from the vocabulary alone (the
    # batch is not an argument): that is what makes the results batch-invariant.
    for vocab in (1, 1000, 4097, 32000, 151936, 262144, 2**30):
        for itemsize in (2, 4):
            p = plan_logprob_rank(vocab, itemsize)
            assert p.block & (p.block - 1) == 0 and 128 <= p.block <= LOGPROB_BLOCK and p.n_chunks <= 256
            span = p.chunk_blocks * p.block  # logits per chunk
            assert (p.n_chunks - 1) * span < vocab <= p.n_chunks * span  # no empty chunk
            assert p.k_pad == 0 and p == plan_logprob_rank(vocab, 6 - itemsize)
            for top_k in (1, 20, 64):  # top-k: the same chunks
                k = plan_logprob_rank(vocab, itemsize, top_k)
                assert k[:4] == p[:4] and k.k_pad >= top_k and k.cap == 2 * k.k_pad and k.cap_p == 4 * k.k_pad
                assert k.sel == min(128, p.block // (16 // itemsize))
    assert plan_logprob_rank(151936, 2)[:2] == (2048, 13) and plan_logprob_rank(151936, 2).chunk_blocks == 6
    assert plan_logprob_rank(32000, 2)[:2] == (2048, 8) and plan_logprob_rank(32000, 4).chunk_blocks == 2
    # A vocabulary that leaves contiguous rows unaligned (not a multiple of 8 logits) takes chunks
    # of at least 4 blocks, in every dtype.
    for itemsize in (2, 4):
        gpt2 = plan_logprob_rank(50257, itemsize)
        assert gpt2[:2] == (2048, 7) and gpt2.chunk_blocks == 4
        assert plan_logprob_rank(10001, itemsize)[:2] == (2048, 2)
        assert plan_logprob_rank(151937, itemsize).chunk_blocks == 6  # already longer
    # The combine kernel holds a row's partials in one tile: a tuning override that would cut a
    # row into more than 256 chunks is refused, by name, before anything is compiled.
    assert plan_logprob_rank(2**20, 2, chunk_blocks=2).n_chunks == 256
    with pytest.raises(ValueError, match=r"chunk_blocks=1 cuts rows of 1048576 logits into more than 256 chunks"):
        plan_logprob_rank(2**20, 2, chunk_blocks=1)
    # Chunks per program: from the batch (speed only); the grid still covers every chunk once.
    assert [_chunk_group(b, 19) for b in (1, 64, 204, 205, 256, 409, 410, 4096)] == [1, 1, 1, 2, 2, 2, 4, 4]
    assert [_chunk_group(b, 13) for b in (1, 256, 292, 293, 511, 512, 4096)] == [1, 1, 1, 2, 2, 4, 4]
    assert all(_chunk_group(b, n) in (1, 2, 4) for b in (1, 5, 10_000) for n in (1, 2, 3, 19))
    assert [plan_logprob_rank(1000, 2, k).k_pad for k in (0, 1, 8, 9, 20, 32, 33, 64)] == [0, 8, 8, 32, 32, 32, 64, 64]
    # 20 bytes per chunk and row (max, sum, count, and the greedy maximum and column, used with
    # out_argmax); with top-k, per chunk 8 bytes per kept key and per candidate key and 4 per
    # candidate vector; 8 bytes per row for the token's logit and validity.
    assert logprob_rank_workspace_bytes(0, 151936) == 0
    assert logprob_rank_workspace_bytes(1, 151936) == 5 * 64 + 2 * 16  # 52 and 4 bytes rounded to 16
    assert logprob_rank_workspace_bytes(256, 151936) == 5 * 256 * 13 * 4 + 2 * 256 * 4
    assert logprob_rank_workspace_bytes(256, 151936, 20) == 256 * 13 * (20 + 32 * 8 + 64 * 8 + 128 * 4) + 2 * 256 * 4
    for batch in (1, 3, 1000):
        for vocab in (1, 999, 151936):
            for top_k in (0, 1, 20, 64):
                if top_k > vocab:
                    continue
                plan = plan_logprob_rank(vocab, 2, top_k)
                offsets = workspace_layout(batch, plan)
                assert all(o % 16 == 0 for o in offsets)
                assert offsets[-1] == logprob_rank_workspace_bytes(batch, vocab, top_k)
                per_chunk = 12 + (8 * plan.k_pad + 8 * plan.cap + 4 * plan.cap_p if top_k else 0)
                assert offsets[-1] >= batch * plan.n_chunks * per_chunk + 8 * batch


def test_kernels_follow_the_layout_of_contiguous_rows_at_every_batch_size():
    """Whether rows count as 16-byte aligned picks the compiled kernels (whether each line's
    words are shifted into place: the same bits either way by design, and speed), so it must not
    change with the batch: contiguous rows of a vocabulary are aligned alike at every batch size,
    one row alone included, whatever stride a one-row layout reports below the vocabulary.
    bfloat16 takes the fused path in every layout."""

    def chunk_constexprs(batch, vocab, stride, dtype, base=1 << 20):
        args = LogprobRankArgs(base, 2 << 20, 0, 3 << 20, 4 << 20, 0, 0, 5 << 20, batch, vocab, stride, 0)
        return launch_specs(args, LogprobRankDtypes(dtype, "int64", "int64"))[0][5]

    for dtype, itemsize in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        for vocab in (151936, 50257, 32000, 1001, 1000, 1):
            aligned = vocab * itemsize % 16 == 0
            for batch, stride in ((1, vocab), (1, 0), (1, 1), (2, vocab), (7, vocab), (1024, vocab)):
                const = chunk_constexprs(batch, vocab, stride, dtype)
                where = f"{dtype} vocab {vocab} batch {batch} stride {stride}"
                assert const["ALIGNED"] == aligned, where
                assert const["WORDS"] == (dtype == "bfloat16"), where
                assert const["SHIFT"] == (not aligned), where
            # A layout that changes the alignment: rows padded to 151,939, one of them alone or a
            # batch; an array that starts 2 bytes off a 16-byte boundary.
            padded = [chunk_constexprs(b, vocab, 151939, dtype)["ALIGNED"] for b in (1, 7)]
            assert padded == [False, False], f"{dtype} vocab {vocab} padded"
            assert not chunk_constexprs(1, vocab, vocab, dtype, base=(1 << 20) + 2)["ALIGNED"]


def test_core_imports_no_framework():
    code = (
        "import sys, trace_replay_core, trace_replay_core._logprob, trace_replay_core.kernels.logprob_rank; "
        "print('torch' in sys.modules, 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
