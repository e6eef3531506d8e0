"""``trace-replay score`` and rollout files through ``run``/``score``, end to end on the CPU.

``score`` writes ``run``'s format: the same tokens, logprobs within 1e-5 of ``run`` on the same
traced requests (float32, seeded GPT-2), ranks equal wherever ``run``'s logprobs are not near a
tie; a file of untraced requests is refused naming the request; an engine's rollout (vLLM's
offline ``RequestOutput`` JSON) is read by ``run`` and ``score`` alike.
"""

import json
import re

import numpy as np
import pytest
from helpers.cli_helpers import load
from helpers.cli_helpers import main as run_cli

from trace_replay_app.checkpoint import save_checkpoint
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
from trace_replay_app.traces import random_requests, write_traces

CONFIG = GPT2Config()


@pytest.fixture(scope="module")
def traced_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("traces") / "traced.jsonl")
    write_traces(path, random_requests(CONFIG, 6, seed=5, traced=1.0, prompt_len=(1, 12), new_tokens=(1, 10)))
    return path


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_score_matches_run(tmp_path, traced_file, framework):
    scored, decoded = str(tmp_path / "score.json"), str(tmp_path / "run.json")
    status, text = run_cli("score", "--framework", framework, "--traces", traced_file, "--out", scored,
                           "--max-tokens", "32", "--chunk-rows", "5")  # fmt: skip
    assert status == 0, text
    assert text.startswith(f"{framework} on cpu: scored ") and text.endswith(f"wrote {scored}\n"), text
    status, text = run_cli("run", "--framework", framework, "--traces", traced_file, "--out", decoded)
    assert status == 0, text
    a, b = load(scored), load(decoded)
    assert a["summary"]["view"] == "teacher-forced" and a["summary"]["chunk_rows"] == 5
    assert [r["id"] for r in a["requests"]] == [r["id"] for r in b["requests"]]
    for x, y in zip(a["requests"], b["requests"]):
        assert x["tokens"] == y["tokens"], x["id"]
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=1e-5, err_msg=x["id"])
        assert x["ranks"] == y["ranks"], x["id"]


def test_score_writes_top_k(tmp_path, traced_file):
    """``--top-k 3``: every scored token carries three ids and logprobs, most likely first, the
    first id the greedy token, its logprob at least the token's own; the summary records k."""
    out = str(tmp_path / "score.json")
    status, text = run_cli("score", "--framework", "torch", "--traces", traced_file, "--out", out, "--top-k", "3")
    assert status == 0, text
    doc = load(out)
    assert doc["summary"]["top_k"] == 3
    for r in doc["requests"]:
        ids, lps = r["topk_ids"], r["topk_logprobs"]
        assert len(ids) == len(lps) == len(r["tokens"]) and all(len(x) == 3 for x in ids + lps), r["id"]
        assert [x[0] for x in ids] == r["argmax"], r["id"]
        assert all(a >= b >= c for a, b, c in lps) and all(len(set(x)) == 3 for x in ids), r["id"]
        assert all(x[0] >= lp - 1e-6 for x, lp in zip(lps, r["logprobs"])), r["id"]
    plain = str(tmp_path / "plain.json")
    assert run_cli("score", "--framework", "torch", "--traces", traced_file, "--out", plain)[0] == 0
    assert all("topk_ids" not in r for r in load(plain)["requests"])


@pytest.mark.parametrize("value", ["-1", "x", "100000"])
def test_score_refuses_a_bad_top_k(tmp_path, traced_file, capsys, value):
    out = tmp_path / "o.json"
    with pytest.raises(SystemExit) as exc:
        run_cli("score", "--framework", "torch", "--traces", traced_file, "--out", str(out), "--top-k", value)
    assert exc.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert re.search(rf"argument --top-k: must be an integer from 0 to \d+ \(got '?{value}'?\)", err), err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--logprobs-mode", "processed_logprobs", "--temperature", "0"],
         "--temperature 0: processed_logprobs are the logprobs of logits / T: give T above 0"),
        (["--temperature", "0.7"], "--temperature 0.7: has no effect on raw_logprobs (the logits as they are; "
         "--logprobs-mode processed_logprobs takes logits / T)"),
        (["--top-k", "50", "--checkpoint", "{vocab32}"], "--top-k 50: above the model's vocabulary of 32 tokens"),
    ],
)  # fmt: skip
def test_score_refuses_options_before_loading_weights(tmp_path, capsys, monkeypatch, args, message):
    """Options the forward cannot honour exit 2 naming the option, before the weights are read
    (they ended in a ValueError traceback), and nothing is written."""
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    save_checkpoint(str(tmp_path / "ck"), config, seeded_weights(config, 0))
    traces = str(tmp_path / "t.jsonl")
    write_traces(traces, random_requests(config, 2, seed=0))
    monkeypatch.setenv("TRACE_REPLAY_TEST_STAGES", "1")
    args = [a.format(vocab32=tmp_path / "ck") for a in args]
    out = tmp_path / "o.json"
    status, text = run_cli("score", "--framework", "torch", "--traces", traces, "--out", str(out), *args)
    err = capsys.readouterr().err
    assert status == 2 and text == "" and f"trace-replay score: error: {message}\n" in err, err
    assert "stage load" not in err and not out.exists()


def test_score_out_may_not_replace_the_requests_file(tmp_path, capsys):
    choice = {"index": 0, "text": "x", "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-1.0]}}
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "c", "object": "text_completion", "choices": [choice]}) + "\n")
    bodies = tmp_path / "req.jsonl"
    bodies.write_text('{"prompt": [1, 2, 3]}\n')
    args = ["--traces", str(tmp_path / "c.jsonl"), "--requests", str(bodies), "--out", str(bodies)]
    status, _ = run_cli("score", "--framework", "torch", *args)
    err = capsys.readouterr().err
    assert (
        status == 2
        and err
        == f"trace-replay score: error: --out {bodies}: is the --requests file (the output would replace the input)\n"
    )
    assert bodies.read_text() == '{"prompt": [1, 2, 3]}\n'


def test_score_refuses_an_untraced_request(tmp_path, capsys):
    path = str(tmp_path / "t.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"id": "free", "prompt": [1, 2], "max_new_tokens": 3}) + "\n")
    status, text = run_cli("score", "--framework", "torch", "--traces", path, "--out", str(tmp_path / "o.json"))
    assert status == 2 and text == "", text
    assert (
        capsys.readouterr().err
        == f"trace-replay score: error: --traces {path}: score needs each request's completion; no trace in free\n"
    )
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("command", ["run", "score"])
def test_a_vllm_rollout_is_read(tmp_path, command):
    """Two outputs of one vLLM request (offline RequestOutput JSON) become two traced requests."""
    path = str(tmp_path / "rollout.jsonl")
    outputs = []
    for index, tokens in enumerate([[5, 6, 7], [8, 9]]):
        logprobs = [{str(t): {"logprob": -1.5 - k, "rank": 2, "decoded_token": None}} for k, t in enumerate(tokens)]
        outputs.append({"index": index, "token_ids": tokens, "logprobs": logprobs, "text": ""})
    with open(path, "w") as f:
        f.write(json.dumps({"request_id": "q", "prompt_token_ids": [1, 2, 3], "outputs": outputs}) + "\n")
    out = str(tmp_path / "o.json")
    args = ["--framework", "torch", "--traces", path, "--out", out, "--format", "vllm-offline"]
    status, text = run_cli(command, *args)
    assert status == 0, text
    doc = load(out)
    assert [(r["id"], r["tokens"]) for r in doc["requests"]] == [("q/0", [5, 6, 7]), ("q/1", [8, 9])]


def test_compare_report_holds_rl_metrics(tmp_path, traced_file):
    """The report's RL measures are those of its own logprobs: verl's kl is the token mean of
    rollout (torch) minus trainer (jax), prime-rl's mismatch_kl the mean of exp(x) - x - 1."""
    report = str(tmp_path / "r.json")
    status, text = run_cli("compare", "--traces", traced_file, "--report", report, "--plot", str(tmp_path / "p.png"))
    assert status == 0, text
    doc = load(report)
    a = np.concatenate([np.asarray(r["torch_logprobs"], np.float64) for r in doc["requests"]])
    b = np.concatenate([np.asarray(r["jax_logprobs"], np.float64) for r in doc["requests"]])
    rl = doc["summary"]["rl_metrics"]
    x = b - a
    assert rl["verl/rollout_corr/kl"] == pytest.approx(np.mean(-x), rel=1e-9, abs=1e-15)
    assert rl["prime_rl/mismatch_kl/all/mean"] == pytest.approx(np.mean(np.exp(x) - x - 1), rel=1e-6, abs=1e-18)
    assert all("rl_metrics" in r for r in doc["requests"])
