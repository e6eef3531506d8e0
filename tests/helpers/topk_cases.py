"""Cases and checks of token_logprob_rank's batch invariance, top-k and temperature, and its special rows.

References are float64 numpy, separate from the code under test: the processed logits are
``float32(x) / float32(T)`` (vLLM divides the float32 logits), the normaliser and the logprobs
are taken in float64 from them, top-k sorts by (value descending, id ascending) with NaN never
selected. Ids and ranks must match exactly; logprobs within the bound of test_logprob_rank.py.
Ties are planted on purpose: equal values straddling the k-th place, ties across chunks, -0.0
against +0.0.

Batch invariance is checked bit for bit: the same rows in batches of 1, 3, 8 and 17 (at other
positions, among other rows) through Triton's interpreter and the numpy backend here, and on the
GPU at vocab 151,936 for batches 1 to 1024, both adapters and a CUDA graph in
``test_gpu_logprob_topk.py`` (which shares this file's references).
"""

from __future__ import annotations

import numpy as np
import torch

from helpers.logprob_cases import (  # noqa: E402
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
    make_case,
    round_to,
)
from trace_replay_core import token_logprob_rank  # noqa: E402


def processed(x: np.ndarray, temp) -> np.ndarray:
    """float32 logits / float32 T, in float32 (what the kernels compute before reducing)."""
    x = x.astype(np.float32)
    if temp is None:
        return x
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return x / np.asarray(temp, np.float32)[:, None]


def topk_reference(y: np.ndarray, top_k: int):
    """(logprobs float64, ids int64) ``[batch, top_k]`` of float32 ``y``: largest first, ties by
    the lower id, NaN never selected (-1 and NaN in the places left)."""
    batch, vocab = y.shape
    ids = np.full((batch, top_k), -1, np.int64)
    lps = np.full((batch, top_k), np.nan)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        y64 = y.astype(np.float64)
        m = y64.max(axis=1, keepdims=True)  # the contract: NaN, +inf or only -inf -> NaN
        lse = (m + np.log(np.exp(y64 - m).sum(axis=1, keepdims=True)))[:, 0]
    for r in range(batch):
        ok = np.flatnonzero(~np.isnan(y[r]))
        order = ok[np.lexsort((ok, -y64[r, ok]))][:top_k]
        ids[r, : order.size] = order
        with np.errstate(invalid="ignore"):
            lps[r, : order.size] = y64[r, order] - lse[r]
    return lps, ids


def assert_topk(y: np.ndarray, top_k: int, lp, ids, what: str) -> None:
    ref_lp, ref_ids = topk_reference(y, top_k)
    ids = np.asarray(ids).astype(np.int64)
    bad = np.argwhere(ids != ref_ids)
    assert bad.size == 0, (
        f"{what}: {len(bad)} top-k id mismatches, first at {bad[:5].tolist()}: got "
        f"{ids[tuple(bad[0])]}, want {ref_ids[tuple(bad[0])]}"
    )
    lp = np.asarray(lp, np.float64)
    assert np.array_equal(np.isnan(lp), np.isnan(ref_lp)), f"{what}: NaN places differ"
    fin = np.isfinite(ref_lp)
    assert np.array_equal(np.isinf(lp), np.isinf(ref_lp)) and np.all(lp[np.isinf(ref_lp)] == ref_lp[np.isinf(ref_lp)])
    tol = 2e-5 + 3e-7 * (
        np.abs(np.where(fin, ref_lp, 0))
        + 2 * np.abs(np.where(fin, y[np.arange(y.shape[0])[:, None], np.maximum(ref_ids, 0)], 0))
    )
    err = np.where(fin, np.abs(np.where(fin, lp, 0) - np.where(fin, ref_lp, 0)), 0)
    bad = np.argwhere(err > tol)
    assert bad.size == 0, f"{what}: top-k logprob error above bound at {bad[:5].tolist()}: {err[tuple(bad[0])]}"


def tied_case(rng, batch: int, vocab: int, dtype: str, top_k: int):
    """make_case's rows plus top-k ties: in odd rows the values around the k-th place repeat
    (several ids share them, spread over the row), some -0.0/+0.0 pairs, and a temperature."""
    x, ids = make_case(rng, batch, vocab, dtype)
    for r in range(1, batch, 2):
        if vocab < 8:
            break
        order = np.argsort(-x[r], kind="stable")
        k = min(top_k, vocab - 1)
        v = x[r, order[max(0, k - 1)]]
        spots = rng.choice(vocab, size=min(vocab, 4), replace=False)
        x[r, spots] = v
        x[r, rng.choice(vocab, size=2, replace=False)] = [0.0, -0.0]
    temp = rng.uniform(0.5, 2.0, size=batch).astype(np.float32)
    return round_to(x, dtype), ids, temp


def run_cpu(x, ids, dtype, *, temp=None, top_k=0, rank_dtype=np.int64):
    logits = torch.from_numpy(x).to(TORCH_DTYPES[dtype])
    batch = x.shape[0]
    lp = np.full(batch, POISON_LOGPROB, np.float32)
    rk = np.full(batch, POISON_RANK, rank_dtype)
    tlp = np.full((batch, top_k), POISON_LOGPROB, np.float32) if top_k else None
    tid = np.full((batch, top_k), POISON_RANK, rank_dtype) if top_k else None
    token_logprob_rank(
        logits,
        ids,
        out_logprobs=lp,
        out_ranks=rk,
        stream=0,
        top_k=top_k,
        temperature=None if temp is None else np.asarray(temp, np.float32),
        out_topk_logprobs=tlp,
        out_topk_ids=tid,
    )
    return dict(lp=lp, rk=rk, tlp=tlp, tid=tid)


CPU_TOPK = [
    (b, v, d, k)
    for d in TORCH_DTYPES
    for b, v in ((1, 1), (5, 7), (9, 1000), (4, 32000))
    for k in (1, 5, 20, 64)
    if k <= v
]


def special_rows(vocab: int, block: int, rng):
    """Rows of issue 16: 0 mostly -inf (3 finite), 1 whole blocks of -inf, 2 one finite entry,
    3 a NaN, 4 all NaN, 5 all -inf, 6 all equal, 7 -0.0 and +0.0 at the top, 8 a plain row with
    the big values packed into a few lines of one block (the top-k filter lets too many through:
    that program's logits are merged piece by piece), 9 +inf."""
    x = (rng.standard_normal((10, vocab)) * 3).astype(np.float32)
    x[x == 0] = 0.5
    ids = rng.integers(0, vocab, size=10).astype(np.int64)
    x[0, :] = -np.inf
    x[0, rng.choice(vocab, 3, replace=False)] = [1.0, 2.0, 1.0]
    x[1, : min(vocab, 2 * block)] = -np.inf
    x[2, :] = -np.inf
    x[2, vocab // 2] = 0.25
    x[3, vocab // 3] = np.nan
    x[4, :] = np.nan
    x[5, :] = -np.inf
    x[6, :] = 1.5
    x[7, :] = -5.0
    x[7, [vocab // 2, 1]] = [-0.0, 0.0]
    x[8, :] = -50.0 - np.arange(vocab) * 1e-3
    x[8, :28] = 100.0 + np.arange(28)
    x[9, vocab - 1] = np.inf
    return x, ids


BATCHES = (1, 3, 8)


N_WATCHED = 4


def invariance_batches(n_rows: int, rng):
    """For each batch size, batches of row indices: the first ``N_WATCHED`` rows are watched,
    each appears in some batch of every size at a changing position; the other rows fill up."""
    plans = {}
    for b in BATCHES:
        watched = rng.permutation(N_WATCHED)
        batches = []
        for s in range(0, N_WATCHED, b):
            rows = list(watched[s : s + b]) + list(
                rng.choice(np.arange(N_WATCHED, n_rows), b - len(watched[s : s + b]))
            )
            batches.append(rng.permutation(np.array(rows, dtype=np.int64)))
        plans[b] = batches
    return plans


def assert_same_bits(results, plans, what):
    """``results[b][i]`` the outputs of batch ``i`` of size ``b``: every watched row's bits agree."""
    first = {}
    for b, batches in plans.items():
        for i, rows in enumerate(batches):
            out = results[b][i]
            for pos, row in enumerate(rows):
                if row >= N_WATCHED:
                    continue
                got = tuple(
                    np.asarray(out[k][pos]).tobytes() for k in ("lp", "rk", "tlp", "tid") if out.get(k) is not None
                )
                want = first.setdefault(int(row), (got, b, pos))
                assert got == want[0], (
                    f"{what}: row {row} differs between batch {want[1]} (position {want[2]}) "
                    f"and batch {b} (position {pos})"
                )
    assert len(first) == N_WATCHED


def _bad_calls():
    x = np.ones((3, 10), np.float32) * 0.5
    tlp, tid = np.empty((3, 4), np.float32), np.empty((3, 4), np.int64)
    return {
        "top-k-above-64": (dict(top_k=65), ValueError, r"^top_k must be between 0 and 10 .*\(got 65\)"),
        "top-k-above-vocab": (
            dict(top_k=11),
            ValueError,
            r"^top_k must be between 0 and 10 \(at most 64 and at most "
            r"the vocabulary, 10\) \(got 11\)",
        ),
        "top-k-negative": (dict(top_k=-1), ValueError, r"^top_k must be between 0 and 10"),
        "top-k-bool": (dict(top_k=True), TypeError, r"^top_k must be an int \(got bool True\)"),
        "top-k-no-outputs": (dict(top_k=4), ValueError, r"^out_topk_logprobs must be given when top_k > 0"),
        "top-k-shape": (
            dict(top_k=3, out_topk_logprobs=tlp, out_topk_ids=tid),
            ValueError,
            r"^out_topk_logprobs must have shape \[3, 3\] \(\[batch, top_k\]\) \(got shape \[3, 4\]\)",
        ),
        "top-k-ids-dtype": (
            dict(top_k=4, out_topk_logprobs=tlp, out_topk_ids=np.empty((3, 4), np.float32)),
            TypeError,
            r"^out_topk_ids must have dtype int32 or int64 \(got float32\)",
        ),
        "top-k-outputs-without-top-k": (
            dict(out_topk_logprobs=tlp),
            ValueError,
            r"^out_topk_logprobs is given but top_k is 0",
        ),
        "top-k-aliases-logprobs": (
            dict(top_k=4, out_topk_logprobs=tlp, out_topk_ids=tlp.view(np.int32)),
            ValueError,
            r"^out_topk_logprobs and out_topk_ids overlap in memory",
        ),
        "temperature-length": (
            dict(temperature=np.ones(2, np.float32)),
            ValueError,
            r"^temperature must have 3 rows \(got shape \[2\]\)",
        ),
        "temperature-f64": (dict(temperature=np.ones(3)), TypeError, r"^temperature must have dtype float32"),
    }, x


BAD, _X = _bad_calls()
