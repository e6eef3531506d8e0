"""JAX states on the default device and arguments on another device: ``tests/jax_device_cases.py``
on 2 CPU host devices, in a process of its own (this process's JAX has one CPU device, as every
other test expects; JAX reads ``--xla_force_host_platform_device_count`` once, at start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("jax_device_cases.py")


def test_device_cases_on_2_cpu_host_devices(rng):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["TRACE_REPLAY_TEST_SEED"] = str(int(rng.integers(2**32)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(CASES)],
        cwd=CASES.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    assert proc.returncode == 0, f"device cases failed (rc={proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
