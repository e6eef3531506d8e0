"""JAX meshes on 8 CPU host devices: ``tests/jax_mesh_cases.py`` in a process of its own.

JAX reads ``--xla_force_host_platform_device_count`` once, when it first starts, so the mesh
cases cannot run in this process (whose JAX has one CPU device, as every other test expects).
This test starts a fresh interpreter with the flag and ``JAX_PLATFORMS=cpu`` set in its
environment only, runs the cases there with this run's seed, and fails with their output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("jax_mesh_cases.py")


def test_mesh_cases_on_8_cpu_host_devices(rng):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["TRACE_REPLAY_TEST_SEED"] = str(int(rng.integers(2**32)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(CASES)],
        cwd=CASES.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    assert proc.returncode == 0, f"mesh cases failed (rc={proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
