"""The parity example (``examples/parity``) runs on the CPU tier as a user runs it: its CPU cases
pass (the port agrees with the model on every trace set; the planted rotary-base bug is caught
at the position it acts from). Its cases marked ``gpu`` are left to
``test_gpu_parity_example.py``."""

from __future__ import annotations

from helpers.example_runs import run_example

CPU_CASES = {
    "test_port_matches_the_model[random-cpu-float32]",
    "test_port_matches_the_model[ties-cpu-float32]",
    "test_port_matches_the_model[long-cpu-float32]",
    "test_planted_rotary_bug_is_caught[cpu-float32]",
    "test_planted_rotary_bug_is_caught[cpu-bfloat16]",
}


def test_the_parity_example_passes_on_the_cpu(tmp_path):
    proc, outcomes = run_example(tmp_path / "junit.xml", "-m", "not gpu")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert outcomes == dict.fromkeys(CPU_CASES, ("passed", "")), outcomes
