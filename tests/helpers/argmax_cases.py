"""Cases and checks of token_logprob_rank's ``out_argmax``: each row's greedy token from the same read of the logits,
and rows with a negative token id scored as it. The numpy backend and the Triton kernels (in
Triton's interpreter, the launches the GPU path makes) against the float64 reference, with
planted ties at the maximum, special rows, partial blocks and several chunks per program.
"""

from __future__ import annotations

import numpy as np
import torch

from helpers.logprob_cases import (  # noqa: E402
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
    assert_matches_reference,
    round_to,
)
from trace_replay_core import greedy_argmax_reference, token_logprob_rank  # noqa: E402

POISON_ARGMAX = -777


# The special rows of greedy_case where the batch allows, each once with an explicit id and once
# greedy: name -> (explicit row, greedy row).
SPECIAL_ROWS = {
    "-inf": (6, 13),
    "nan": (14, 7),
    "nan-inf": (8, 15),
    "one": (16, 9),
    "+inf": (10, 17),
    "nan-first": (18, 11),
    "one-nan": (12, 19),
}


# The argmax dtype each adapter returns, by the top-level module of the array type.
NATIVE_ARGMAX_DTYPES = {"jax": np.int32, "jaxlib": np.int32, "torch": np.int64}


def greedy_case(rng: np.random.Generator, batch: int, vocab: int, dtype: str):
    """Logits exact in ``dtype`` (float32, never zero) with ties at the row maximum and special
    rows, and int64 ids of which every odd row's is -1 (a greedy row).

    Row ``r`` by ``r % 7``: 0 a unique maximum and ~1% -inf; 1 the maximum repeated 2-5 times,
    its first copy late in the row; 2 logits on a grid of 0.5 (ties at many values); 3 one NaN
    and ~1% -inf; 4 the maximum in the row's last column; 5 and 6 plain (rows 21-27 give each
    kind of rows 0-6 the other parity, greedy or explicit). The explicit rows' tokens by
    ``r % 4``: 0 the row's argmax (rank 1 on a unique maximum), but row 4's token is -inf; 2 a
    finite token below the maximum whose logit 1-5 other entries share. Where the batch allows,
    rows 6-19 are :data:`SPECIAL_ROWS`: only -inf; only NaN; NaN (every third entry, column 0 the
    first) and -inf; one finite entry (column ``vocab // 3``); a +inf (column ``vocab // 2``);
    NaN in column 0 and -inf elsewhere; one NaN among the row's finite values."""
    x = rng.standard_normal((batch, vocab), dtype=np.float32) * 3.0
    x[x == 0] = 0.5
    ids = rng.integers(0, vocab, size=batch).astype(np.int64)
    for r in range(batch):
        kind = r % 7
        if kind in (0, 3) and vocab > 8:
            x[r, rng.integers(0, vocab, size=max(1, vocab // 100))] = -np.inf
        if kind == 0:
            x[r, rng.integers(vocab)] = x[r].max() + 1.0
        elif kind == 1 and vocab > 8:
            at = rng.choice(np.arange(vocab // 2, vocab), size=int(rng.integers(2, 6)), replace=False)
            x[r, at] = x[r].max() + 0.5
        elif kind == 2:
            x[r] = np.round(x[r] * 2.0) / 2.0
            x[r, x[r] == 0] = 0.5
        elif kind == 3 and vocab > 8:
            x[r, rng.integers(vocab)] = np.nan
        elif kind == 4:
            x[r, -1] = x[r].max() + 0.25
        below = np.flatnonzero(np.isfinite(x[r]) & (x[r] < np.nanmax(x[r]))) if r % 4 == 2 else ()
        if len(below) >= 2:
            ids[r] = rng.choice(below)
            others = below[below != ids[r]]
            x[r, rng.choice(others, size=min(others.size, int(rng.integers(1, 6))), replace=False)] = x[r, ids[r]]
    if batch > 4 and vocab > 1:
        ids[4] = rng.integers(vocab - 1)  # not the maximum, in the last column
        x[4, ids[4]] = -np.inf
    for name, rows in SPECIAL_ROWS.items():
        for r in (r for r in rows if r < batch):
            if name in ("-inf", "nan-inf", "one", "nan-first"):
                x[r] = -np.inf
            if name == "nan":
                x[r] = np.nan
            elif name == "nan-inf":
                x[r, ::3] = np.nan
            elif name == "one":
                x[r, vocab // 3] = 1.5
            elif name == "+inf":
                x[r, vocab // 2] = np.inf
            elif name == "nan-first":
                x[r, 0] = np.nan
            elif name == "one-nan":
                x[r, rng.integers(vocab)] = np.nan
    x = round_to(x, dtype)
    named = np.setdiff1d(np.arange(0, batch, 4), [4])
    ids[named] = greedy_argmax_reference(x[named])
    ids[1::2] = -1
    return x, ids


def assert_greedy(x, ids, lp, rk, am, what: str, *, argmax_dtype="native", planted: bool = False) -> None:
    """The argmax equals the reference in every row (so never a NaN entry in a row with another
    value); every row matches the reference for its token, a negative id's token being the argmax.

    ``am`` must have one entry per row and the dtype ``argmax_dtype``: ``"native"`` the one the
    adapter of ``am``'s array type returns (int32 for a JAX array, int64 for a torch tensor; a
    numpy array, a caller's buffer, is not checked), None no check. ``planted``: ``x`` and ``ids``
    are :func:`greedy_case`'s as generated; also check by hand what its planted rows say."""
    if isinstance(argmax_dtype, str):
        argmax_dtype = NATIVE_ARGMAX_DTYPES.get(type(am).__module__.split(".")[0])
    want = greedy_argmax_reference(x)
    am = np.asarray(am)
    assert am.shape == want.shape, f"{what}: argmax of shape {am.shape}, want {want.shape}"
    assert argmax_dtype is None or am.dtype == argmax_dtype, f"{what}: argmax of dtype {am.dtype}, want {argmax_dtype}"
    am = am.astype(np.int64)
    bad = np.flatnonzero(am != want)
    assert bad.size == 0, (
        f"{what}: argmax differs at rows {bad[:10].tolist()}: got {am[bad[:10]].tolist()}, "
        f"want {want[bad[:10]].tolist()}"
    )
    has_value = ~np.isnan(x).all(axis=1)
    assert not np.isnan(x[has_value, am[has_value]]).any(), f"{what}: an argmax points at a NaN"
    assert_matches_reference(x, np.where(ids < 0, want, ids), lp, rk, what)
    if planted:
        _assert_planted_rows(x, ids, np.asarray(lp), np.asarray(rk).astype(np.int64), am, what)


def _assert_planted_rows(x, ids, lp, rk, am, what: str) -> None:
    batch, vocab = x.shape
    if batch > 1 and vocab > 8:  # row 1, greedy: the maximum repeated late; the first copy wins, all count
        copies = np.flatnonzero(x[1] == np.nanmax(x[1]))
        assert ids[1] == -1 and copies.size >= 2 and copies[0] >= vocab // 2, (what, ids[1], copies)
        assert am[1] == copies[0] and rk[1] == copies.size, (what, am[1], rk[1], copies)
    if batch > 4 and vocab > 1:  # row 4's token is -inf: logprob -inf, every entry counts
        assert ids[4] >= 0 and lp[4] == -np.inf and rk[4] == vocab and am[4] == vocab - 1, (what, lp[4], rk[4], am[4])
    # name -> (argmax, rank or None, logprob NaN whatever the token); NaN first, then -inf: the first -inf
    expect = {
        "-inf": (0, vocab, True),
        "nan": (0, 0, True),
        "nan-inf": (min(1, vocab - 1), None, True),
        "nan-first": (min(1, vocab - 1), None, True),
        "one": (vocab // 3, None, False),
        "+inf": (vocab // 2, None, False),
        "one-nan": (None, None, True),
    }
    for name, rows in SPECIAL_ROWS.items():
        want_am, want_rk, nan = expect[name]
        for r in (r for r in rows if r < batch):
            assert (ids[r] < 0) == (r % 2 == 1), (what, name, r, ids[r])
            assert want_am is None or am[r] == want_am, f"{what}: row {r} ({name}) argmax {am[r]}, want {want_am}"
            assert want_rk is None or rk[r] == want_rk, f"{what}: row {r} ({name}) rank {rk[r]}, want {want_rk}"
            assert not nan or np.isnan(lp[r]), f"{what}: row {r} ({name}) logprob {lp[r]}, want NaN"


def _cpu(x, ids, dtype, **kw):
    logits = torch.from_numpy(x).to(TORCH_DTYPES[dtype])
    lp = np.full(len(ids), POISON_LOGPROB, np.float32)
    rk = np.full(len(ids), POISON_RANK, np.int64)
    am = np.full(len(ids), POISON_ARGMAX, np.int32)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, out_argmax=am, stream=0, **kw)
    return lp, rk, am
