"""The ``trace-replay`` command line end to end with ``--device cuda`` (GPU tier)."""

import os
import re

import numpy as np
import pytest
from helpers.cli_helpers import child, load, sentinel, sha256
from helpers.cli_helpers import main as run_cli

from trace_replay_app.checkpoint import save_checkpoint
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
from trace_replay_app.runner import CliError, check_framework_device
from trace_replay_app.traces import random_requests, read_traces, write_traces

pytestmark = pytest.mark.gpu

CONFIG = GPT2Config()
# cuBLAS and XLA's GPU matmuls sum in different orders (both at full float32 precision: no TF32;
# the command line computes in bfloat16 on a GPU unless told --dtype float32, as these tests do)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("traces") / "traces.jsonl")
    write_traces(path, random_requests(CONFIG, 64, seed=21, traced=0.75, prompt_len=(1, 40), new_tokens=(1, 48)))
    return path


def test_demo_on_cuda():
    status, text = run_cli("demo", "--device", "cuda", "--quiet")
    assert status == 0, text
    assert text.rstrip().endswith("all checks passed") and "FAILED" not in text


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_run_on_cuda_reproduces_and_matches_cpu(tmp_path, trace_file, framework):
    docs = {}
    for device in ("cuda", "cpu"):
        out = str(tmp_path / f"{device}.json")
        status, text = run_cli(
            "run",
            "--framework",
            framework,
            "--traces",
            trace_file,
            "--out",
            out,
            "--device",
            device,
            "--dtype",
            "float32",
            "--quiet",
        )
        assert status == 0, text
        docs[device] = load(out)
    s = docs["cuda"]["summary"]
    assert s["device"] == "cuda" and s["exact_reproductions"] == s["traced_requests"] == 48
    for q, a, b in zip(read_traces(trace_file), docs["cuda"]["requests"], docs["cpu"]["requests"], strict=True):
        if q.trace is not None:
            assert a["tokens"] == b["tokens"] == list(q.trace) and all(a["forced"])
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=TOLERANCE, err_msg=q.id)


def test_compare_on_cuda(tmp_path, trace_file):
    status, text = run_cli(
        "compare", "--traces", trace_file, "--out-dir", str(tmp_path), "--device", "cuda", "--dtype", "float32"
    )
    assert status == 0, text
    report = load(tmp_path / "compare_report.json")
    assert (tmp_path / "compare_divergence.png").read_bytes()[:4] == b"\x89PNG"
    s = report["summary"]
    assert s["device"] == "cuda" and s["max_abs_logprob_diff"] <= TOLERANCE
    assert s["runs"]["torch"]["exact_reproductions"] == s["runs"]["jax"]["exact_reproductions"] == 48


def test_checkpoint_on_cuda_in_both_frameworks(tmp_path):
    small = GPT2Config(vocab_size=96, n_positions=40, n_embd=16, n_layer=2, n_head=2)
    save_checkpoint(
        str(tmp_path / "ckpt"),
        small,
        seeded_weights(small, 2),
        dtype="BF16",
        prefix="transformer.",
        tied_lm_head=True,
        mask_buffers=True,
    )
    traces = str(tmp_path / "t.jsonl")
    write_traces(traces, random_requests(small, 12, seed=4, prompt_len=(1, 12), new_tokens=(1, 12)))
    docs = {}
    for fw in ("torch", "jax"):
        out = str(tmp_path / f"{fw}.json")
        status, text = run_cli(
            "run",
            "--framework",
            fw,
            "--traces",
            traces,
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--out",
            out,
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--quiet",
        )
        assert status == 0, text
        docs[fw] = load(out)
        assert docs[fw]["summary"]["exact_reproductions"] == 12
    for a, b in zip(docs["torch"]["requests"], docs["jax"]["requests"], strict=True):
        assert a["tokens"] == b["tokens"]
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_run_on_cuda_defaults_to_bfloat16_and_samples_reproducibly(tmp_path, trace_file, framework):
    """Without --dtype a GPU run computes in bfloat16 (and still replays every trace); two runs
    with the same --sampling-seed give the same output."""
    docs = []
    for i in range(2):
        out = str(tmp_path / f"{i}.json")
        status, text = run_cli(
            "run",
            "--framework",
            framework,
            "--traces",
            trace_file,
            "--out",
            out,
            "--device",
            "cuda",
            "--temperature",
            "0.8",
            "--sampling-seed",
            "3",
            "--quiet",
        )
        assert status == 0, text
        docs.append(load(out))
    s = docs[0]["summary"]
    assert s["dtype"] == "bfloat16" and s["exact_reproductions"] == s["traced_requests"] == 48
    assert s["logprobs"] == "raw logits (before temperature)"
    assert docs[0]["requests"] == docs[1]["requests"]


def test_each_framework_is_asked_about_the_device_before_any_work(tmp_path, trace_file):
    """Both frameworks see cuda here; a device they do not see, or JAX limited to its CPU
    backend, exits 2 in one line naming the framework, before anything ran or was written."""
    for fw in ("torch", "jax"):
        check_framework_device(fw, "cuda")
        with pytest.raises(CliError, match=rf"^--device cuda:99: {fw} \S+ .*CUDA devices \[0.*\]"):
            check_framework_device(fw, "cuda:99")
    env = {"JAX_PLATFORMS": "cpu"}
    got = child("demo", "--device", "cuda", cwd=tmp_path, env=env)
    assert got.status == 2 and got.out == "", got
    assert re.match(
        r"^trace-replay demo: error: --device cuda: jax \S+ sees no CUDA device \(check the driver, "
        r"CUDA_VISIBLE_DEVICES and JAX_PLATFORMS\); or use --device cpu$",
        got.error_line(),
    )
    out = tmp_path / "o.json"
    digest = sentinel(out)
    got = child(
        "run",
        "--framework",
        "jax",
        "--traces",
        trace_file,
        "--device",
        "cuda",
        "--out",
        str(out),
        cwd=tmp_path,
        env=env,
    )
    assert got.status == 2 and sha256(out) == digest and "jax" in got.error_line()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_ctrl_c_during_a_cuda_decode_exits_130(tmp_path, trace_file, framework):
    """Ctrl-C while a CUDA decode runs (in JAX the interrupt can arrive inside a buffer
    callback, wrapped as an INTERNAL error): 130, one line, the output untouched; three tries."""
    out = tmp_path / "o.json"
    digest = sentinel(out)
    for _ in range(3):
        args = ("--framework", framework, "--traces", trace_file, "--device", "cuda", "--max-batch", "2")
        got = child("run", *args, "--out", str(out), cwd=tmp_path, interrupt_at=f"{framework}-decode")
        assert got.status == 130, got
        assert got.error_line() == "trace-replay run: interrupted" and sha256(out) == digest
        assert os.listdir(tmp_path) == ["o.json"]


def test_max_batch_far_beyond_the_requests_runs_on_cuda(tmp_path):
    traces = str(tmp_path / "t.jsonl")
    write_traces(traces, random_requests(CONFIG, 4, seed=5))
    out = str(tmp_path / "o.json")
    for framework in ("torch", "jax"):
        args = ("--framework", framework, "--traces", traces, "--out", out, "--device", "cuda", "--quiet")
        status, text = run_cli("run", *args, "--max-batch", "100000000000")
        assert status == 0, text
        assert load(out)["summary"]["exact_reproductions"] == 4
