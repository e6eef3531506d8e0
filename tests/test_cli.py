"""The ``trace-replay`` command line, end to end on the CPU (in-process through ``main``)."""

import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers.cli_helpers import load
from helpers.cli_helpers import main as run_cli

from trace_replay_app import cli, demo
from trace_replay_app.models import get_family
from trace_replay_app.models.gpt2 import GPT2Config
from trace_replay_app.records import RequestResult
from trace_replay_app.runner import progress_bar
from trace_replay_app.traces import random_requests, read_traces, write_traces

CONFIG = GPT2Config()
GPT2 = get_family("gpt2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """24 requests (16 traced with random tokens, 8 untraced), more than the 4 slots used."""
    path = str(tmp_path_factory.mktemp("traces") / "traces.jsonl")
    write_traces(path, random_requests(CONFIG, 24, seed=11, traced=2 / 3, prompt_len=(1, 20), new_tokens=(1, 16)))
    return path


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_run_reproduces_every_trace(tmp_path, trace_file, framework):
    out = str(tmp_path / "out.json")
    status, text = run_cli("run", "--framework", framework, "--traces", trace_file, "--out", out, "--max-batch", "4")
    assert status == 0, text
    assert re.match(
        rf"^{framework} on cpu: 24 requests \(16 traced\), \d+ tokens in [\d.]+ s \(\d+ tokens/s\)\n"
        r"exact reproduction: 16/16 traced requests; "
        r"forced tokens: mean logprob -[\d.]+, mean rank [\d.]+\n"
        rf"wrote {re.escape(out)}\n$",
        text,
    ), text
    doc = load(out)
    requests = read_traces(trace_file, CONFIG)
    s = doc["summary"]
    assert (s["framework"], s["device"], s["max_batch"], s["requests"], s["traced_requests"]) == (
        framework,
        "cpu",
        4,
        24,
        16,
    )
    assert s["exact_reproductions"] == 16 and s["tokens"] == sum(r.new_tokens for r in requests)
    assert s["forced_tokens"] == sum(r.new_tokens for r in requests if r.trace) and s["tokens_per_s"] > 0
    assert s["weights"] == {"source": "seeded", "seed": 0} and s["model"]["vocab_size"] == 512
    assert [r["id"] for r in doc["requests"]] == [q.id for q in requests]
    for q, r in zip(requests, doc["requests"], strict=True):
        n = q.new_tokens
        assert all(len(r[k]) == n for k in ("tokens", "forced", "logprobs", "ranks", "argmax"))
        assert r["prompt_len"] == len(q.prompt) and r["traced"] == (q.trace is not None)
        if q.trace is not None:
            assert r["reproduced"] is True and r["tokens"] == list(q.trace) and all(r["forced"])
        else:
            assert r["reproduced"] is None and not any(r["forced"]) and r["tokens"] == r["argmax"]
        assert all(lp <= 0 for lp in r["logprobs"]) and all(1 <= k <= 512 for k in r["ranks"])
    # forced random tokens are unlikely under the model: logprob/rank come from the real logits
    forced_ranks = [k for r in doc["requests"] if r["traced"] for k in r["ranks"]]
    assert np.mean(forced_ranks) > 20


def test_compare_writes_report_and_plot(tmp_path, trace_file):
    out_dir = tmp_path / "new" / "folder"
    status, text = run_cli("compare", "--traces", trace_file, "--out-dir", str(out_dir), "--max-batch", "4")
    assert status == 0, text
    report = load(out_dir / "compare_report.json")
    assert (out_dir / "compare_divergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = report["summary"]
    # identical weights: the frameworks differ only by float32 rounding
    assert s["max_abs_logprob_diff"] is not None and s["max_abs_logprob_diff"] <= 1e-5
    assert s["compared_positions"] >= sum(r.new_tokens for r in read_traces(trace_file) if r.trace)
    assert s["runs"]["torch"]["exact_reproductions"] == s["runs"]["jax"]["exact_reproductions"] == 16
    assert s["frameworks"] == ["torch", "jax"] and s["requests"] == 24 and s["traced_requests"] == 16
    for row in report["requests"]:
        if row["traced"]:
            assert row["first_token_divergence"] is None
            assert row["compared_positions"] == len(row["tokens"]) == len(row["logprob_diff"])
        assert all(d is None or abs(d) <= 1e-5 for d in row["logprob_diff"])
        if row["first_argmax_divergence"] is None:
            assert row["torch_argmax"] == row["jax_argmax"]
    assert [p["position"] for p in report["per_position"]] == list(range(len(report["per_position"])))
    assert "torch vs jax: 24 requests (16 traced)" in text and "|logprob difference|: max" in text


def test_compare_explicit_paths_and_quiet(tmp_path, trace_file):
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    status, text = run_cli(
        "compare", "--traces", trace_file, "--report", str(report), "--plot", str(plot), "--quiet", "--max-batch", "4"
    )
    assert status == 0 and text == ""
    assert report.is_file() and plot.is_file()
    assert sorted(os.listdir(tmp_path)) == ["p.png", "r.json"]


# bad trace file line(s) -> anchored regex after "<file>, "
BAD = {
    "not_json": (['{"id": "a", "prompt": [1], "trace": [2]}', "{"], r"line 2: not valid JSON"),
    "duplicate_id": (
        ['{"id": "a", "prompt": [1], "trace": [2]}', '{"id": "a", "prompt": [1], "trace": [3]}'],
        r"line 2, field \"id\": duplicate id 'a' \(first on line 1\)",
    ),
    "empty_prompt": (['{"id": "a", "prompt": [], "trace": [2]}'], r'line 1, field "prompt": must not be empty'),
    "negative": (
        ['{"id": "a", "prompt_token_ids": [4, -1], "trace": [2]}'],
        r'line 1, field "prompt_token_ids": token id -1 at index 1 is negative',
    ),
    "untraced_without_count": (['{"id": "a", "prompt": [1]}'], r'line 1, field "max_new_tokens": missing'),
    "beyond_vocab_trace": (
        ['{"id": "b", "prompt": [1], "trace_token_ids": [3, 512]}'],
        (
            r'line 1, field "trace_token_ids": token id 512 at index 1 is not below the model\'s '
            r"vocab_size 512"
        ),
    ),
    "too_long": (
        [json.dumps({"id": "a", "prompt": [1] * 120, "trace": [1] * 9})],
        (
            r'line 1, field "trace": prompt \(120\) \+ decoded tokens \(9\) = 129 exceed the model\'s '
            r"n_positions 128"
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("command", ["run", "compare"])
def test_malformed_file_fails_before_writing(tmp_path, capsys, case, command):
    lines, pattern = BAD[case]
    traces = tmp_path / "bad.jsonl"
    traces.write_text("\n".join(lines) + "\n")
    if command == "run":
        args = ["run", "--framework", "torch", "--traces", str(traces), "--out", str(tmp_path / "out.json")]
    else:
        args = ["compare", "--traces", str(traces), "--out-dir", str(tmp_path / "cmp")]
    status, _ = run_cli(*args)
    err = capsys.readouterr().err
    assert status == 2
    assert re.match(rf"^trace-replay {command}: error: {re.escape(str(traces))}, {pattern}", err), err
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no output, no temporary file, no folder


def test_a_run_that_fails_midway_writes_nothing(tmp_path, trace_file, monkeypatch):
    def broken(config, weights, requests, **kw):
        kw["on_step"](3)
        raise RuntimeError("device lost")

    monkeypatch.setattr(GPT2, "load_loop", lambda fw: broken)
    with pytest.raises(RuntimeError, match="device lost"):
        run_cli("run", "--framework", "torch", "--traces", trace_file, "--out", str(tmp_path / "out.json"))
    assert os.listdir(tmp_path) == []


def _torch_loop(*args, **kw):
    from trace_replay_app.models.gpt2.torch_loop import run_decode

    return run_decode(*args, **kw)


def _dropping_traces(config, weights, requests, **kw):
    """The torch loop run as if no request carried a trace."""
    return _torch_loop(config, weights, [dataclasses.replace(r, trace=None) for r in requests], **kw)


def test_run_exits_1_when_a_trace_is_not_reproduced(tmp_path, trace_file, monkeypatch, capsys):
    monkeypatch.setattr(GPT2, "load_loop", lambda fw: _dropping_traces)
    out = tmp_path / "out.json"
    status, text = run_cli("run", "--framework", "torch", "--traces", trace_file, "--out", str(out), "--quiet")
    assert status == 1 and text == ""
    assert re.match(r"^trace-replay run: 16 traced requests were not reproduced exactly: r\d+", capsys.readouterr().err)
    assert load(out)["summary"]["exact_reproductions"] == 0  # the results are still written


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--framework", "torch", "--traces", "t", "--out", "o", "--device", "tpu"], r"--device: must be cpu"),
        (["run", "--framework", "mxnet", "--traces", "t", "--out", "o"], r"--framework: invalid choice"),
        (["run", "--framework", "torch", "--traces", "t"], r"the following arguments are required: --out"),
        (["compare", "--traces", "t", "--max-batch", "0"], r"--max-batch: must be a positive integer \(got 0\)"),
        (["demo", "--max-batch", "x"], r"--max-batch: must be a positive integer \(got 'x'\)"),
        ([], r"the following arguments are required"),
    ],
)
def test_bad_usage_exits_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bad_paths_exit_2(tmp_path, trace_file, capsys):
    """(A device a framework does not see: tests/test_cli_hostile.py, as a child process.)"""
    run = ["run", "--framework", "torch", "--traces", trace_file]
    cases = [
        (
            ["run", "--framework", "torch", "--traces", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")],
            r"--traces .*none\.jsonl: cannot read \(No such file or directory\)",
        ),
        (
            ["run", "--framework", "torch", "--traces", trace_file, "--out", str(tmp_path / "no" / "o.json")],
            r"--out .*o\.json: folder .*no does not exist",
        ),
        (["run", "--framework", "torch", "--traces", trace_file, "--out", str(tmp_path)], r"--out .*: is a folder"),
        (["compare", "--traces", trace_file, "--out-dir", trace_file], r"--out-dir .*: exists and is not a folder"),
        (["compare", "--traces", trace_file, "--plot", str(tmp_path / "no" / "p.png")], r"--plot .*: folder .*"),
        (
            [
                "run",
                "--framework",
                "torch",
                "--traces",
                trace_file,
                "--out",
                str(tmp_path / "o"),
                "--checkpoint",
                str(tmp_path / "ckpt"),
            ],
            r".*ckpt: not a folder",
        ),
        (
            [*run, "--out", str(tmp_path / "o"), "--seed", "3", "--checkpoint", str(tmp_path / "ckpt")],
            r"--seed 3: has no effect with --checkpoint",
        ),
        (
            [*run, "--out", str(tmp_path / "o"), "--sampling-seed", "5"],
            r"--sampling-seed 5: has no effect at --temperature 0 \(greedy: nothing drawn\)$",
        ),
        (
            ["compare", "--traces", trace_file, "--run", "torch", "--sampling-seed", "5"],
            r"--sampling-seed 5: has no effect here \(only --run samples, at --temperature above 0\)$",
        ),
    ]
    for args, pattern in cases:
        status, _ = run_cli(*args)
        err = capsys.readouterr().err
        assert status == 2, args
        assert re.match(rf"^trace-replay {args[0]}: error: {pattern}", err), err
    assert os.listdir(tmp_path) == []


def test_compare_without_matplotlib_writes_the_report_and_skips_the_plot(tmp_path, trace_file, monkeypatch):
    """Without matplotlib, compare still writes its report and says the plot was skipped."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: import raises ImportError
    status, text = run_cli("compare", "--traces", trace_file, "--out-dir", str(tmp_path / "cmp"), "--max-batch", "4")
    assert status == 0, text
    assert os.listdir(tmp_path / "cmp") == ["compare_report.json"]
    assert load(tmp_path / "cmp" / "compare_report.json")["summary"]["requests"] == 24
    assert re.search(r"^wrote .*compare_report\.json; plot skipped: matplotlib is not installed", text, re.MULTILINE)


# the demo ---------------------------------------------------------------------------------------
def test_demo_entry_point_runs_and_passes():
    """``python -m trace_replay_app demo``: both frameworks, every check, exit status 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "trace_replay_app", "demo"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert text.startswith("trace-replay demo: GPT-2-style model with seeded weights (seed 0;")
    assert "12 requests on 4 slots, device cpu" in text
    rows = {line.split()[0]: line for line in text.splitlines() if re.match(r"^(own|random|free)-\d ", line)}
    assert len(rows) == 12
    assert all(row.count("exact") == 2 for rid, row in rows.items() if not rid.startswith("free"))
    assert all(row.count("= no traces") == 2 for rid, row in rows.items() if rid.startswith("free"))
    for fw in ("torch", "jax"):
        assert f"check: {fw}: traced requests reproduced their traces exactly: 8/8 ok" in text
        assert f"check: {fw}: untraced requests equal a run without any traces: 4/4 ok" in text
    assert re.search(r"^torch vs jax: logprobs differ by at most ", text, re.MULTILINE)
    assert text.rstrip().endswith("all checks passed") and "FAILED" not in text


def test_demo_shows_forced_tokens_against_the_model(capsys):
    """One framework is enough here: the model's own continuation is forced at rank 1, random
    tokens far down; --quiet prints only the totals and the checks."""
    result = demo.run_demo(loops={"torch": _torch_loop}, seed=3, max_batch=3)
    assert result.ok and result.comparison is None
    by_kind = {}
    for q, r in zip(result.requests, result.results["torch"], strict=True):
        by_kind.setdefault(q.id.split("-")[0], []).extend(r.ranks.tolist())
    assert set(by_kind["own"]) == {1} and np.mean(by_kind["random"]) > 20 and set(by_kind["free"]) == {1}
    assert len(result.requests) > result.max_batch
    out = io.StringIO()
    demo.report(result, quiet=True, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("torch: 12 requests, ") and "random traces mean logprob" in lines[0]
    assert [line.split(":")[0] for line in lines[1:-1]] == ["check"] * 2 and lines[-1] == "all checks passed"


def _changing_untraced(config, weights, requests, **kw):
    """The torch loop, but with traces present it changes an untraced request's tokens."""
    results = _torch_loop(config, weights, requests, **kw)
    traced = any(q.trace is not None for q in requests)
    for q, r in zip(requests, results, strict=True):
        if traced and q.trace is None and q.id.endswith("-2"):
            r.tokens = (r.tokens + 1) % config.vocab_size
    return results


@pytest.mark.parametrize(
    "loop, failed",
    [
        (_dropping_traces, "torch: traced requests reproduced their traces exactly: 0/8 FAILED"),
        (_changing_untraced, "torch: untraced requests equal a run without any traces: 3/4 FAILED"),
    ],
)
def test_demo_checks_catch_a_broken_loop(loop, failed):
    result = demo.run_demo(loops={"torch": loop})
    assert not result.ok
    out = io.StringIO()
    demo.report(result, out=out)
    text = out.getvalue()
    assert f"check: {failed}" in text and text.rstrip().endswith("CHECKS FAILED: see above")


def _echo_loop(config, weights, requests, **kw):
    """A stand-in loop: each traced request decodes its trace, each other one zeros."""
    out = []
    for q in requests:
        n = q.new_tokens
        tokens = np.asarray(q.trace if q.trace is not None else [0] * n, np.int64)
        ones = np.ones(n, np.int64)
        out.append(
            RequestResult(q.id, tokens, np.full(n, q.trace is not None), np.full(n, -1.0, np.float32), ones, ones)
        )
    return out


def test_demo_names_the_slots_it_used():
    """--max-batch 100 for the demo's 12 requests: the header names the 12 slots used, not the option."""
    result = demo.run_demo(loops={"torch": _echo_loop}, max_batch=100)
    out = io.StringIO()
    demo.report(result, out=out)
    assert "12 requests on 12 slots, device cpu" in out.getvalue(), out.getvalue()[:300]


def test_demo_subcommand_exit_status_follows_the_checks(monkeypatch):
    monkeypatch.setattr(
        demo,
        "run_demo",
        lambda **kw: demo.DemoResult(
            CONFIG,
            "cpu",
            0,
            4,
            [],
            {"torch": []},
            {"torch": []},
            {"torch": 1.0},
            None,
            [demo.Check("x", 0, 1, ["broken"])],
        ),
    )
    status, text = run_cli("demo", "--quiet")
    assert status == 1 and "check: x: 0/1 FAILED" in text


# progress, imports --------------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_only_on_a_terminal():
    """The progress bar (tqdm) draws on a terminal, erases itself when closed, and stays silent
    on a stream that is not a terminal, when turned off, and for runs shorter than its delay."""
    stream = _Tty()
    with progress_bar(100, "torch", stream=stream, delay_s=0) as bar:
        bar.update(40)
        bar.refresh()
        assert "torch" in stream.getvalue() and "40/100" in stream.getvalue()
    assert stream.getvalue().endswith("\r")  # leave=False: the line is cleared on close
    quiet = io.StringIO()
    with progress_bar(100, "jax", stream=quiet, delay_s=0) as bar:
        bar.update(100)
    assert quiet.getvalue() == ""
    forced_off = _Tty()
    with progress_bar(10, "x", stream=forced_off, enabled=False, delay_s=0) as bar:
        bar.update(5)
    assert forced_off.getvalue() == ""
    late = _Tty()
    with progress_bar(10, "x", stream=late, delay_s=60) as bar:  # short runs print nothing
        bar.update(5)
    assert late.getvalue() == ""


def test_the_command_line_imports_no_framework_until_it_runs_one(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": []}\n')
    code = (
        "import sys, trace_replay_app.__main__, trace_replay_app.cli as cli, trace_replay_app.demo, "
        "trace_replay_app.compare, trace_replay_app.checkpoint, trace_replay_app.runner, trace_replay_app.models; "
        f"status = cli.main(['run', '--framework', 'torch', '--traces', {str(bad)!r}, '--out', "
        f"{str(tmp_path / 'o.json')!r}]); "
        "loaded = [m for m in ('torch', 'jax', 'jaxlib', 'matplotlib') if m in sys.modules]; "
        "print('status', status, 'loaded', loaded)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.stdout.strip() == "status 2 loaded []", proc.stdout + proc.stderr


def test_torch_device_check_asks_the_driver_a_bounded_number_of_times(monkeypatch):
    """``--device cuda:N`` on a CUDA build of torch: the driver is asked a fixed number of times,
    not once per index up to N (``cuda:99999999999`` would take hours), and the message names
    the devices the process sees."""
    from trace_replay_app import runner

    asked = []

    def two_devices(device):
        asked.append(device)
        if int(device.partition(":")[2] or 0) >= 2:
            raise ValueError(f"device {device!r} is not available: this process sees 2 CUDA device(s)")
        return device

    monkeypatch.setattr(runner, "parse_device", two_devices)
    assert runner._torch_device_error("cuda:1000", "2.9.0+cu130") == "sees CUDA devices [0, 1] only"
    assert len(asked) <= 5, asked
    assert runner._torch_device_error("cuda:1", "2.9.0+cu130") is None
