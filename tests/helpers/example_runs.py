"""Run ``examples/parity`` as a user would (``pytest examples/parity``), in a child process.

Shared by ``test_examples.py`` (the CPU cases) and ``test_gpu_parity_example.py`` (the cases
marked ``gpu``). The child runs from the repository's root with the repository first on its
path, so it tests this tree whatever is installed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import trace_replay_app

ROOT = pathlib.Path(trace_replay_app.__file__).resolve().parents[1]
EXAMPLE = "examples/parity"


def run_example(junit: pathlib.Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    """``pytest examples/parity *args`` in a child: ``(completed process, {test id: (outcome,
    message)})``, outcome one of passed, failed, error, skipped (message: the reason)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters")] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", EXAMPLE, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    outcomes = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            found = [(c.tag, c.get("message", "")) for c in case if c.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = found[0] if found else ("passed", "")
    return proc, outcomes
