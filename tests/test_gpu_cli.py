"""The ``trace-replay`` command line end to end with ``--device cuda`` (GPU tier)."""

import numpy as np
import pytest
from helpers.cli_helpers import load
from helpers.cli_helpers import main as run_cli

from trace_replay_app.checkpoint import save_checkpoint
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
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
