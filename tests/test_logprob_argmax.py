"""token_logprob_rank's ``out_argmax``: each row's greedy token from the same read of the logits,
and rows with a negative token id scored as it. The numpy backend and the Triton kernels (in
Triton's interpreter, the launches the GPU path makes) against the float64 reference, with
planted ties at the maximum, special rows, partial blocks and several chunks per program.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.argmax_cases import (  # noqa: E402
    _cpu,
    _interpreter_cases,
    assert_greedy,
    greedy_case,
    interpreted,  # noqa: F401 (module fixture)
)
from helpers.logprob_cases import (  # noqa: E402
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
)
from helpers.logprob_interpreter import run_cases  # noqa: E402

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


@pytest.mark.parametrize("name", [c["name"] for c in _interpreter_cases()])
def test_kernel_argmax_in_interpreter(interpreted, name):
    case, out = interpreted[name]
    assert_greedy(case["x"], case["ids"], out["lp"], out["rk"], out["am"], f"interpreter {name}")
    if case.get("top_k"):
        finite = ~np.isnan(case["x"]).all(axis=1)
        assert np.array_equal(out["tid"][finite, 0], out["am"][finite])


@pytest.mark.parametrize("name", ["bf16-12x3000-t128-g4", "bf16-12x3000-t128-g5", "f16-12x999-t128-g5"])
def test_kernel_group_changes_no_bit_of_argmax(interpreted, name):
    """Several chunks per program (four, or five with a shorter last program; the element path
    and the fused path): the bits of one chunk per program."""
    _, other = interpreted[name]
    _, one = interpreted[name.rsplit("-g", 1)[0] + "-g1"]
    for k in ("lp", "rk", "am"):
        assert np.array_equal(one[k].view(np.uint8), other[k].view(np.uint8)), k


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
        nan = np.isnan(g["lp"])  # a NaN, only -inf, or a +inf (the NaN payload may differ)
        assert np.array_equal(nan, np.isnan(e["lp"])) and np.flatnonzero(nan).tolist() == [3, 6, 7, 8, 10, 11], dtype
        assert np.array_equal(g["lp"][~nan].view(np.uint32), e["lp"][~nan].view(np.uint32)), dtype
        assert np.array_equal(g["rk"], e["rk"]), dtype
