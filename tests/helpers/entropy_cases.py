"""Cases, reference and tolerance of token_logprob_rank's ``out_entropy`` (the Shannon entropy, in
nats, of each row's softmax), shared by the numpy backend's, the interpreter's, the adapters' and
the GPU tier's tests.

The reference is written here, apart from the library's code and another way round: float64
``log p = y - logsumexp(y)`` and ``H = -sum(p * log p)`` over the entries with ``p > 0`` (the
kernels and the numpy backend accumulate ``S = sum(exp(y - max))`` and ``U = sum(exp(y - max) *
(y - max))`` and return ``log(S) - U / S``).

Tolerance: ``|H - ref| <= 1e-5 * |ref| + 1e-6``. The entropy is ``log(S) + (-U / S)``, two terms
>= 0 (``S >= 1``, every term of ``U`` <= 0), so nothing cancels: ``-U / S`` carries the relative
error of the two float32 sums (each term rounded a few times, ``exp2`` within ``2**-21``, then at
most 64 terms per lane, a lane tree and at most a few dozen chunks: well under ``1e-5``), and
``log(S)`` carries ``S``'s relative error as an absolute one. That part does not shrink with the
entropy: a row whose entropy is tiny (one logit far above the rest: ``S`` a hair above 1) still
has ``log(S)`` off by the rounding of ``S`` near 1, ``2**-24`` per addition and about
``sqrt(82) * 2**-24 = 5e-7`` for the additions a term goes through; hence the floor of ``1e-6``
(the relative bound would ask ``1e-5`` of an entropy of ``1e-8`` to be met to ``1e-13``). The
floor stays far below what a lost term costs in the cases here: the near-one-hot rows' entropies
are ``>= 4e-5``, and a uniform row's is ``log(vocab)``.
"""

from __future__ import annotations

import numpy as np

from helpers.logprob_cases import round_to  # noqa: E402

ENTROPY_RTOL = 1e-5
ENTROPY_ATOL = 1e-6
POISON_ENTROPY = np.float32(np.nan)  # outputs are NaN-filled before a call: a row not written stays NaN

# The rows of entropy_case where the batch allows: name -> row.
ENTROPY_ROWS = {
    "uniform": 1,
    "one-hot": 2,
    "near-one-hot": 3,
    "one-finite": 4,
    "two-equal": 5,
    "all-inf": 6,
    "nan": 7,
    "plus-inf": 8,
}
NAN_ROWS = ("all-inf", "nan", "plus-inf")


def entropy_ref(y: np.ndarray) -> np.ndarray:
    """float64 ``-sum(p * log p)`` of ``softmax(y[b])`` per row; NaN for a row holding a NaN or a
    ``+inf``, or only ``-inf`` (no finite normaliser)."""
    x = np.asarray(y, dtype=np.float64)
    out = np.full(x.shape[0], np.nan)
    for r, row in enumerate(x):
        if np.isnan(row).any() or np.isposinf(row).any() or np.isneginf(row).all():
            continue
        z = row[np.isfinite(row)]
        z = z - z.max()  # before the log-sum-exp: rows near +-3e38 keep their differences
        log_p = z - np.log(np.sum(np.exp(z)))
        p = np.exp(log_p)
        out[r] = -np.sum(np.where(p > 0, p * log_p, 0.0))
    return out


def entropy_case(rng: np.random.Generator, batch: int, vocab: int, dtype: str, *, scale: float = 3.0):
    """``[batch, vocab]`` logits exact in ``dtype`` (float32, never zero; ~5% -inf in every third
    row) and int64 ids, with the rows of :data:`ENTROPY_ROWS` where the batch allows: all
    entries equal (entropy ``log(vocab)``), one logit 40 above the rest (entropy about
    ``vocab * 40 * exp(-40)``, below ``1e-12``: 0 to float32), one logit 12 above the rest
    (``>= 4e-5`` for ``vocab >= 8``), one finite entry among -inf (0), two equal entries among
    -inf (``log 2``), only -inf, a NaN, a +inf (the last three NaN)."""
    x = rng.standard_normal((batch, vocab), dtype=np.float32) * scale
    x[x == 0] = 0.5
    for r in range(0, batch, 3):
        if vocab > 8:
            x[r, rng.integers(0, vocab, size=max(1, vocab // 20))] = -np.inf
    rows = {name: r for name, r in ENTROPY_ROWS.items() if r < batch}
    for name, r in rows.items():
        if name == "uniform":
            x[r] = 1.25
        elif name in ("one-hot", "near-one-hot"):
            x[r] = rng.uniform(-0.5, 0.5, vocab).astype(np.float32)
            x[r, rng.integers(vocab)] = 40.0 if name == "one-hot" else 12.0
        elif name in ("one-finite", "two-equal", "all-inf"):
            x[r] = -np.inf
            if name != "all-inf":
                x[r, rng.choice(vocab, size=min(vocab, 1 if name == "one-finite" else 2), replace=False)] = 0.75
        elif name == "nan":
            x[r, rng.integers(vocab)] = np.nan
        elif name == "plus-inf":
            x[r, rng.integers(vocab)] = np.inf
    ids = rng.integers(0, vocab, size=batch).astype(np.int64)
    return round_to(x, dtype), ids


def assert_entropy(y: np.ndarray, ent, what: str, *, planted: bool = False) -> None:
    """``ent`` (one float32 per row) against :func:`entropy_ref` of ``y`` (the logits as the kernels
    reduce them: ``logits / T``): NaN exactly where the reference is NaN (so no row left
    unwritten in a NaN-poisoned output), elsewhere within the tolerance above. ``planted``:
    ``y`` holds :func:`entropy_case`'s rows; also check what they say by hand."""
    ent = np.asarray(ent)
    assert ent.shape == (y.shape[0],) and ent.dtype == np.float32, f"{what}: entropy {ent.shape} {ent.dtype}"
    ref = entropy_ref(y)
    got = ent.astype(np.float64)
    bad = np.flatnonzero(np.isnan(got) != np.isnan(ref))
    assert bad.size == 0, f"{what}: NaN mismatch at rows {bad[:10].tolist()}: got {got[bad[:10]].tolist()}"
    fin = ~np.isnan(ref)
    tol = ENTROPY_RTOL * np.abs(ref) + ENTROPY_ATOL
    err = np.where(fin, np.abs(np.where(fin, got, 0.0) - np.where(fin, ref, 0.0)), 0.0)
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, (
        f"{what}: entropy error above bound at rows {bad[:10].tolist()}: got {got[bad[:10]].tolist()}, "
        f"want {ref[bad[:10]].tolist()}"
    )
    if planted:
        vocab = y.shape[1]
        rows = {name: r for name, r in ENTROPY_ROWS.items() if r < y.shape[0]}
        for name, r in rows.items():
            if name in NAN_ROWS:
                assert np.isnan(got[r]), f"{what}: row {r} ({name}) entropy {got[r]}, want NaN"
            elif name == "uniform":
                assert abs(got[r] - np.log(vocab)) <= ENTROPY_RTOL * np.log(vocab) + ENTROPY_ATOL, (what, got[r])
            elif name == "one-finite" or (name == "two-equal" and vocab == 1):
                # 0 up to the floor: on a GPU the fused path's exponent offset (log2(e) * max,
                # rounded) leaves its one term at 2**(~1e-8), so log(S) - U/S is about 2e-8
                assert 0.0 <= got[r] <= ENTROPY_ATOL, f"{what}: row {r} ({name}) entropy {got[r]}, want 0"
            elif name == "two-equal":
                assert abs(got[r] - np.log(2.0)) <= 2e-6, f"{what}: row {r} ({name}) entropy {got[r]}"
            elif name == "one-hot":  # the same rounding as one-finite, on a GPU
                assert 0.0 <= got[r] < ENTROPY_ATOL, f"{what}: row {r} ({name}) entropy {got[r]}"
            elif name == "near-one-hot" and vocab >= 8:  # far above the floor: its small terms count
                assert got[r] > 3e-5 and (vocab > 4096 or got[r] < 0.2), f"{what}: row {r} ({name}) entropy {got[r]}"
