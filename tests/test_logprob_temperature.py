"""Temperatures that are not finite and > 0 score their rows as NaN logits, never an error: the
same cases against every method of both frameworks and the core (numpy backend; the Triton
kernels in Triton's interpreter), scalar and per-row."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.logprob_interpreter import run_cases_by_name
from helpers.temperature_cases import (
    CASES,
    TOP_K,
    assert_temperature_results,
    case_data,
    jax_methods,
    per_row,
    torch_methods,
)

from trace_replay_core import token_logprob_rank

METHODS = {**torch_methods("cpu"), **jax_methods(jax.devices("cpu")[0])}


def _core_numpy(x, ids, temperature):
    batch = x.shape[0]
    outs = [np.full(batch, 777.0, np.float32), np.full(batch, -9, np.int64)]
    outs += [np.full((batch, TOP_K), 777.0, np.float32), np.full((batch, TOP_K), -9, np.int64)]
    outs += [np.full(batch, -9, np.int64), np.full(batch, 777.0, np.float32)]
    token_logprob_rank(
        x,
        ids,
        out_logprobs=outs[0],
        out_ranks=outs[1],
        stream=0,
        temperature=per_row(temperature),
        top_k=TOP_K,
        out_topk_logprobs=outs[2],
        out_topk_ids=outs[3],
        out_argmax=outs[4],
        out_entropy=outs[5],
    )
    return outs


METHODS["core-numpy"] = _core_numpy


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_bad_temperature_scores_nan(method, case):
    x, ids = case_data()
    temperature = CASES[case]
    res = METHODS[method](x, ids, temperature)
    assert_temperature_results(x, ids, temperature, *res, what=f"{method} {case}")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    x, ids = case_data()
    temp = CASES["array-mixed"]
    cases = []
    for dtype in ("float32", "bfloat16"):
        for top_k in (0, TOP_K):
            name = f"{dtype}-top{top_k}"
            case = dict(name=name, x=x, ids=ids, temp=temp, dtype=dtype, argmax=True, entropy=True, block=128)
            cases.append(case | ({"top_k": top_k} if top_k else {}))
    return run_cases_by_name(cases, str(tmp_path_factory.mktemp("interp-temp")))


def test_bad_temperature_in_kernels(interpreted):
    """The GPU path's kernels (Triton's interpreter): the same rows as the numpy backend."""
    x, ids = case_data()
    temp = CASES["array-mixed"]
    for name, (case, out) in interpreted.items():
        top = case.get("top_k", 0)
        if top:
            tlp, tid = out["tlp"], out["tid"]
        else:  # the top-k checks need top-k outputs: take them from the numpy backend's call
            ref = _core_numpy(x, ids, temp)
            tlp, tid = ref[2], ref[3]
        assert_temperature_results(x, ids, temp, out["lp"], out["rk"], tlp, tid, out["am"], out["ent"], what=name)
