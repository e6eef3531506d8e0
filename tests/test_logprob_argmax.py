"""token_logprob_rank's greedy argmax: the numpy backend and the interpreted kernels, with the cases
and checks of ``helpers/argmax_cases.py``."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.argmax_cases import _cpu, assert_greedy, greedy_case  # noqa: E402
from helpers.logprob_cases import (  # noqa: E402
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
    huge_case,
    round_to,
)
from helpers.logprob_interpreter import run_cases_by_name  # noqa: E402

from trace_replay_core import greedy_argmax_reference, token_logprob_rank  # noqa: E402


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_cpu_backend_argmax_and_greedy_rows(dtype):
    x, ids = greedy_case(np.random.default_rng(3), 23, 1000, dtype)
    lp, rk, am = _cpu(x, ids, dtype)
    # planted: the ties of greedy row 1 (the first copy wins, all count) and the special rows.
    assert_greedy(x, ids, lp, rk, am, f"cpu {dtype}", planted=True)
    # A greedy row gives the bits of a call that passes its argmax.
    lp2, rk2, _ = _cpu(x, np.where(ids < 0, am, ids), dtype)
    assert np.array_equal(lp.view(np.uint32), lp2.view(np.uint32)) and np.array_equal(rk, rk2)


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
    assert np.array_equal(top_ids[finite, 0], am[finite])  # the first of the top-k is the argmax


def _interpreter_cases():
    rng = np.random.default_rng(21)
    cases = []

    def add(name, batch, vocab, dtype, data=None, **options):
        x, ids = data if data is not None else greedy_case(rng, batch, vocab, dtype)
        cases.append(dict(name=name, x=x, ids=ids, dtype=dtype, argmax=True, **options))

    # The real block (2048): vocab 32,000 is 8 chunks of 2 blocks, the last one partial.
    add("f32-4x32000", 4, 32000, "float32")
    add("bf16-4x32000-padded", 4, 32000, "bfloat16", pad=8, ids_dtype="int32", rank_dtype="int32")
    add("bf16-1x1", 1, 1, "bfloat16")
    # Blocks of 128 (rows 6-19 the special rows): aligned bfloat16 rows (the fused path),
    # unaligned float16 (the element path, shifted), a partial last block, chunks of one block,
    # and three chunks per program (8 chunks: 3, 3 and 2).
    add("bf16-20x600-t128", 20, 600, "bfloat16", block=128)
    add("f16-20x599-t128-unaligned", 20, 599, "float16", block=128, pad=3, shift=1)
    add("f32-7x1000-t128-c1", 7, 1000, "float32", block=128, chunk_blocks=1)
    same = greedy_case(rng, 7, 1000, "bfloat16")
    add("bf16-7x1000-t128-g1", 7, 1000, "bfloat16", data=same, block=128, group=1)
    add("bf16-7x1000-t128-g3", 7, 1000, "bfloat16", data=same, block=128, group=3)
    same = greedy_case(rng, 7, 999, "float16")
    add("f16-7x999-t128-g1", 7, 999, "float16", data=same, block=128, chunk_blocks=1, group=1, pad=3, shift=1)
    add("f16-7x999-t128-g3", 7, 999, "float16", data=same, block=128, chunk_blocks=1, group=3, pad=3, shift=1)
    add("f32-7x1000-t128-topk5", 7, 1000, "float32", block=128, top_k=5)
    # Logits beyond 2**20: the fused path flags and re-sums such chunks; the argmax is exact.
    x, ids = huge_case(1000)
    ids[::2] = -1
    add("huge-bf16-t128", 9, 1000, "bfloat16", data=(round_to(x, "bfloat16"), ids), block=128)
    return cases


def _greedy_and_explicit_cases():
    """The same rows with ids -1 (argmax) and with their argmax ids (no argmax output)."""
    rng = np.random.default_rng(8)
    cases = []
    for dtype in ("float32", "bfloat16"):
        x, _ = greedy_case(rng, 12, 1000, dtype)
        cases.append(dict(name=f"{dtype}-greedy", x=x, ids=np.full(12, -1), dtype=dtype, block=128, argmax=True))
        cases.append(dict(name=f"{dtype}-explicit", x=x, ids=greedy_argmax_reference(x), dtype=dtype, block=128))
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    cases = _interpreter_cases() + _greedy_and_explicit_cases()
    return run_cases_by_name(cases, str(tmp_path_factory.mktemp("interp_argmax")))


@pytest.mark.parametrize("name", [c["name"] for c in _interpreter_cases()])
def test_kernel_argmax_in_interpreter(interpreted, name):
    case, out = interpreted[name]
    assert_greedy(case["x"], case["ids"], out["lp"], out["rk"], out["am"], f"interpreter {name}")
    if case.get("top_k"):
        finite = ~np.isnan(case["x"]).all(axis=1)
        assert np.array_equal(out["tid"][finite, 0], out["am"][finite])


@pytest.mark.parametrize("name", ["bf16-7x1000-t128-g3", "f16-7x999-t128-g3"])
def test_kernel_group_changes_no_bit_of_argmax(interpreted, name):
    """Several chunks per program (three, with a shorter last program; the fused path and the
    element path): the bits of one chunk per program."""
    _, other = interpreted[name]
    _, one = interpreted[name.rsplit("-g", 1)[0] + "-g1"]
    for k in ("lp", "rk", "am"):
        assert np.array_equal(one[k].view(np.uint8), other[k].view(np.uint8)), k


def test_kernel_greedy_row_has_the_bits_of_its_explicit_id(interpreted):
    """The same rows with ids -1 and with their argmax ids: identical logprob and rank bits
    (the element path, and aligned bfloat16 rows on the fused path)."""
    for dtype in ("float32", "bfloat16"):
        g, e = interpreted[f"{dtype}-greedy"][1], interpreted[f"{dtype}-explicit"][1]
        nan = np.isnan(g["lp"])  # a NaN, only -inf, or a +inf (the NaN payload may differ)
        assert np.array_equal(nan, np.isnan(e["lp"])) and np.flatnonzero(nan).tolist() == [3, 6, 7, 8, 10, 11], dtype
        assert np.array_equal(g["lp"][~nan].view(np.uint32), e["lp"][~nan].view(np.uint32)), dtype
        assert np.array_equal(g["rk"], e["rk"]), dtype
