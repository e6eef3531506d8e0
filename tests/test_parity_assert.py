"""``trace_replay_app.parity.assert_parity`` on results a test builds (numpy only, no framework):
what passes, what fails, and what the failure says.

The defaults are the measured bounds they cite (``helpers.gpt2_cases.LOGPROB_ATOL`` for float32,
``helpers.bf16_bounds.LLAMA_BF16`` for bfloat16). A failure names the request, its first
divergent position (and its index in the sequence), the largest differences and the measures,
in a few lines without an array in them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.bf16_bounds import LLAMA_BF16
from helpers.gpt2_cases import LOGPROB_ATOL

from trace_replay_app import RequestResult, TraceRequest
from trace_replay_app.parity import TOLERANCES, ParityError, Tolerance, assert_parity, tolerance_for


def _result(rid: str, tokens, logprobs, forced: bool, argmax=None) -> RequestResult:
    """A result of copies of ``tokens`` and ``logprobs`` (argmax: the tokens unless given)."""
    tokens = np.array(tokens, np.int64)
    return RequestResult(
        id=rid,
        tokens=tokens,
        forced=np.full(tokens.shape, forced),
        logprobs=np.array(logprobs, np.float32),
        ranks=np.ones(tokens.shape, np.int64),
        argmax=tokens.copy() if argmax is None else np.array(argmax, np.int64),
    )


def _pair(rng, n_requests: int = 4, length: int = 20):
    """Requests (even: traced, prompt of 1 + i tokens) and two identical runs of them."""
    requests, a = [], []
    for i in range(n_requests):
        tokens = rng.integers(0, 100, length)
        prompt = tuple(int(t) for t in rng.integers(0, 100, 1 + i))
        traced = i % 2 == 0
        requests.append(TraceRequest(f"r{i}", prompt, tuple(int(t) for t in tokens) if traced else None, length))
        a.append(_result(f"r{i}", tokens, -rng.random(length) * 8, traced))
    b = [_result(x.id, x.tokens, x.logprobs, bool(x.forced[0])) for x in a]
    return requests, a, b


def _shift(result: RequestResult, at: int, by: float) -> None:
    result.logprobs[at] += np.float32(by)


def test_the_defaults_are_the_measured_bounds():
    assert TOLERANCES["float32"].max_abs == LOGPROB_ATOL and TOLERANCES["float32"].mean_abs is None
    assert TOLERANCES["bfloat16"].max_abs == LLAMA_BF16.max and TOLERANCES["bfloat16"].mean_abs == LLAMA_BF16.mean
    assert tolerance_for(torch.bfloat16) is TOLERANCES["bfloat16"]
    assert tolerance_for(np.dtype(np.float32)) is TOLERANCES["float32"]
    with pytest.raises(
        ValueError, match=r"^dtype must be one of float32, bfloat16 or pass tolerance= \(got 'float16'\)$"
    ):
        tolerance_for("float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_identical_runs_pass_and_return_the_report(dtype, rng):
    requests, a, b = _pair(rng)
    report = assert_parity(a, b, dtype=dtype, requests=requests)
    assert report["summary"]["compared_positions"] == 80 and report["summary"]["max_abs_logprob_diff"] == 0
    assert assert_parity(a, b, dtype=dtype)["summary"]["traced_requests"] == 2  # traced: from `forced`


def test_differences_within_the_float32_bound_pass(rng):
    requests, a, b = _pair(rng)
    for x in b:
        x.logprobs += (rng.random(x.logprobs.size) * 2e-5).astype(np.float32)
    assert_parity(a, b, dtype="float32", requests=requests)


def test_a_planted_difference_names_the_request_and_its_first_divergent_position(rng):
    requests, a, b = _pair(rng)
    _shift(b[2], 7, 0.25)
    _shift(b[2], 11, -1.5)
    _shift(b[1], 15, 3e-5)  # within the bound
    with pytest.raises(ParityError) as failed:
        assert_parity(a, b, dtype="float32", requests=requests)
    err = failed.value
    assert err.failures == [
        {"id": "r2", "first_divergent_position": 7, "why": err.failures[0]["why"], "positions_beyond": 2}
    ]
    lines = str(err).splitlines()
    assert lines[0].startswith("torch and jax disagree beyond the float32 tolerance (|d| <= 5e-05 per position;")
    assert lines[1].startswith(
        "  request 'r2' (traced, prompt of 3 tokens): first divergent position 7 (sequence index 10): "
        f"|d| 0.25 > 5e-05: torch {a[2].logprobs[7]:.6g}, jax {b[2].logprobs[7]:.6g}"
    )
    assert lines[1].endswith("; 2 positions beyond 5e-05")
    assert lines[2].startswith("largest |d|: 1.5 (request 'r2', position 11), 0.25 (request 'r2', position 7), 3e-05")
    assert lines[3].startswith("measures over 80 compared positions of 4 requests: max |d| 1.5, mean ")
    assert "k3 " in lines[3] and "pearson " in lines[3] and len(lines) == 4
    assert "array" not in str(err) and "[" not in str(err)
    assert err.parity_report["requests"][2]["first_divergence"] is None  # argmax agrees: only logprobs differ
    assert err.tolerance is TOLERANCES["float32"]


def test_the_message_stays_short_with_many_failing_requests(rng):
    requests, a, b = _pair(rng, n_requests=30)
    for x in b:
        x.logprobs += np.float32(0.5)
    with pytest.raises(ParityError) as failed:
        assert_parity(a, b, dtype="bfloat16", requests=requests, names=("model", "port"))
    text = str(failed.value)
    assert text.startswith("model and port disagree beyond the bfloat16 tolerance")
    assert "mean |d| 0.5 over all compared positions exceeds 0.015" in text
    assert "  ... and 24 more requests" in text and len(text.splitlines()) == 11 and len(text) < 3000


def test_bfloat16_mean_bound_fails_alone(rng):
    """Differences each within the per-position bound whose mean is not: a systematic error."""
    requests, a, b = _pair(rng)
    for x in b:
        x.logprobs += np.float32(0.03)
    _shift(b[3], 0, -0.03)
    with pytest.raises(ParityError) as failed:
        assert_parity(a, b, dtype="bfloat16", requests=requests)
    first = {f["id"]: f["first_divergent_position"] for f in failed.value.failures}
    assert first == {"r0": 0, "r1": 0, "r2": 0, "r3": 1}
    assert "mean |d| 0.03 > 0.015; |d| 0.03 at this position" in str(failed.value)


def test_untraced_requests_may_part_at_a_near_tie_only(rng):
    requests, a, b = _pair(rng)
    b[1].tokens[5] += 1  # r1 is untraced: the runs chose different tokens at position 5 ...
    b[1].logprobs[6:] -= np.float32(2.0)  # ... and what follows is not compared
    assert_parity(a, b, dtype="float32", requests=requests)  # ... with the same logprob: a tie
    _shift(b[1], 5, 0.5)  # the choices' logprobs differ: not a tie
    with pytest.raises(
        ParityError, match=r"request 'r1' \(untraced, prompt of 2 tokens\): first divergent position 5 "
    ):
        assert_parity(a, b, dtype="float32", requests=requests)
    requests, a, b = _pair(rng)
    b[0].tokens[3] += 1  # r0 is traced: its tokens never differ
    with pytest.raises(ParityError, match=r"first divergent position 3 \(sequence index 4\): forced tokens differ"):
        assert_parity(a, b, dtype="float32", requests=requests)


def test_non_finite_logprobs_and_lengths_fail(rng):
    requests, a, b = _pair(rng)
    b[0].logprobs[4] = np.nan
    with pytest.raises(ParityError, match=r"first divergent position 4 .*logprob not finite: torch [-0-9.]+, jax nan"):
        assert_parity(a, b, dtype="bfloat16", requests=requests)
    requests, a, b = _pair(rng)
    b[3] = _result("r3", b[3].tokens[:12], b[3].logprobs[:12], False)
    with pytest.raises(ParityError, match=r"first divergent position 12 .*torch decoded 20 tokens, jax 12"):
        assert_parity(a, b, dtype="float32", requests=requests)


def test_a_tolerance_of_the_callers_and_results_out_of_order(rng):
    requests, a, b = _pair(rng)
    _shift(b[0], 2, 0.01)
    loose = Tolerance(max_abs=0.02, mean_abs=None, measured="the caller's")
    assert_parity(a, b, dtype="float32", requests=requests, tolerance=loose)
    with pytest.raises(ParityError, match=r"\|d\| <= 0\.001 per position; the caller's\)"):
        assert_parity(a, b, dtype="float32", requests=requests, tolerance=Tolerance(1e-3, None, "the caller's"))
    with pytest.raises(ValueError, match=r"^results out of order: request 'r0' got results 'r0' and 'r1'$"):
        assert_parity(a, b[1:] + b[:1], dtype="float32", requests=requests)
