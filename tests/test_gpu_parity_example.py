"""GPU tier: the parity example (``examples/parity``) on CUDA, in float32 and bfloat16: the port
agrees with the model on every trace set (the torch decode step captured in a CUDA graph), and
the planted rotary-base bug is caught in both dtypes. Skipped without a GPU."""

from __future__ import annotations

import pytest
from helpers.example_runs import run_example

pytestmark = pytest.mark.gpu

GPU_CASES = {
    f"test_port_matches_the_model[{kind}-cuda-{dtype}]"
    for kind in ("random", "ties", "long")
    for dtype in ("float32", "bfloat16")
} | {f"test_planted_rotary_bug_is_caught[cuda-{dtype}]" for dtype in ("float32", "bfloat16")}


def test_the_parity_example_passes_on_cuda(tmp_path):
    proc, outcomes = run_example(
        tmp_path / "junit.xml", "-m", "gpu", "--trace-replay-report-dir", str(tmp_path / "reports")
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert outcomes == dict.fromkeys(GPU_CASES, ("passed", "")), outcomes
