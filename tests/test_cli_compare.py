"""``trace-replay compare`` over several sources, end to end on the CPU: a rollout file (an
engine's own logprobs), outputs of ``run`` and ``score``, runs made by compare itself; the RL
measures of every pair against values computed here from the logprobs; gates; refusals."""

import io
import json
import re

import numpy as np
import pytest
from helpers.cli_helpers import load
from helpers.cli_helpers import main as run_cli

from trace_replay_app.models.gpt2 import GPT2Config
from trace_replay_app.traces import random_requests, write_traces

CONFIG = GPT2Config()
SHIFT = 0.25  # the rollout's logprobs: torch's decode minus this, at every token


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A traced trace file, torch's and JAX's run outputs and torch's score output of it, and a
    rollout file (trace format with logprobs) whose logprobs are torch's decode's minus SHIFT."""
    folder = tmp_path_factory.mktemp("compare")
    traces = str(folder / "traces.jsonl")
    requests = random_requests(CONFIG, 5, seed=8, traced=1.0, prompt_len=(1, 10), new_tokens=(2, 9))
    write_traces(traces, requests)
    out = {"traces": traces}
    for name, args in {
        "torch": ("run", "--framework", "torch"),
        "jax": ("run", "--framework", "jax"),
        "torch-score": ("score", "--framework", "torch"),
    }.items():
        out[name] = str(folder / f"{name}.json")
        status, text = run_cli(*args, "--traces", traces, "--out", out[name], "--quiet")
        assert status == 0, text
    doc = load(out["torch"])
    rollout = str(folder / "rollout.jsonl")
    with open(rollout, "w") as f:
        for q, r in zip(requests, doc["requests"], strict=True):
            line = {
                "id": q.id,
                "prompt": list(q.prompt),
                "trace": list(q.trace),
                "logprobs": [x - SHIFT for x in r["logprobs"]],
            }
            f.write(json.dumps(line) + "\n")
    out["rollout"] = rollout
    return out


def test_rollout_against_decode_and_score(tmp_path, files):
    report = str(tmp_path / "r.json")
    status, text = run_cli("compare", files["rollout"], files["torch"], files["torch-score"], "--report", report,
                           "--plot", str(tmp_path / "p.png"))  # fmt: skip
    assert status == 0, text
    doc = load(report)
    assert [s["name"] for s in doc["sources"]] == ["rollout", "torch", "torch-score"]
    assert [s["view"] for s in doc["sources"]] == ["rollout", "decode", "teacher-forced"]
    assert doc["summary"]["frameworks"] == ["rollout", "torch"] and len(doc["pairs"]) == 1
    assert doc["pairs"][0]["summary"]["frameworks"] == ["rollout", "torch-score"]
    rl = doc["summary"]["rl_metrics"]
    x = SHIFT  # trainer (torch decode) minus rollout, at every token
    assert rl["verl/rollout_corr/kl"] == pytest.approx(-x, abs=1e-6)
    assert rl["verl/rollout_corr/k3_kl"] == pytest.approx(np.exp(x) - x - 1, abs=1e-6)
    assert rl["slime/train/train_rollout_logprob_abs_diff"] == pytest.approx(x, abs=1e-6)
    assert doc["summary"]["argmax_compared"] is False and doc["summary"]["argmax_mismatches"] == 0
    score_rl = doc["pairs"][0]["summary"]["rl_metrics"]
    assert score_rl["verl/rollout_corr/kl"] == pytest.approx(-x, abs=2e-5)  # score within 1e-5 of decode
    assert "k3_kl" in text and "rollout vs torch-score: 5 requests" in text, text
    # the RL table: one label per column (no spaces), each over its own measure, by hand
    want = {"k3_kl": np.exp(x) - x - 1, "kl": -x, "log_ppl_abs_diff": x, "ppl_ratio": np.exp(-x),
            "chi2_token": np.exp(2 * x) - 1, "mismatch_kl_max": np.exp(x) - x - 1, "logprob_abs_diff": x}  # fmt: skip
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("pair "))
    assert lines[head].split() == ["pair", *want], lines[head]
    starts = [m.start() for m in re.finditer(r"\S+", lines[head])] + [None]
    for line, pair in zip(lines[head + 1 : head + 3], ("rollout vs torch", "rollout vs torch-score"), strict=True):
        cells = [line[a:b].strip() for a, b in zip(starts[:-1], starts[1:])]
        assert cells[0] == pair, line
        for (label, value), cell in zip(want.items(), cells[1:], strict=True):
            assert float(cell) == pytest.approx(value, rel=2e-3), (label, line)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_two_run_outputs_compare_as_the_frameworks_do(tmp_path, files):
    by_files, by_runs = str(tmp_path / "f.json"), str(tmp_path / "r.json")
    status, text = run_cli(
        "compare", files["torch"], files["jax"], "--report", by_files, "--plot", str(tmp_path / "a.png")
    )
    assert status == 0, text
    status, text = run_cli(
        "compare", "--traces", files["traces"], "--report", by_runs, "--plot", str(tmp_path / "b.png")
    )
    assert status == 0, text
    a, b = load(by_files), load(by_runs)
    assert a["summary"]["frameworks"] == b["summary"]["frameworks"] == ["torch", "jax"]
    for key in ("k3", "max_abs_logprob_diff", "argmax_mismatches", "rank_changes", "rl_metrics"):
        assert a["summary"][key] == b["summary"][key], key


def test_gates_on_rl_measures(tmp_path, files, capsys):
    args = ["compare", files["rollout"], files["torch"], "--out-dir", str(tmp_path / "o")]
    status, _ = run_cli(*args, "--fail-above", "verl/rollout_corr/k3_kl=0.01", "--fail-above", "k3=1")
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("trace-replay compare: 1 pairs fail --fail-above verl/rollout_corr/k3_kl=0.01"), err
    status, _ = run_cli(*args, "--fail-above", "verl/rollout_corr/k3_kl=0.1")
    assert status == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "compare needs at least two sources (got 1)"),
        (["--fail-above", "verl/no_such=1"], "--fail-above verl/no_such: give a per-request measure"),
        (["--fail-above", "nonsense=1"], "--fail-above nonsense: give a per-request measure"),
        (["--run", "torch,torch"], "--run torch,torch: give frameworks among torch, jax"),
    ],
)
def test_refusals_write_nothing(tmp_path, files, capsys, extra, message):
    status, _ = run_cli("compare", files["rollout"], *([] if not extra else [files["torch"]]), "--out-dir",
                        str(tmp_path / "o"), *extra)  # fmt: skip
    assert status == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _processed(files, d):
    """The rollout with every line saying its logprobs are processed."""
    with open(files["rollout"]) as src, open(d / "processed.jsonl", "w") as dst:
        for line in src:
            dst.write(json.dumps(dict(json.loads(line), logprobs_mode="processed_logprobs")) + "\n")
    return str(d / "processed.jsonl")


def _first_lines(path, d, n):
    (d / "part.jsonl").write_text("".join(open(path).readlines()[:n]))
    return str(d / "part.jsonl")


def _untraced(files, d):
    (d / "free.jsonl").write_text(open(files["traces"]).read() + '{"id": "free", "prompt": [1], "max_new_tokens": 2}\n')
    return str(d / "free.jsonl")


# id -> (arguments from (files, work folder), the one line on stderr after "trace-replay compare: error: ")
REFUSED_BEFORE_RUNS = {
    "one_source": (lambda f, d: ["--traces", f["traces"], "--run", "torch"],
                   "compare needs at least two sources (got 1): add files, --run or --score"),
    "score_untraced": (lambda f, d: ["--traces", _untraced(f, d), "--run", "torch", "--score", "jax"],
                       "--score needs each request's completion; no trace in free"),
    "modes_differ": (lambda f, d: [_processed(f, d), "--run", "torch"],
                     "the sources' logprobs are of different kinds: rollout processed_logprobs, torch raw_logprobs "
                     "(--logprobs-mode sets the runs')"),
    "missing_request": (lambda f, d: [_first_lines(f["rollout"], d, 4), "--traces", f["traces"], "--run", "torch"],
                        "source rollout ({d}/part.jsonl) has no result for request 'r4'"),
    "unknown_rl_key": (lambda f, d: [f["rollout"], "--run", "torch", "--fail-above", "verl/no_such=1"],
                       "--fail-above verl/no_such: give a per-request measure"),
}  # fmt: skip


NO_RUN = "has no effect here (compare runs no model without --run or --score)"
REFUSED_BEFORE_RUNS.update({
    "device_without_runs": (lambda f, d: [f["rollout"], f["torch"], "--device", "cuda"], "--device cuda: " + NO_RUN),
    "dtype_without_runs": (lambda f, d: [f["rollout"], f["torch"], "--dtype", "bfloat16"],
                           "--dtype bfloat16: " + NO_RUN),
    "temperature_without_runs": (lambda f, d: [f["rollout"], f["torch"], "--temperature", "0.5"],
                                 "--temperature 0.5: " + NO_RUN),
    "max_batch_without_run": (lambda f, d: [f["rollout"], "--score", "torch", "--max-batch", "4"],
                              "--max-batch 4: has no effect here (only --run decodes in slots)"),
    "sampling_seed_without_run": (lambda f, d: [f["rollout"], "--score", "torch", "--sampling-seed", "3"],
                                  "--sampling-seed 3: has no effect here (only --run samples, at --temperature "
                                  "above 0)"),
    "temperature_with_raw_score": (lambda f, d: [f["rollout"], "--score", "torch", "--temperature", "0.5"],
                                   "--temperature 0.5: has no effect here (--score takes no temperature for "
                                   "raw_logprobs)"),
    "mode_against_files": (lambda f, d: [f["rollout"], f["torch"], "--logprobs-mode", "processed_logprobs"],
                           "--logprobs-mode processed_logprobs: the files' logprobs are of another kind: torch "
                           "raw_logprobs"),
})  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED_BEFORE_RUNS))
def test_refused_before_the_runs(tmp_path, files, capsys, monkeypatch, case):
    """Refusals of compare exit 2 before the weights are read and any run is made (they came
    after the decode runs), naming what is at fault; nothing is written."""
    make, message = REFUSED_BEFORE_RUNS[case]
    monkeypatch.setenv("TRACE_REPLAY_TEST_STAGES", "1")
    status, text = run_cli("compare", *make(files, tmp_path), "--out-dir", str(tmp_path / "o"))
    err = capsys.readouterr().err
    assert status == 2 and text == "", err
    assert err.splitlines()[-1].startswith("trace-replay compare: error: " + message.format(d=tmp_path)), err
    assert "stage load" not in err and not (tmp_path / "o").exists()


def test_an_explicit_logprobs_mode_checks_the_files(tmp_path, files):
    args = ["compare", files["rollout"], files["torch"], "--logprobs-mode", "raw_logprobs"]
    assert run_cli(*args, "--out-dir", str(tmp_path / "o"))[0] == 0


def test_logprobs_of_different_kinds_are_refused(tmp_path, files, capsys):
    """A rollout that says its logprobs are processed against a raw run: exit 2, nothing written."""
    processed = str(tmp_path / "processed.jsonl")
    with open(files["rollout"]) as src, open(processed, "w") as dst:
        for line in src:
            dst.write(json.dumps(dict(json.loads(line), logprobs_mode="processed_logprobs")) + "\n")
    status, _ = run_cli("compare", processed, files["torch"], "--out-dir", str(tmp_path / "o"))
    err = capsys.readouterr().err
    assert (
        status == 2
        and "the sources' logprobs are of different kinds: rollout processed_logprobs, torch raw_logprobs" in err
    )
    assert not (tmp_path / "o").exists()


def _output(rows: list[bytes]) -> bytes:
    """An output of run as run writes it, requests from line 3 on, with these rows as bytes."""
    head = b'{"summary": {"framework": "torch", "logprobs_mode": "raw_logprobs"},\n"requests": [\n'
    return head + b",\n".join(rows) + b"\n]}\n"


ROW = b'{"id": "a", "traced": true, "prompt_len": 1, "tokens": [2], "forced": [true], "logprobs": [%s], ' \
    b'"ranks": [1], "argmax": [2]}'  # fmt: skip
GOOD = ROW % b"-1.0"
# id -> (the file's bytes, line, field or None, message)
BAD_SOURCES = {
    "rollout_not_utf8": (b'{"id": "a", "prompt": [1], "trace": [2], "logprobs": [-1.0], "x": "\xff"}\n', 1, None,
                         "not UTF-8 (byte 0xff at column 68)"),
    "output_not_utf8": (_output([GOOD, b'{"id": "\xff"}']), 4, None, "not UTF-8 (byte 0xff at column 9)"),
    "output_nested_deeply": (_output([GOOD, b"[" * 100_000 + b"]" * 100_000]), 4, None,
                             "not valid JSON here (nested too deeply to read)"),
    "one_line_nested_deeply": (b'{"summary": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", 1, None,
                               "not valid JSON here (nested too deeply to read)"),
    "output_integer_too_long": (_output([b'{"id": "a", "tokens": [' + b"7" * 5000 + b"]}"]), 3, None,
                                "not valid JSON here (Exceeds the limit (4300 digits) for integer string conversion"),
    "output_truncated": (_output([GOOD, GOOD])[:-12], 4, None, "not valid JSON (Unterminated string"),
    "output_trailing_comma": (_output([GOOD, b""]), 5, None, "not valid JSON (Expecting value at column 1)"),
    "logprob_integer_beyond_float": (_output([ROW % (b"-" + b"9" * 400)]), 3, "requests.logprobs",
                                     "request 1 ('a'): entry 0 is too large to be a logprob (-9999999999"),
    "logprob_positive": (_output([GOOD, ROW.replace(b'"a"', b'"b"') % b"0.5"]), 4, "requests.logprobs",
                         "request 2 ('b'): entry 0 is 0.5, above 0 (a logprob is at most 0)"),
    "logprob_infinite": (_output([ROW % b"-Infinity"]), 3, "requests.logprobs",
                         "request 1 ('a'): entry 0 is infinite (-inf)"),
    "logprob_not_a_number": (_output([ROW % b'"-1"']), 3, "requests.logprobs",
                             "request 1 ('a'): entry 0 must be a number (got '-1')"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_hostile_sources_exit_2_naming_file_line_and_field(tmp_path, files, capsys, case):
    data, line, field, message = BAD_SOURCES[case]
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    status, text = run_cli("compare", str(path), files["torch"], "--out-dir", str(tmp_path / "o"))
    err = capsys.readouterr().err
    where = f"{path}, line {line}" + (f', field "{field}"' if field else "")
    assert status == 2 and text == "" and err.startswith(f"trace-replay compare: error: {where}: {message}"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_json_lines_file_is_told_from_its_first_line(tmp_path, monkeypatch):
    """Whether a file is an output document is decided from its first line: a JSON Lines
    rollout is not read whole for it (its second line here is 4 MiB)."""
    from trace_replay_app import sources, traces

    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": [1], "trace": [2]}\n{"x": "' + b"y" * 2**22 + b'"}\n')
    read = []

    class Counted(io.FileIO):
        def readinto(self, buffer):
            n = super().readinto(buffer)
            read.append(n or 0)
            return n

    for module in (sources, traces):  # every read of the file counted (traces.text_lines reads its lines)
        monkeypatch.setattr(module, "open", lambda p, mode="rb": io.BufferedReader(Counted(p, "rb")), raising=False)
    assert sources.is_output_document(str(path)) is False
    assert 0 < sum(read) < 2**20, sum(read)
    one_line = tmp_path / "o.json"  # an output written on one line is still one
    one_line.write_text(json.dumps({"summary": {"framework": "torch"}, "requests": []}) + "\n")
    assert sources.is_output_document(str(one_line)) is True


def _row(rid, traced, tokens, prompt_len=1):
    n = len(tokens)
    return json.dumps({"id": rid, "traced": traced, "prompt_len": prompt_len, "tokens": tokens, "forced": [traced] * n,
                       "logprobs": [-1.0] * n, "ranks": [1] * n, "argmax": tokens}).encode()  # fmt: skip


def test_output_files_keep_which_requests_were_traced(tmp_path, capsys):
    """Two outputs of run alone: request a traced, b decoded freely into different tokens. The
    report counts one traced request and b as an untraced divergence (every request counted as
    traced before)."""
    x, y = tmp_path / "x.json", tmp_path / "y.json"
    x.write_bytes(_output([_row("a", True, [2, 3]), _row("b", False, [4, 5])]))
    y.write_bytes(_output([_row("a", True, [2, 3]), _row("b", False, [4, 6])]))
    report = tmp_path / "r.json"
    status, text = run_cli("compare", str(x), str(y), "--report", str(report), "--plot", str(tmp_path / "p.png"))
    assert status == 0, capsys.readouterr().err
    doc = load(report)
    s = doc["summary"]
    assert [r["traced"] for r in doc["requests"]] == [True, False] and s["traced_requests"] == 1
    assert (s["untraced_requests_with_token_divergence"], s["traced_requests_with_token_divergence"]) == (1, 0)
    assert "1 untraced requests decoded different tokens" in text and "traced requests hold" not in text, text


def _file(d, name, data: bytes):
    (d / name).write_bytes(data)
    return str(d / name)


ROLLOUT_A = b'{"id": "a", "prompt": [1, 2], "trace": [3, 4], "logprobs": [-1.0, -1.0]}\n'
# id -> (arguments from the work folder, the message after "trace-replay compare: error: ")
DIFFERENT_REQUESTS = {
    "prompt_lengths": (
        lambda d: [_file(d, "x.json", _output([_row("a", True, [3, 4], 2)])),
                   _file(d, "y.json", _output([_row("a", True, [3, 4], 3)]))],
        "request 'a': the prompts differ between torch ({d}/x.json) and torch ({d}/y.json) (2 and 3 tokens)"),
    "traced_tokens": (
        lambda d: [_file(d, "x.json", _output([_row("a", True, [3, 4], 2)])),
                   _file(d, "y.json", _output([_row("a", True, [3, 5], 2)]))],
        "request 'a': the tokens differ between torch ({d}/x.json) and torch ({d}/y.json) (token 1: 4 and 5)"),
    "prompt_ids_against_traces": (
        lambda d: [_file(d, "r.jsonl", ROLLOUT_A), _file(d, "x.json", _output([_row("a", True, [3, 4], 2)])),
                   "--traces", _file(d, "t.jsonl", b'{"id": "a", "prompt": [1, 5], "trace": [3, 4]}\n')],
        "request 'a': the prompts differ between --traces {d}/t.jsonl and rollout ({d}/r.jsonl) (token 1: 5 and 2)"),
    "rollout_against_output": (
        lambda d: [_file(d, "r.jsonl", ROLLOUT_A), _file(d, "x.json", _output([_row("a", True, [3, 5], 2)]))],
        "request 'a': the tokens differ between rollout ({d}/r.jsonl) and torch ({d}/x.json) (token 1: 4 and 5)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DIFFERENT_REQUESTS))
def test_sources_of_different_requests_are_refused(tmp_path, capsys, case):
    """Sources that describe a request differently (prompt, or the tokens two of them give) are
    not the same requests: exit 2 naming the request, both sources and what differs (a traced
    request's tokens that differed were reported as an untraced divergence, with exit 0)."""
    make, message = DIFFERENT_REQUESTS[case]
    status, _ = run_cli("compare", *make(tmp_path), "--out-dir", str(tmp_path / "o"))
    err = capsys.readouterr().err
    assert status == 2 and err == f"trace-replay compare: error: {message.format(d=tmp_path)}\n", err
    assert not (tmp_path / "o").exists()


COMPLETIONS = json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x", "logprobs": {
    "tokens": ["token_id:4", "token_id:5"], "token_logprobs": [-1.0, -2.0]}}]}).encode() + b"\n"  # fmt: skip
VLLM_OFFLINE = (
    json.dumps(
        {
            "request_id": "c",
            "prompt_token_ids": [1, 2, 3],
            "outputs": [
                {"index": 0, "token_ids": [4, 5], "logprobs": [{"4": {"logprob": -1.1}}, {"5": {"logprob": -2.1}}]}
            ],
        }
    ).encode()
    + b"\n"
)


@pytest.mark.parametrize(
    "names, message",
    [
        (["comp.jsonl", "vo.jsonl"], None),
        (["vo.jsonl", "comp.jsonl"], None),
        (["vo.jsonl", "vo.jsonl"], "--requests {d}/req.jsonl: the request bodies of an openai-completions file, "
         "and none of {d}/vo.jsonl, {d}/vo.jsonl is one"),
        (["comp.jsonl", "comp2.jsonl"], "--requests {d}/req.jsonl: goes with one openai-completions file, and "
         "{d}/comp.jsonl and {d}/comp2.jsonl are both"),
    ],
)  # fmt: skip
def test_requests_go_with_the_completions_file(tmp_path, capsys, names, message):
    """--requests holds the request bodies of the one openai-completions file among compare's
    files; the others are read without them (a completions file beside a vLLM one was refused)."""
    for name, data in (("comp.jsonl", COMPLETIONS), ("comp2.jsonl", COMPLETIONS), ("vo.jsonl", VLLM_OFFLINE)):
        _file(tmp_path, name, data)
    _file(tmp_path, "req.jsonl", b'{"prompt": [1, 2, 3]}\n')
    report = tmp_path / "r.json"
    paths = [str(tmp_path / n) for n in names]
    args = ["compare", *paths, "--requests", str(tmp_path / "req.jsonl"), "--report", str(report)]
    status, _ = run_cli(*args, "--plot", str(tmp_path / "p.png"))
    err = capsys.readouterr().err
    if message is None:
        assert status == 0, err
        rows = load(report)["requests"]
        assert [(r["id"], r["compared_positions"]) for r in rows] == [("c/0", 2)]
        assert rows[0]["max_abs_logprob_diff"] == pytest.approx(0.1)
    else:
        assert status == 2 and err == f"trace-replay compare: error: {message.format(d=tmp_path)}\n", err
        assert not report.exists()
