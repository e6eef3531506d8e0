"""token_logprob_rank's test data, reference and tolerance, shared by ``test_logprob_rank.py``,
``test_logprob_rank_interpreter.py`` (the Triton kernels in Triton's interpreter),
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

import numpy as np
import torch

from trace_replay_core import token_logprob_rank, token_logprob_rank_reference  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


BATCHES = (1, 7, 256, 1024)


VOCABS = (1, 1000, 32000, 151936, 262144)


POISON_LOGPROB = 777.0


POISON_RANK = -999


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


def run_core_cpu(x_f32: np.ndarray, ids: np.ndarray, dtype: str, *, rank_dtype=np.int64):
    logits = torch.from_numpy(x_f32).to(TORCH_DTYPES[dtype]) if dtype != "float32" else x_f32
    lp = np.full(x_f32.shape[0], POISON_LOGPROB, dtype=np.float32)
    rk = np.full(x_f32.shape[0], POISON_RANK, dtype=rank_dtype)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    return lp, rk


CPU_GRID = [(b, v, d) for d in TORCH_DTYPES for b in BATCHES for v in VOCABS if b * v <= 1 << 25]


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


def _bad_inputs():
    good = dict(logits=np.ones((3, 10), np.float32) * 0.5, token_ids=np.zeros(3, np.int64))
    ro = np.empty(3, np.int64)
    ro.flags.writeable = False
    ro_f32 = np.empty(3, np.float32)
    ro_f32.flags.writeable = False
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
        "out-entropy-dtype": (
            dict(out_entropy=np.empty(3, np.float64)),
            TypeError,
            r"^out_entropy must have dtype float32 \(got float64\)",
        ),
        "out-entropy-int": (
            dict(out_entropy=np.empty(3, np.int32)),
            TypeError,
            r"^out_entropy must have dtype float32 \(got int32\)",
        ),
        "out-entropy-length": (
            dict(out_entropy=np.empty(4, np.float32)),
            ValueError,
            r"^out_entropy must have 3 rows \(got shape \[4\]\)",
        ),
        "out-entropy-2d": (
            dict(out_entropy=np.empty((3, 1), np.float32)),
            ValueError,
            r"^out_entropy must be 1-D \(got shape \[3, 1\]\)",
        ),
        "out-entropy-strided": (
            dict(out_entropy=np.empty(6, np.float32)[::2]),
            ValueError,
            r"^out_entropy must be contiguous",
        ),
        "out-entropy-read-only": (
            dict(out_entropy=ro_f32),
            ValueError,
            r"^out_entropy is written in place and must be writable",
        ),
        "out-entropy-aliases-logprobs": (
            dict(out_logprobs=shared[:3], out_entropy=shared[2:5]),
            ValueError,
            r"^out_logprobs and out_entropy overlap in memory",
        ),
        "out-entropy-aliases-logits": (
            dict(logits=shared[:12].reshape(3, 4), out_entropy=shared[10:13]),
            ValueError,
            r"^out_entropy and logits overlap in memory",
        ),
    }, good


BAD, _GOOD = _bad_inputs()
