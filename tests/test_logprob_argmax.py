"""token_logprob_rank's ``out_argmax``: each row's greedy token from the same read of the logits,
and rows with a negative token id scored as it. The numpy backend and the Triton kernels (in
Triton's interpreter, the launches the GPU path makes) against the float64 reference, with
planted ties at the maximum, special rows, partial blocks and several chunks per program."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_logprob_rank import (POISON_LOGPROB, POISON_RANK, TORCH_DTYPES, assert_matches_reference,  # noqa: E402
                               huge_case, round_to)
from trace_replay_core import greedy_argmax_reference, token_logprob_rank  # noqa: E402

from logprob_interpreter import run_cases  # noqa: E402

POISON_ARGMAX = -777


def greedy_case(rng: np.random.Generator, batch: int, vocab: int, dtype: str):
    """Logits with ties at the row maximum and special rows, and ids of which every odd row's is
    -1 (a greedy row). Row ``r`` by ``r % 6``: 0 a unique maximum; 1 the maximum repeated 2-5
    times, its first copy late in the row; 2 logits on a coarse grid (many ties at the maximum);
    3 one NaN and ~1% -inf; 4 the maximum in the row's last column; 5 plain. Where the batch
    allows: row 6 all -inf, row 7 all NaN, row 8 NaN and -inf only, row 9 one finite entry,
    row 10 a +inf."""
    x = rng.standard_normal((batch, vocab), dtype=np.float32) * 3.0
    x[x == 0] = 0.5
    for r in range(batch):
        kind = r % 6
        if kind == 0:
            x[r, rng.integers(vocab)] = x[r].max() + 1.0
        elif kind == 1 and vocab > 8:
            at = rng.choice(np.arange(vocab // 2, vocab), size=min(vocab // 2, int(rng.integers(2, 6))), replace=False)
            x[r, at] = x[r].max() + 0.5
        elif kind == 2:
            x[r] = np.round(x[r] * 2.0) / 2.0
            x[r, x[r] == 0] = 0.5
        elif kind == 3 and vocab > 8:
            x[r, rng.integers(0, vocab, size=max(1, vocab // 100))] = -np.inf
            x[r, rng.integers(vocab)] = np.nan
        elif kind == 4:
            x[r, -1] = x[r].max() + 0.25
    specials = {6: "-inf", 7: "nan", 8: "nan-inf", 9: "one", 10: "+inf"}
    for r, what in specials.items():
        if r >= batch:
            continue
        if what == "-inf":
            x[r] = -np.inf
        elif what == "nan":
            x[r] = np.nan
        elif what == "nan-inf":
            x[r] = -np.inf
            x[r, ::3] = np.nan
        elif what == "one":
            x[r] = -np.inf
            x[r, vocab // 3] = 1.5
        else:
            x[r, vocab // 2] = np.inf
    x = round_to(x, dtype)
    ids = rng.integers(0, vocab, size=batch).astype(np.int64)
    ids[1::2] = -1
    return x, ids


def assert_greedy(x, ids, lp, rk, am, what: str) -> None:
    """The argmax equals the reference in every row; every row matches the reference for its
    token, a negative id's token being the argmax."""
    want = greedy_argmax_reference(x)
    am = np.asarray(am).astype(np.int64)
    bad = np.flatnonzero(am != want)
    assert bad.size == 0, f"{what}: argmax differs at rows {bad[:10].tolist()}: got {am[bad[:10]].tolist()}, " \
                          f"want {want[bad[:10]].tolist()}"
    assert_matches_reference(x, np.where(ids < 0, want, ids), lp, rk, what)


def _cpu(x, ids, dtype, **kw):
    logits = torch.from_numpy(x).to(TORCH_DTYPES[dtype])
    lp = np.full(len(ids), POISON_LOGPROB, np.float32)
    rk = np.full(len(ids), POISON_RANK, np.int64)
    am = np.full(len(ids), POISON_ARGMAX, np.int32)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, out_argmax=am, stream=0, **kw)
    return lp, rk, am


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_cpu_backend_argmax_and_greedy_rows(dtype):
    x, ids = greedy_case(np.random.default_rng(3), 23, 1000, dtype)
    lp, rk, am = _cpu(x, ids, dtype)
    assert_greedy(x, ids, lp, rk, am, f"cpu {dtype}")
    # A greedy row gives the bits of a call that passes its argmax.
    lp2, rk2, _ = _cpu(x, np.where(ids < 0, am, ids), dtype)
    assert np.array_equal(lp.view(np.uint32), lp2.view(np.uint32)) and np.array_equal(rk, rk2)
    # The planted ties (greedy row 1): the first copy of the maximum wins, the others count.
    copies = np.flatnonzero(x[1] == np.nanmax(x[1]))
    assert ids[1] == -1 and copies.size >= 2 and am[1] == copies[0] and rk[1] == copies.size
    assert am[7] == 0 and am[6] == 0 and am[9] == 1000 // 3 and rk[7] == 0


def test_without_out_argmax_a_negative_id_stays_invalid():
    x, ids = greedy_case(np.random.default_rng(4), 6, 100, "float32")
    lp = np.full(6, POISON_LOGPROB, np.float32)
    rk = np.full(6, POISON_RANK, np.int64)
    token_logprob_rank(x, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    assert np.isnan(lp[ids < 0]).all() and (rk[ids < 0] == -1).all()


def test_cpu_backend_argmax_with_temperature_and_top_k():
    x, ids = greedy_case(np.random.default_rng(5), 12, 500, "float32")
    t = np.linspace(0.5, 2.0, 12, dtype=np.float32)
    top_lp, top_ids = np.empty((12, 3), np.float32), np.empty((12, 3), np.int64)
    lp, rk, am = _cpu(x, ids, "float32", temperature=t, top_k=3, out_topk_logprobs=top_lp, out_topk_ids=top_ids)
    y = x / t[:, None]
    assert_greedy(y, ids, lp, rk, am, "cpu temperature")
    finite = ~np.isnan(x).all(axis=1)
    assert np.array_equal(top_ids[finite, 0], am[finite])     # the first of the top-k is the argmax


# -- the Triton kernels, in Triton's interpreter -------------------------------------------------

def _interpreter_cases():
    rng = np.random.default_rng(21)
    cases = []

    def add(name, batch, vocab, dtype, data=None, **options):
        x, ids = data if data is not None else greedy_case(rng, batch, vocab, dtype)
        cases.append(dict(name=name, x=x, ids=ids, dtype=dtype, argmax=True, **options))

    # The real block (2048): vocab 32,000 is 8 chunks of 2 blocks, the last one partial.
    add("f32-11x32000", 11, 32000, "float32")
    add("bf16-11x32000-padded", 11, 32000, "bfloat16", pad=8, ids_dtype="int32", rank_dtype="int32")
    add("bf16-1x1", 1, 1, "bfloat16")
    # Block 128: many chunks; aligned bfloat16 rows (fused path), unaligned float16, a partial
    # last block, chunks of one block, and four chunks per program.
    add("bf16-12x3000-t128", 12, 3000, "bfloat16", block=128)
    add("f16-12x999-t128-unaligned", 12, 999, "float16", block=128, pad=3, shift=1)
    add("f32-12x2000-t128-c1", 12, 2000, "float32", block=128, chunk_blocks=1)
    same = greedy_case(rng, 12, 3000, "bfloat16")
    add("bf16-12x3000-t128-g1", 12, 3000, "bfloat16", data=same, block=128, group=1)
    add("bf16-12x3000-t128-g4", 12, 3000, "bfloat16", data=same, block=128, group=4)
    add("f32-12x3000-t128-topk5", 12, 3000, "float32", block=128, top_k=5)
    # Logits beyond 2**20: the fused path flags and re-sums such chunks; the argmax is exact.
    x, ids = huge_case(3000)
    ids[::2] = -1
    add("huge-bf16-t128", 9, 3000, "bfloat16", data=(round_to(x, "bfloat16"), ids), block=128)
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    cases = _interpreter_cases()
    out = run_cases(cases, str(tmp_path_factory.mktemp("interp_argmax")))
    return {c["name"]: (c, out[c["name"]]) for c in cases}


@pytest.mark.parametrize("name", [c["name"] for c in _interpreter_cases()])
def test_kernel_argmax_in_interpreter(interpreted, name):
    case, out = interpreted[name]
    assert_greedy(case["x"], case["ids"], out["lp"], out["rk"], out["am"], f"interpreter {name}")
    if case.get("top_k"):
        finite = ~np.isnan(case["x"]).all(axis=1)
        assert np.array_equal(out["tid"][finite, 0], out["am"][finite])


def test_kernel_group_changes_no_bit_of_argmax(interpreted):
    (_, one), (_, four) = interpreted["bf16-12x3000-t128-g1"], interpreted["bf16-12x3000-t128-g4"]
    for k in ("lp", "rk", "am"):
        assert np.array_equal(one[k].view(np.uint8), four[k].view(np.uint8)), k


def test_kernel_greedy_row_has_the_bits_of_its_explicit_id(tmp_path):
    """The same rows with ids -1 and with their argmax ids: identical logprob and rank bits
    (the element path, and aligned bfloat16 rows on the fused path)."""
    rng = np.random.default_rng(8)
    cases = []
    for dtype in ("float32", "bfloat16"):
        x, _ = greedy_case(rng, 12, 3000, dtype)
        cases.append(dict(name=f"{dtype}-greedy", x=x, ids=np.full(12, -1), dtype=dtype, block=128, argmax=True))
        cases.append(dict(name=f"{dtype}-explicit", x=x, ids=greedy_argmax_reference(x), dtype=dtype, block=128))
    out = run_cases(cases, str(tmp_path))
    for dtype in ("float32", "bfloat16"):
        g, e = out[f"{dtype}-greedy"], out[f"{dtype}-explicit"]
        nan = np.isnan(g["lp"])           # rows 3, 6, 7, 8 and 10 (the NaN payload may differ)
        assert np.array_equal(nan, np.isnan(e["lp"])) and nan.sum() == 5, dtype
        assert np.array_equal(g["lp"][~nan].view(np.uint32), e["lp"][~nan].view(np.uint32)), dtype
        assert np.array_equal(g["rk"], e["rk"]), dtype
