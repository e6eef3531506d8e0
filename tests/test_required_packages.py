"""A required package that does not import fails the test run (it is never a skip).

Each case runs pytest in a subprocess whose ``sitecustomize`` makes one package unimportable,
and checks that the run stops with a non-zero status and a message naming the package and how
to install it (``conftest.py``'s check).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

BLOCKER = textwrap.dedent(
    """
    import sys

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name == {name!r} or name.startswith({name!r} + "."):
                raise ModuleNotFoundError("No module named " + repr(name) + " (blocked by the test)")
            return None

    sys.meta_path.insert(0, _Blocker())
    """
)


@pytest.mark.parametrize("package", ["transformers", "cuda.bindings"])
def test_a_missing_dependency_fails_the_run_naming_it(package, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(name=package))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            str(TESTS / "test_threads.py"),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 5), out[-4000:]
    assert f"{package} does not import (ModuleNotFoundError: No module named '{package}" in out, out[-4000:]
    assert "pip install -e '.[torch,jax,test]'" in out, out[-4000:]
    assert "skipped" not in out, out[-4000:]
