"""trace-replay's pytest plugin (``trace_replay_app.pytest_plugin``), run in child pytest sessions.

- Inert: a session on a small test file that uses none of its fixtures collects the same test
  ids with and without the plugin (loaded with ``-p``, or through a ``pytest11`` entry point as
  an installed package declares it), and the plugin imports neither torch nor JAX (nor the
  parity modules) there: the child session writes what ``sys.modules`` holds when it ends.
- Its fixtures: ``trace_set`` runs a test once per kind (``file`` too with
  ``--trace-replay-traces``), a test may choose its own kinds, the seed comes from
  ``--trace-replay-seed``; a ``ParityError`` is written to ``--trace-replay-report-dir``.
- The entry point is declared in ``pyproject.toml``; the installed metadata carries it once the
  package is reinstalled.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import trace_replay_app

ROOT = pathlib.Path(trace_replay_app.__file__).resolve().parents[1]
PLUGIN = "trace_replay_app.pytest_plugin"
WATCHED = ("torch", "jax", "jaxlib", PLUGIN, "trace_replay_app.trace_sets", "trace_replay_app.parity")

PLAIN_TESTS = """
import pytest

@pytest.mark.parametrize("x", [1, 2, 3])
def test_numbers(x):
    assert x > 0

def test_plain(tmp_path):
    assert tmp_path.exists()

class TestGroup:
    def test_member(self):
        pass
"""

MODULES_CONFTEST = f"""
import json, os, sys

def pytest_sessionfinish(session):
    with open(os.environ["WATCHED_OUT"], "w") as f:
        json.dump({{m: m in sys.modules for m in {WATCHED!r}}}, f)
"""

FIXTURE_TESTS = """
import pytest

def test_sets(trace_set, trace_replay_seed):
    requests = trace_set.requests(50, 40)
    assert requests and all(len(r.prompt) + r.new_tokens <= 40 for r in requests)
    assert trace_set.kind == "file" or trace_set.seed == trace_replay_seed
    print("FIRST", trace_set.kind, requests[0].prompt)

@pytest.mark.parametrize("trace_set", ["ties"], indirect=True)
def test_chosen(trace_set, trace_replay_report_dir):
    assert trace_set.kind == "ties" and trace_replay_report_dir is None
"""

FAILING_TESTS = """
import numpy as np
from trace_replay_app import RequestResult
from trace_replay_app.parity import assert_parity

def _result(logprobs):
    n = len(logprobs)
    tokens, forced, ranks = np.arange(n), np.ones(n, bool), np.ones(n, int)
    return RequestResult("r0", tokens, forced, np.array(logprobs, np.float32), ranks, tokens)

def test_ports_disagree():
    assert_parity([_result([-1.0, -2.0, -3.0])], [_result([-1.0, -2.5, -3.0])], dtype="float32")

def test_other_failure():
    assert 1 == 2
"""


def _entry_point_dist(folder: pathlib.Path) -> pathlib.Path:
    """A folder holding a distribution's metadata that declares the plugin's ``pytest11`` entry
    point as ``pyproject.toml`` does: on a child's path, pytest loads the plugin through it."""
    name, value = _declared_entry_point()
    info = folder / "trace_replay_plugin_check-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trace-replay-plugin-check\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[pytest11]\n{name} = {value}\n")
    return folder


def _declared_entry_point() -> tuple[str, str]:
    """The one ``[project.entry-points.pytest11]`` entry of ``pyproject.toml``."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.entry-points\.pytest11\]\n((?:[^\[\n].*\n)*)", text, re.M)
    assert section, "pyproject.toml declares no [project.entry-points.pytest11]"
    entries = re.findall(r'^"?([\w.]+)"?\s*=\s*"([\w.:]+)"', section.group(1), re.M)
    assert len(entries) == 1, entries
    return entries[0]


def _run(folder: pathlib.Path, files: dict[str, str], *args: str, extra_path: pathlib.Path | None = None):
    """A child pytest session in a new ``folder`` on ``files`` (``extra_path`` first on its
    path): ``(completed process, which watched modules were loaded at its end, {test name:
    outcome})``."""
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "conftest.py").write_text(MODULES_CONFTEST)
    out = folder / "watched.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    paths = ([str(extra_path)] if extra_path else []) + [str(ROOT), str(ROOT / "adapters")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["WATCHED_OUT"] = str(out)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={folder / 'junit.xml'}", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = {}
    if (folder / "junit.xml").exists():
        for case in ET.parse(folder / "junit.xml").getroot().iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return proc, json.loads(out.read_text()) if out.exists() else None, outcomes


def _ids(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_plugin_is_inert_where_its_fixtures_are_not_used(tmp_path):
    files = {"test_plain.py": PLAIN_TESTS}
    # without: the entry point disabled by its name (the package may be installed with it)
    without, seen_without, _ = _run(tmp_path / "without", files, "--collect-only", "-p", f"no:{PLUGIN}")
    with_p, seen_with, _ = _run(tmp_path / "with", files, "--collect-only", "-p", PLUGIN)
    dist = _entry_point_dist(tmp_path / "dist")
    entry, seen_entry, _ = _run(tmp_path / "ep", files, "--collect-only", extra_path=dist)
    for proc in (without, with_p, entry):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_ids(without)) == 5 and _ids(with_p) == _ids(without) and _ids(entry) == _ids(without)
    assert seen_without == {m: False for m in WATCHED}, seen_without
    loaded = {m: m == PLUGIN for m in WATCHED}
    assert seen_with == loaded and seen_entry == loaded, (seen_with, seen_entry)
    ran, seen_ran, _ = _run(tmp_path / "run", files, "-p", PLUGIN, extra_path=dist)  # loaded both ways at once
    assert ran.returncode == 0 and "5 passed" in ran.stdout, ran.stdout + ran.stderr
    assert seen_ran == loaded


def test_trace_set_runs_once_per_kind_and_from_a_file(tmp_path):
    traces = tmp_path / "traces.jsonl"
    traces.write_text(
        '{"id": "a", "prompt": [1, 2], "trace": [3, 4, 5]}\n{"id": "b", "prompt": [6], "max_new_tokens": 4}\n'
    )
    files = {"test_sets.py": FIXTURE_TESTS}
    proc, seen, outcomes = _run(tmp_path / "plain", files, "-p", PLUGIN, "-s", "--trace-replay-seed", "7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = ["test_sets[random]", "test_sets[ties]", "test_sets[long]", "test_chosen[ties]"]
    assert outcomes == dict.fromkeys(kinds, "passed"), outcomes
    assert seen["trace_replay_app.trace_sets"] and not seen["torch"] and not seen["jax"]
    args = ("-p", PLUGIN, "-s", "--trace-replay-seed", "7", "--trace-replay-traces", str(traces))
    again, _, outcomes = _run(tmp_path / "file", files, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert outcomes == dict.fromkeys([*kinds, "test_sets[file]"], "passed"), outcomes
    assert "FIRST file (1, 2)" in again.stdout
    firsts = re.findall(r"FIRST (random|ties|long) (\(.*?\))", proc.stdout)
    assert len(firsts) == 3 and firsts == re.findall(r"FIRST (random|ties|long) (\(.*?\))", again.stdout)
    other, _, _ = _run(tmp_path / "seed8", files, "-p", PLUGIN, "-s", "--trace-replay-seed", "8")
    assert re.findall(r"FIRST random (\(.*?\))", other.stdout) != re.findall(r"FIRST random (\(.*?\))", proc.stdout)


def test_a_parity_failure_is_written_to_the_report_folder(tmp_path):
    reports = tmp_path / "reports"
    proc, _, _ = _run(
        tmp_path / "a", {"test_fail.py": FAILING_TESTS}, "-p", PLUGIN, "--trace-replay-report-dir", str(reports)
    )
    assert proc.returncode == 1 and "2 failed" in proc.stdout, proc.stdout + proc.stderr
    (written,) = reports.iterdir()
    assert written.name == "test_fail.py_test_ports_disagree.json"
    body = json.loads(written.read_text())
    assert body["test"] == "test_fail.py::test_ports_disagree"
    assert "request 'r0' (traced): first divergent position 1: |d| 0.5 > 5e-05" in body["message"]
    assert body["failures"][0]["first_divergent_position"] == 1 and body["tolerance"]["max_abs"] == 5e-5
    assert body["report"]["requests"][0]["logprob_diff"] == [0.0, -0.5, 0.0]
    assert f"parity report written to {written}" in proc.stdout
    quiet, _, _ = _run(tmp_path / "b", {"test_fail.py": FAILING_TESTS}, "-p", PLUGIN)
    assert quiet.returncode == 1 and "parity report written" not in quiet.stdout
    assert "first divergent position 1" in quiet.stdout


def test_the_entry_point_is_declared_and_installed():
    assert _declared_entry_point() == (PLUGIN, PLUGIN)  # named as the module: `-p` and the entry point agree
    try:
        installed = [
            ep for ep in importlib.metadata.distribution("trace-replay").entry_points if ep.group == "pytest11"
        ]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("trace-replay is not installed (run from a source tree)")
    if not installed:
        pytest.skip("the installed trace-replay predates its pytest11 entry point: reinstall it (pip install -e .)")
    assert [(ep.name, ep.value) for ep in installed] == [(PLUGIN, PLUGIN)]
