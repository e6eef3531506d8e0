"""Hostile invocations of ``trace-replay``, each run as a child process as a user would: every
refusal exits 2 with one line on stderr and no traceback, before any work, and leaves the output
path as it was (the sha256 of a sentinel file placed there); Ctrl-C at several moments exits 130
in both frameworks and writes nothing; non-finite results are reported, never formatted into a
crash. Then random malformed trace files and checkpoint configs, in process: exit 0 or 2, never
an exception."""

import importlib.util
import json
import os
import re
import shutil
import tempfile

import numpy as np
import pytest
from helpers.cli_helpers import child, load, main, sentinel, sha256
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trace_replay_app.checkpoint import save_checkpoint
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
from trace_replay_app.traces import random_requests, write_traces

CONFIG = GPT2Config()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Read-only inputs: a small trace file (4 requests), a longer one (a decode worth
    interrupting), a good checkpoint, one holding a NaN weight, and one whose finite weights
    overflow to NaN logprobs."""
    d = tmp_path_factory.mktemp("inputs")
    write_traces(str(d / "t.jsonl"), random_requests(CONFIG, 4, seed=0, traced=0.5, new_tokens=(4, 12)))
    write_traces(
        str(d / "long.jsonl"),
        random_requests(CONFIG, 16, seed=1, traced=0.5, prompt_len=(1, 8), new_tokens=(60, 100)),
    )
    weights = seeded_weights(CONFIG, 0)
    save_checkpoint(str(d / "good"), CONFIG, weights)
    nan = dict(weights, **{"wte.weight": weights["wte.weight"].copy()})
    nan["wte.weight"][3, 5] = np.nan
    save_checkpoint(str(d / "nan"), CONFIG, nan)
    huge = dict(weights, **{k: np.full_like(weights[k], 3e38) for k in ("ln_f.weight", "ln_f.bias")})
    save_checkpoint(str(d / "huge"), CONFIG, huge)
    return d


def _copy(src, dst):
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    return str(dst)


def _bad_traces(d):
    lines = ['{"id": "a", "prompt": [1], "trace": [2]}', '{"id": "b", "prompt": [3], "trace": [4]}']
    (d / "bad.jsonl").write_text("\n".join([*lines, '{"id": "c", "prompt": [], "trace": [5]}']) + "\n")
    return str(d / "bad.jsonl")


def _bert(d, inputs):
    folder = _copy(inputs / "good", d / "bert")
    hf = load(os.path.join(folder, "config.json"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(hf, model_type="bert"), f)
    return folder


def _completions(d, requests_name="req.jsonl"):
    """An openai-completions response without prompt ids, and its request body (``requests_name``)."""
    choice = {"index": 0, "text": "x", "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-1.0]}}
    (d / "comp.jsonl").write_text(json.dumps({"id": "c", "object": "text_completion", "choices": [choice]}) + "\n")
    (d / requests_name).write_text('{"prompt": [1, 2, 3]}\n')
    return ["--traces", str(d / "comp.jsonl"), "--requests", str(d / requests_name)]


RUN = ("run", "--framework", "torch", "--quiet")
# id -> (arguments from (work folder d, inputs), the output whose bytes must not change, stderr pattern)
REFUSED = {
    "out_is_traces": (
        lambda d, i: [*RUN, "--traces", _copy(i / "t.jsonl", d / "o"), "--out", str(d / "o")],
        "o",
        r"--out .*o: is the --traces file \(the output would replace the input\)",
    ),
    "out_is_requests": (
        lambda d, i: [*RUN, *_completions(d, "o"), "--out", str(d / "o")],
        "o",
        r"--out .*o: is the --requests file \(the output would replace the input\)",
    ),
    "report_is_plot": (
        lambda d, i: ["compare", "--traces", str(i / "t.jsonl"), "--report", str(d / "o"), "--plot", str(d / "o")],
        "o",
        r"--plot .*o: is also the --report path \(one output would replace the other\)",
    ),
    "out_dir_with_report": (
        lambda d, i: ["compare", "--traces", str(i / "t.jsonl"), "--out-dir", str(d), "--report", str(d / "o")],
        "o",
        r"--out-dir .*: give --out-dir or --report, not both",
    ),
    "out_dir_with_plot": (
        lambda d, i: ["compare", "--traces", str(i / "t.jsonl"), "--out-dir", str(d), "--plot", str(d / "o")],
        "o",
        r"--out-dir .*: give --out-dir or --plot, not both",
    ),
    "out_is_checkpoint_weights": (
        lambda d, i: [
            *RUN,
            "--traces",
            str(i / "t.jsonl"),
            "--checkpoint",
            _copy(i / "good", d / "ck"),
            "--out",
            str(d / "ck" / "model.safetensors"),
        ],
        "ck/model.safetensors",
        r"--out .*ck/model\.safetensors: is the --checkpoint file",
    ),
    "report_is_checkpoint_config": (
        lambda d, i: [
            "compare",
            "--traces",
            str(i / "t.jsonl"),
            "--checkpoint",
            _copy(i / "good", d / "ck"),
            "--report",
            str(d / "ck" / "config.json"),
            "--plot",
            str(d / "p.png"),
        ],
        "ck/config.json",
        r"--report .*ck/config\.json: is the --checkpoint file",
    ),
    "nan_weight": (
        lambda d, i: [*RUN, "--traces", str(i / "t.jsonl"), "--checkpoint", str(i / "nan"), "--out", str(d / "o")],
        "o",
        r".*nan/model\.safetensors: tensor 'wte\.weight': value nan at index \[3, 5\] is not finite$",
    ),
    "malformed_traces": (
        lambda d, i: [*RUN, "--traces", _bad_traces(d), "--out", str(d / "o")],
        "o",
        r'.*bad\.jsonl, line 3, field "prompt": must not be empty$',
    ),
    "out_folder_missing": (
        lambda d, i: [*RUN, "--traces", str(i / "t.jsonl"), "--out", str(d / "no" / "o")],
        None,
        r"--out .*no/o: folder .*no does not exist$",
    ),
    "unsupported_model_type": (
        lambda d, i: [*RUN, "--traces", str(i / "t.jsonl"), "--checkpoint", _bert(d, i), "--out", str(d / "o")],
        "o",
        r".*config\.json: model_type 'bert' is not supported \(supported: gpt2, ",
    ),
    "torch_without_cuda": (
        lambda d, i: [*RUN, "--traces", str(i / "t.jsonl"), "--device", "cuda", "--out", str(d / "o")],
        "o",
        r"--device cuda: torch \S+ sees no CUDA device \(its CPU build is installed; install its CUDA build: "
        r"pip uninstall -y torch && pip install 'torch==[0-9.]+'\); or use --device cpu$",
    ),
    "jax_without_cuda": (
        lambda d, i: [
            "run",
            "--framework",
            "jax",
            "--traces",
            str(i / "t.jsonl"),
            "--device",
            "cuda:0",
            "--out",
            str(d / "o"),
        ],
        "o",
        r"--device cuda:0: jax \S+ sees no CUDA device \(its CPU build is installed; install its CUDA build: "
        r"pip install 'jax\[cuda13\]==[0-9.]+'\); or use --device cpu$",
    ),
    "demo_without_cuda": (lambda d, i: ["demo", "--device", "cuda"], None, r"--device cuda: torch \S+ sees no CUDA"),
}
NEEDS_CPU_BUILD = {"torch_without_cuda": "torch", "jax_without_cuda": "jax", "demo_without_cuda": "torch"}


def _has_cuda_build(framework: str) -> bool:
    """Whether ``framework`` here is a CUDA build (asked without starting a GPU backend)."""
    if framework == "torch":
        import torch

        return torch.version.cuda is not None
    return any(importlib.util.find_spec(p) is not None for p in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_before_any_work(tmp_path, inputs, case):
    make, output, pattern = REFUSED[case]
    if case in NEEDS_CPU_BUILD and _has_cuda_build(NEEDS_CPU_BUILD[case]):
        pytest.skip(f"{NEEDS_CPU_BUILD[case]} here is a CUDA build")
    args = make(tmp_path, inputs)
    digest = None
    if output is not None:
        target = tmp_path / output
        digest = sha256(target) if target.exists() else sentinel(target)
    before = sorted(os.listdir(tmp_path))
    got = child(*args, cwd=tmp_path)
    assert got.status == 2, got
    assert re.match(rf"^trace-replay {args[0]}: error: {pattern}", got.error_line()), got.err
    assert got.out == "" and sorted(os.listdir(tmp_path)) == before
    if digest is not None:
        assert sha256(tmp_path / output) == digest


def test_usage_errors_exit_2_without_a_traceback(tmp_path, inputs):
    got = child(*RUN, "--traces", str(inputs / "t.jsonl"), "--out", "o", "--device", "tpu", cwd=tmp_path)
    assert got.status == 2 and "Traceback" not in got.err and not os.listdir(tmp_path)
    assert (
        got.err.splitlines()[-1]
        == "trace-replay run: error: argument --device: must be cpu, cuda or cuda:N (got 'tpu')"
    )


def test_max_batch_beyond_the_requests_uses_one_slot_per_request(tmp_path, inputs):
    """4 requests and --max-batch 10**11: slots follow the work (a child capped at 6 GiB of
    address space would fail to size 10**11 slots)."""
    out = tmp_path / "o.json"
    args = ("--traces", str(inputs / "t.jsonl"), "--out", str(out), "--max-batch", "100000000000")
    got = child(*RUN, *args, cwd=tmp_path, memory_limit=6 * 2**30)
    assert got.status == 0 and got.err == "", got.err
    summary = load(out)["summary"]
    assert summary["max_batch"] == 10**11 and summary["slots"] == 4  # the option, and the slots it took
    assert summary["exact_reproductions"] == summary["traced_requests"] == 2


def test_non_finite_logprobs_are_reported_not_formatted(tmp_path, inputs):
    out = tmp_path / "o.json"
    got = child(
        *RUN[:3],
        "--traces",
        str(inputs / "t.jsonl"),
        "--checkpoint",
        str(inputs / "huge"),
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert got.status == 1, got
    assert re.match(
        r"^trace-replay run: \d+ logprobs are not finite \(written as null\) in 4 requests: r0, r1, r2, r3$",
        got.error_line(),
    )
    assert "mean logprob n/a" in got.out
    doc = load(out)
    tokens = sum(len(r["tokens"]) for r in doc["requests"])
    assert doc["summary"]["non_finite_logprobs"] == tokens == sum(r["logprobs"].count(None) for r in doc["requests"])
    assert doc["summary"]["requests_with_non_finite_logprobs"] == ["r0", "r1", "r2", "r3"]


def test_max_k3_fails_requests_it_cannot_measure(tmp_path, inputs):
    args = ("--traces", str(inputs / "t.jsonl"), "--checkpoint", str(inputs / "huge"), "--max-k3", "0.1")
    got = child("compare", *args, "--out-dir", str(tmp_path / "c"), "--quiet", cwd=tmp_path)
    assert got.status == 1 and "Traceback" not in got.err, got.err
    lines = got.err.splitlines()
    assert lines[0] == "trace-replay compare: 4 requests have non-finite logprobs: r0, r1, r2, r3"
    assert re.match(
        r"^trace-replay compare: 4 requests fail --max-k3 0\.1 \(k3 KL estimate above it or missing\): "
        r"r0 \(\d+ non-finite logprobs\), r1 .*, r3 \(\d+ non-finite logprobs\)$",
        lines[1],
    ), lines
    assert len(lines) == 2 and load(tmp_path / "c" / "compare_report.json")["summary"]["k3"] is None


# Ctrl-C ------------------------------------------------------------------------------------------------
INTERRUPTS = {
    "run_torch_at_start": (["run", "--framework", "torch"], "start"),
    "run_torch_loading": (["run", "--framework", "torch"], "load"),
    "run_torch_decoding": (["run", "--framework", "torch"], "torch-decode"),
    "run_jax_importing": (["run", "--framework", "jax"], "jax-import"),
    "run_jax_decoding": (["run", "--framework", "jax"], "jax-decode"),
    "compare_decoding": (["compare"], "torch-decode"),
    "demo_decoding": (["demo"], "torch-decode"),
}


@pytest.mark.parametrize("case", sorted(INTERRUPTS))
def test_ctrl_c_exits_130_and_writes_nothing(tmp_path, inputs, case):
    command, stage = INTERRUPTS[case]
    out = tmp_path / "o.json"
    digest = sentinel(out)
    args = [*command]
    if command[0] == "run":
        args += ["--traces", str(inputs / "long.jsonl"), "--out", str(out), "--max-batch", "2"]
    elif command[0] == "compare":
        args += ["--traces", str(inputs / "long.jsonl"), "--report", str(out), "--plot", str(tmp_path / "p.png")]
    got = child(*args, cwd=tmp_path, interrupt_at=stage)
    assert got.status == 130, got
    assert got.error_line() == f"trace-replay {command[0]}: interrupted" and got.out == ""
    assert sha256(out) == digest and os.listdir(tmp_path) == ["o.json"]


@pytest.mark.parametrize("case", ["exec", "unraisable", "twice", "after"])
def test_ctrl_c_exits_130_at_rare_moments(tmp_path, inputs, case):
    """Moments a real Ctrl-C reaches only now and then, made certain by a loop that sends the
    SIGINT itself (helpers/ctrl_c_child.py): the ``KeyboardInterrupt`` passing through code run
    by ``exec`` of a string (CPython would end ``python -m`` by SIGINT), or raised where Python
    cannot raise it (it would print "Exception ignored"), a second SIGINT while the command
    reports the first, and one after the command returned."""
    out = tmp_path / "o.json"
    digest = sentinel(out)
    args = (case, *RUN, "--traces", str(inputs / "t.jsonl"), "--out", str(out))
    got = child(*args, cwd=tmp_path, module="helpers.ctrl_c_child")
    assert got.status == 130, got
    assert got.error_line() == "trace-replay run: interrupted" and got.out == ""
    assert sha256(out) == digest and os.listdir(tmp_path) == ["o.json"]


# random malformed inputs, in process ----------------------------------------------------------------------
TOKEN = st.integers(-2, CONFIG.vocab_size + 1)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=8,
)
REQUEST = st.fixed_dictionaries(
    {"id": st.one_of(st.text(max_size=3), st.integers(-5, 5), JSON)},
    optional={
        "prompt": st.one_of(st.lists(TOKEN, max_size=6), JSON),
        "prompt_token_ids": st.lists(TOKEN, max_size=3),
        "trace": st.one_of(st.lists(TOKEN, max_size=6), st.none(), JSON),
        "max_new_tokens": st.one_of(st.integers(-1, 200), JSON),
    },
)
VALID = st.fixed_dictionaries(
    {"id": st.integers(0, 10**6), "prompt": st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=6)},
    optional={"trace": st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=6)},
).map(lambda r: r if "trace" in r else dict(r, max_new_tokens=3))
LINE = st.one_of(
    VALID.map(json.dumps),
    VALID.map(json.dumps),
    REQUEST.map(json.dumps),
    JSON.map(json.dumps),
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")),
    st.just(""),
)


def _status_of(capsys, *args) -> int:
    status, _ = main(*args, "--quiet")
    err = capsys.readouterr().err
    assert status in (0, 2), err
    event(f"exit {status}")
    if status == 2:
        assert len(err.splitlines()) == 1 and err.startswith("trace-replay run: error: "), err
    return status


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, min_size=0, max_size=4))
def test_random_trace_files_exit_0_or_2(capsys, lines):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.jsonl")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write("\n".join(lines) + "\n")
        _status_of(capsys, *RUN[:3], "--traces", path, "--out", os.path.join(d, "o.json"), "--max-batch", "2")


CONFIG_KEYS = ["model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon"]
CONFIG_KEYS += ["activation_function", "n_inner", "tie_word_embeddings", "architectures"]
FIELD = st.one_of(st.integers(-3, 2**40), st.floats(allow_nan=False), st.text(max_size=6), st.none(), JSON)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), FIELD, max_size=3),
    dropped=st.sets(st.sampled_from(CONFIG_KEYS), max_size=2),
    raw=st.one_of(st.none(), st.binary(max_size=16)),
)
def test_random_checkpoint_configs_exit_0_or_2(capsys, inputs, changes, dropped, raw):
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "ck")
        os.mkdir(folder)
        os.link(inputs / "good" / "model.safetensors", os.path.join(folder, "model.safetensors"))
        hf = {k: v for k, v in {**load(inputs / "good" / "config.json"), **changes}.items() if k not in dropped}
        with open(os.path.join(folder, "config.json"), "wb") as f:
            f.write(raw if raw is not None else json.dumps(hf).encode())
        traces = str(inputs / "t.jsonl")
        _status_of(capsys, *RUN[:3], "--traces", traces, "--checkpoint", folder, "--out", os.path.join(d, "o.json"))
