"""The command line's model, dtype and sampling options, the mismatch report of ``compare``,
``--max-k3``, the demo with one framework, refused output paths, Ctrl-C and ``--version``."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from helpers.cli_helpers import load
from helpers.cli_helpers import main as run_cli

from trace_replay_app import __version__, cli
from trace_replay_app.compare import _rms, compare_results, mismatch_measures
from trace_replay_app.models import get_family
from trace_replay_app.models.gpt2 import GPT2Config
from trace_replay_app.records import DeviceMemoryError, RequestResult, TraceRequest
from trace_replay_app.traces import random_requests, write_traces

CONFIG = GPT2Config()
GPT2 = get_family("gpt2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """10 requests: 6 traced, 4 untraced."""
    path = str(tmp_path_factory.mktemp("traces") / "traces.jsonl")
    write_traces(path, random_requests(CONFIG, 10, seed=3, traced=0.6, prompt_len=(1, 10), new_tokens=(2, 10)))
    return path


def _run(tmp_path, trace_file, *extra, framework="torch", name="out.json"):
    out = str(tmp_path / name)
    status, text = run_cli(
        "run", "--framework", framework, "--traces", trace_file, "--out", out, "--quiet", "--max-batch", "3", *extra
    )
    assert status == 0, text
    return load(out)


# --model, --dtype, --temperature --------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_model_dtype_and_sampling_options(tmp_path, trace_file, framework):
    base = _run(tmp_path, trace_file, "--model", "gpt2", framework=framework, name="base.json")
    s = base["summary"]
    assert (s["family"], s["dtype"], s["temperature"], s["sampling_seed"]) == ("gpt2", "float32", 0.0, 0)
    assert s["logprobs"] == "raw logits (before temperature)" and s["weights"] == {"source": "seeded", "seed": 0}
    assert _run(tmp_path, trace_file, framework=framework, name="plain.json")["requests"] == base["requests"]

    bf16 = _run(tmp_path, trace_file, "--dtype", "bfloat16", framework=framework, name="bf16.json")
    assert bf16["summary"]["dtype"] == "bfloat16" and bf16["summary"]["exact_reproductions"] == 6
    lp = lambda doc: np.array([x for r in doc["requests"] if r["traced"] for x in r["logprobs"]])  # noqa: E731
    assert 0 < np.abs(lp(bf16) - lp(base)).max() < 0.1  # computed in bfloat16, close to float32

    hot = [
        _run(
            tmp_path,
            trace_file,
            "--temperature",
            "1.5",
            "--sampling-seed",
            str(seed),
            framework=framework,
            name=f"hot{i}.json",
        )
        for i, seed in enumerate((4, 4, 5))
    ]
    assert hot[0]["requests"] == hot[1]["requests"], "the same sampling seed must give the same output"
    assert hot[0]["summary"]["temperature"] == 1.5 and hot[0]["summary"]["sampling_seed"] == 4
    free = lambda doc: [r["tokens"] for r in doc["requests"] if not r["traced"]]  # noqa: E731
    assert free(hot[0]) != free(hot[2]) and free(hot[0]) != free(base)
    assert hot[0]["summary"]["exact_reproductions"] == 6  # traces are still forced


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "bert"], r"--model: invalid choice: 'bert'"),
        (["--dtype", "float16"], r"--dtype: invalid choice: 'float16'"),
        (["--temperature", "-1"], r"--temperature: must be a finite number >= 0 \(got -1\)"),
        (["--temperature", "x"], r"--temperature: must be a number >= 0 \(got 'x'\)"),
        (["--sampling-seed", "-3"], r"--sampling-seed: must be an integer in \[0, 2\*\*63\) \(got -3\)"),
    ],
)
def test_bad_option_values_exit_2(tmp_path, trace_file, args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--framework", "torch", "--traces", trace_file, "--out", str(tmp_path / "o.json"), *args])
    assert exc.value.code == 2 and re.search(message, capsys.readouterr().err)
    assert os.listdir(tmp_path) == []


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"trace-replay {__version__}"
    proc = subprocess.run(
        [sys.executable, "-m", "trace_replay_app", "--version"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"trace-replay {__version__}" != "trace-replay "


# outputs that would replace inputs, Ctrl-C ------------------------------------------------------------
def test_out_equal_to_traces_is_refused(tmp_path, capsys):
    traces = tmp_path / "t.jsonl"
    write_traces(str(traces), random_requests(CONFIG, 2, seed=1))
    before = traces.read_bytes()
    cases = [
        (["run", "--framework", "torch", "--out", str(traces)], r"--out .*t\.jsonl: is the --traces file"),
        (
            ["run", "--framework", "torch", "--out", os.path.join(str(tmp_path), ".", "t.jsonl")],
            r"--out .*t\.jsonl: is the --traces file",
        ),
        (["compare", "--report", str(traces)], r"--report .*t\.jsonl: is the --traces file"),
        (
            ["compare", "--report", str(tmp_path / "r.json"), "--plot", str(traces)],
            r"--plot .*t\.jsonl: is the --traces file",
        ),
        (
            ["compare", "--out-dir", str(tmp_path), "--plot", str(tmp_path / "p.png")],
            r"--out-dir .*: give --out-dir or --plot, not both",
        ),
        (
            ["compare", "--report", str(tmp_path / "x"), "--plot", os.path.join(str(tmp_path), ".", "x")],
            r"--plot .*x: is also the --report path",
        ),
    ]
    for args, pattern in cases:
        assert run_cli(*args, "--traces", str(traces))[0] == 2, args
        assert re.match(rf"^trace-replay {args[0]}: error: {pattern}", capsys.readouterr().err)
    assert traces.read_bytes() == before and os.listdir(tmp_path) == ["t.jsonl"]


def test_ctrl_c_exits_130_with_one_line_and_leaves_out_untouched(tmp_path, trace_file, monkeypatch, capfd):
    def interrupted(config, weights, requests, **kw):
        kw["on_step"](2)
        raise KeyboardInterrupt

    monkeypatch.setattr(GPT2, "load_loop", lambda fw: interrupted)
    out = tmp_path / "out.json"
    out.write_text("previous results\n")
    for args in (["run", "--framework", "jax", "--out", str(out)], ["compare", "--out-dir", str(tmp_path)]):
        status, text = run_cli(*args, "--traces", trace_file)
        err = capfd.readouterr().err
        assert status == 130 and text == ""
        assert err.strip() == f"trace-replay {args[0]}: interrupted" and "Traceback" not in err
        assert out.read_text() == "previous results\n" and os.listdir(tmp_path) == ["out.json"]


def _sigint_then(outcome):
    """A loop that receives a real SIGINT mid-run, then ends as ``outcome`` says: a framework
    that wraps the ``KeyboardInterrupt`` (JAX's callbacks report it as an INTERNAL error), or
    one that swallows it and returns results."""

    def loop(config, weights, requests, **kw):
        kw["on_step"](1)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt:
            if outcome == "wrapped":
                raise ValueError("INTERNAL: CpuCallback error: KeyboardInterrupt") from None
        return [_result(r.id, [0] * r.new_tokens, [-1.0] * r.new_tokens, [0] * r.new_tokens) for r in requests]

    return loop


@pytest.mark.parametrize("outcome", ["wrapped", "swallowed"])
def test_ctrl_c_exits_130_however_the_framework_reports_it(tmp_path, trace_file, monkeypatch, capfd, outcome):
    monkeypatch.setattr(GPT2, "load_loop", lambda fw: _sigint_then(outcome))
    out = tmp_path / "out.json"
    out.write_text("previous results\n")
    before = signal.getsignal(signal.SIGINT)
    for args in (
        ["run", "--framework", "jax", "--out", str(out)],
        ["compare", "--report", str(out), "--plot", str(tmp_path / "p.png")],
    ):
        status, text = run_cli(*args, "--traces", trace_file)
        err = capfd.readouterr().err
        assert (status, text, err) == (130, "", f"trace-replay {args[0]}: interrupted\n")
        assert out.read_text() == "previous results\n" and os.listdir(tmp_path) == ["out.json"]
    assert signal.getsignal(signal.SIGINT) is before  # the command's handler is gone again


def test_slots_follow_the_requests_and_device_memory_errors_exit_2(tmp_path, trace_file, monkeypatch, capsys):
    seen = []

    def short_of_memory(config, weights, requests, **kw):
        seen.append(kw["max_batch"])
        raise DeviceMemoryError("cuda:0", 3 * 2**30, 2**30)

    monkeypatch.setattr(GPT2, "load_loop", lambda fw: short_of_memory)
    out = tmp_path / "out.json"
    status, _ = run_cli("run", "--framework", "torch", "--traces", trace_file, "--out", str(out), "--max-batch", "99")
    assert status == 2 and seen == [10]  # 10 requests: never more slots than requests
    assert capsys.readouterr().err == (
        "trace-replay run: error: the decode run needs 3,072.0 MiB on cuda:0, which has 1,024.0 MiB free: "
        "lower --max-batch or run fewer or shorter requests at once\n"
    )
    assert os.listdir(tmp_path) == []


# the demo with one framework -------------------------------------------------------------------------
def _without(missing):
    real = GPT2.load_loop

    def load(fw):
        if fw in missing:
            raise ImportError(f"No module named {fw!r}")
        return real(fw)

    return load


def test_demo_with_one_framework_runs_it_and_says_the_other_is_missing(monkeypatch):
    monkeypatch.setattr(GPT2, "load_loop", _without({"jax"}))
    status, text = run_cli("demo")
    assert status == 0, text
    assert re.match(
        r"^jax: missing, the demo runs torch only \(the jax decode loop of gpt2 cannot be imported "
        r"\(No module named 'jax'\); install the framework, e\.g\. pip install 'trace-replay\[jax\]'\)\n"
        r"trace-replay demo: GPT-2-style model with seeded weights",
        text,
    ), text
    assert "check: torch: traced requests reproduced their traces exactly: 8/8 ok" in text
    assert "check: jax" not in text and "torch vs jax" not in text and text.rstrip().endswith("all checks passed")


def test_demo_with_no_framework_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(GPT2, "load_loop", _without({"torch", "jax"}))
    status, _ = run_cli("demo")
    err = capsys.readouterr().err
    assert status == 2
    assert re.match(
        r"^trace-replay demo: error: no framework can run the demo: the torch decode loop of gpt2 "
        r"cannot be imported .*; the jax decode loop of gpt2 cannot be imported",
        err,
    ), err


# compare's mismatch measures and --max-k3 -------------------------------------------------------------
def _result(rid, tokens, logprobs, argmax):
    n = len(tokens)
    return RequestResult(
        rid,
        np.asarray(tokens, np.int64),
        np.zeros(n, bool),
        np.asarray(logprobs, np.float32),
        np.ones(n, np.int64),
        np.asarray(argmax, np.int64),
    )


def test_mismatch_measures_against_numpy(rng):
    """Per request and overall: |d| and |probability| differences, k3, Pearson, argmax
    mismatches and the first divergence, recomputed here from the random inputs."""
    requests, a, b, expect = [], [], [], []
    for i in range(5):
        n = int(rng.integers(3, 30))
        tokens = rng.integers(0, 50, n)
        la = -rng.exponential(2.0, n).astype(np.float32)
        lb = (la + rng.normal(0, 0.3, n)).clip(max=0).astype(np.float32)
        arg_a = rng.integers(0, 50, n)
        arg_b = np.where(rng.random(n) < 0.2, rng.integers(0, 50, n), arg_a)
        requests.append(TraceRequest(f"r{i}", (1,), tuple(int(t) for t in tokens)))
        a.append(_result(f"r{i}", tokens, la, arg_a))
        b.append(_result(f"r{i}", tokens, lb, arg_b))
        expect.append((la.astype(np.float64), lb.astype(np.float64), arg_a, arg_b))
    report = compare_results(requests, a, b)
    for row, (la, lb, arg_a, arg_b) in zip(report["requests"], expect, strict=True):
        d = lb - la
        np.testing.assert_allclose(row["mean_abs_logprob_diff"], np.abs(d).mean(), rtol=1e-12)
        np.testing.assert_allclose(row["max_abs_logprob_diff"], np.abs(d).max(), rtol=1e-12)
        np.testing.assert_allclose(row["mean_abs_prob_diff"], np.abs(np.exp(lb) - np.exp(la)).mean(), rtol=1e-12)
        np.testing.assert_allclose(row["max_abs_prob_diff"], np.abs(np.exp(lb) - np.exp(la)).max(), rtol=1e-12)
        np.testing.assert_allclose(row["k3"], np.mean(np.exp(d) - 1 - d), rtol=1e-9)
        np.testing.assert_allclose(row["pearson"], np.corrcoef(la, lb)[0, 1], rtol=1e-9)
        assert row["argmax_mismatches"] == int((arg_a != arg_b).sum())
        hits = np.flatnonzero(arg_a != arg_b)
        assert row["first_divergence"] == (int(hits[0]) if hits.size else None)
    la, lb = np.concatenate([e[0] for e in expect]), np.concatenate([e[1] for e in expect])
    s = report["summary"]
    np.testing.assert_allclose(s["k3"], np.mean(np.exp(lb - la) - 1 - (lb - la)), rtol=1e-9)
    np.testing.assert_allclose(s["pearson"], np.corrcoef(la, lb)[0, 1], rtol=1e-9)
    np.testing.assert_allclose(s["max_abs_prob_diff"], np.abs(np.exp(lb) - np.exp(la)).max(), rtol=1e-12)
    assert s["argmax_mismatches"] == sum(r["argmax_mismatches"] for r in report["requests"])
    firsts = [r["first_divergence"] for r in report["requests"] if r["first_divergence"] is not None]
    assert s["first_divergence"] == (min(firsts) if firsts else None)
    # k3 is non-negative and zero exactly where the runs agree; a constant sequence has no correlation
    same = compare_results(requests[:1], a[:1], a[:1])["requests"][0]
    assert same["k3"] == 0 and same["max_abs_logprob_diff"] == 0 and same["first_divergence"] is None
    flat = _result("c", [1, 2, 3], [-1, -1, -1], [0, 0, 0])
    assert compare_results([TraceRequest("c", (1,), (1, 2, 3))], [flat], [flat])["requests"][0]["pearson"] is None


def test_compare_reports_the_measures_and_max_k3_fails_the_requests_above(tmp_path, trace_file, monkeypatch, capsys):
    status, text = run_cli(
        "compare", "--traces", trace_file, "--out-dir", str(tmp_path / "ok"), "--max-k3", "1e-6", "--max-batch", "3"
    )
    assert status == 0, text
    s = load(tmp_path / "ok" / "compare_report.json")["summary"]
    assert 0 <= s["k3"] < 1e-9 and s["pearson"] > 0.999999 and s["argmax_mismatches"] == 0
    assert s["max_abs_prob_diff"] <= 1e-5 and s["logprobs"] == "raw logits (before temperature)"
    assert re.search(
        r"^\|probability difference\|: max .*; k3 KL estimate .*; logprob correlation 1; argmax "
        r"differs at 0 positions$",
        text,
        re.MULTILINE,
    ), text

    real = GPT2.load_loop

    def shifted(fw):
        loop = real(fw)
        if fw == "torch":
            return loop

        def run(*args, **kw):  # the JAX run's logprobs of two traced requests shifted by 0.5
            results = loop(*args, **kw)
            return [dataclasses.replace(r, logprobs=r.logprobs - 0.5) if r.id in ("r1", "r4") else r for r in results]

        return run

    monkeypatch.setattr(GPT2, "load_loop", shifted)
    traced = [r.id for r in random_requests(CONFIG, 10, seed=3, traced=0.6) if r.trace is not None]
    assert {"r1", "r4"} <= set(traced)
    status, _ = run_cli(
        "compare", "--traces", trace_file, "--out-dir", str(tmp_path / "bad"), "--max-k3", "0.01", "--quiet"
    )
    err = capsys.readouterr().err
    k3 = np.exp(-0.5) - 1 + 0.5
    assert status == 1
    assert re.match(
        rf"^trace-replay compare: 2 requests fail --max-k3 0\.01 \(k3 KL estimate above it or missing\): "
        rf"r1 \({k3:.3g}\), r4 \({k3:.3g}\)$",
        err.strip(),
    ), err
    report = load(tmp_path / "bad" / "compare_report.json")  # the report is still written
    assert {r["id"] for r in report["requests"] if r["k3"] > 0.01} == {"r1", "r4"}


def test_compare_summary_lines_name_every_measure():
    rows = compare_results(
        [TraceRequest("a", (1,), (2, 3))],
        [_result("a", [2, 3], [-1, -2], [2, 3])],
        [_result("a", [2, 3], [-1.5, -2], [2, 4])],
    )
    from trace_replay_app.compare import summary_lines

    text = "\n".join(summary_lines(rows))
    k3 = (np.exp(-0.5) - 1 + 0.5) / 2  # d = -0.5 at position 0, 0 at position 1
    dp = abs(np.exp(-1.5) - np.exp(-1.0))
    assert f"|logprob difference|: max 0.5, mean 0.25, p50 0.25, p99 {np.percentile([0.5, 0], 99):.3g}," in text
    assert f"|probability difference|: max {dp:.3g}, mean {dp / 2:.3g}; k3 KL estimate {k3:.3g};" in text
    assert "logprob correlation 1; argmax differs at 1 positions" in text, text
    assert "argmax choices differ in 1 requests; earliest at position 1 (request a)" in text
    rollout = RequestResult(
        "a", np.array([2, 3]), np.ones(2, bool), np.array([-1.5, -2.0]), np.full(2, -1), np.full(2, -1)
    )
    report = compare_results([TraceRequest("a", (1,), (2, 3))], [rollout], [_result("a", [2, 3], [-1, -2], [2, 3])])
    text = "\n".join(summary_lines(report))  # a rollout has neither ranks nor greedy tokens: nothing said of them
    assert "ranks differ" not in text and "argmax differs" not in text and "agree" not in text, text
    assert "; ranks not compared" in text and "; argmax not compared" in text, text
    assert report["summary"]["ranks_compared"] is report["summary"]["argmax_compared"] is False


def test_a_request_s_measures_leave_out_its_non_finite_logprobs():
    """One NaN logprob: the request's max, mean and k3 all cover its finite positions (the max
    was None while mean and k3 were finite)."""
    a = _result("a", [1, 2, 3], [-1.0, np.nan, -2.0], [1, 2, 3])
    b = _result("a", [1, 2, 3], [-1.5, -1.0, -2.0], [1, 2, 3])
    row = compare_results([TraceRequest("a", (1,), (1, 2, 3))], [a], [b])["requests"][0]
    assert row["non_finite_logprobs"] == 1 and row["mean_abs_logprob_diff"] == 0.25
    assert row["max_abs_logprob_diff"] == 0.5, row["max_abs_logprob_diff"]


def test_measures_of_huge_logprobs_stay_finite_without_overflow():
    """Logprobs near -1e300 (finite, so a rollout may carry them): the rms and Pearson of their
    differences are finite and right, computed without an overflow (warnings are errors here);
    k3's exp(d) is beyond float range, so k3 is not finite (reported as None)."""
    la = np.array([-1e300, -1.0, -2.0, -3.0])
    lb = np.array([-1.0, -1.5, -2.5, -1e299])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = mismatch_measures(la, lb)
        rms = _rms(lb - la)
    d = (lb - la) / 1e300
    np.testing.assert_allclose(rms, 1e300 * np.sqrt(np.mean(d * d)), rtol=1e-12)
    np.testing.assert_allclose(m["pearson"], np.corrcoef(la / 1e300, lb / 1e300)[0, 1], rtol=1e-12)
    assert m["k3"] is None and m["max_abs_logprob_diff"] == pytest.approx(1e300)
    assert _rms(np.zeros(3)) == 0.0
