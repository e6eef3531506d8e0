"""A pytest plugin for parity tests of a user's own models; inert in a session that does not use it.

Registered through the ``pytest11`` entry point ``trace_replay_app.pytest_plugin`` (installed
with the package); from a source tree that was not installed, load it with
``pytest -p trace_replay_app.pytest_plugin``. Importing it imports pytest and the standard
library only (no torch, no JAX, not the rest of this package); it adds no collection hook
that touches a test which does not ask for its fixtures, so a project that installs the
package without using them collects the same tests as before.

Fixtures:

- ``trace_set``: a :class:`trace_replay_app.trace_sets.TraceSet`. A test that asks for it
  runs once per kind: ``random``, ``ties`` and ``long`` (seeded with ``--trace-replay-seed``,
  default 0), and ``file`` when ``--trace-replay-traces FILE`` is given. Draw its requests
  for a model with ``trace_set.requests(vocab_size, n_positions)``. A test that parametrizes
  ``trace_set`` itself (``@pytest.mark.parametrize("trace_set", ["random"], indirect=True)``)
  keeps its own kinds.
- ``trace_replay_seed``: the ``--trace-replay-seed`` value.
- ``trace_replay_report_dir``: the ``--trace-replay-report-dir`` folder (a ``pathlib.Path``),
  or ``None``.

On failure: when a test fails with a :class:`trace_replay_app.parity.ParityError` and
``--trace-replay-report-dir DIR`` is given, its report (the message, the failing requests,
the tolerance and the full comparison report) is written to ``DIR/<test id>.json`` and the
path is added to the test's report.

Example (a test module of the user's)::

    from trace_replay_app.parity import assert_parity, run_parity

    def test_port_matches(trace_set):
        requests = trace_set.requests(vocab_size=96, n_positions=64)
        run = run_parity(torch_model, jax_model, jax_params, requests)
        assert_parity(run.a, run.b, requests=run.requests, dtype="float32")
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Any

import pytest

__all__ = [
    "pytest_addoption",
    "pytest_generate_tests",
    "pytest_runtest_makereport",
    "trace_set",
    "trace_replay_seed",
    "trace_replay_report_dir",
]

_KINDS = ("random", "ties", "long")  # trace_replay_app.trace_sets.KINDS, without importing it


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("trace-replay", "parity tests of your own models (trace_replay_app.pytest_plugin)")
    group.addoption(
        "--trace-replay-traces",
        metavar="FILE",
        default=None,
        help="a trace file (JSON Lines): tests that use the trace_set fixture also run on its requests",
    )
    group.addoption(
        "--trace-replay-report-dir",
        metavar="DIR",
        default=None,
        help="write the report of each parity failure (ParityError) to DIR/<test id>.json",
    )
    group.addoption(
        "--trace-replay-seed",
        metavar="N",
        type=int,
        default=0,
        help="seed of the trace_set fixture's random, ties and long sets (default 0)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``trace_set`` over the kinds, for the tests that ask for it and do not
    parametrize it themselves."""
    if "trace_set" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if "trace_set" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return
    kinds = list(_KINDS)
    if metafunc.config.getoption("trace_replay_traces"):
        kinds.append("file")
    metafunc.parametrize("trace_set", kinds, indirect=True)


@pytest.fixture
def trace_replay_seed(request: pytest.FixtureRequest) -> int:
    """The seed of the seeded trace sets (``--trace-replay-seed``, default 0)."""
    return int(request.config.getoption("trace_replay_seed"))


@pytest.fixture
def trace_replay_report_dir(request: pytest.FixtureRequest) -> pathlib.Path | None:
    """The folder parity failures are reported to (``--trace-replay-report-dir``), or ``None``."""
    folder = request.config.getoption("trace_replay_report_dir")
    return None if folder is None else pathlib.Path(folder)


@pytest.fixture
def trace_set(request: pytest.FixtureRequest, trace_replay_seed: int) -> Any:
    """A :class:`~trace_replay_app.trace_sets.TraceSet` of the kind this test runs with (see
    the module docstring); ``file`` skips when no ``--trace-replay-traces`` was given."""
    from trace_replay_app.trace_sets import TraceSet

    kind = getattr(request, "param", "random")
    if kind == "file":
        path = request.config.getoption("trace_replay_traces")
        if not path:
            pytest.skip("no --trace-replay-traces FILE was given")
        return TraceSet("file", trace_replay_seed, path=str(path))
    return TraceSet(kind, trace_replay_seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failure carrying a parity report is written to ``--trace-replay-report-dir``."""
    report = yield
    folder = item.config.getoption("trace_replay_report_dir")
    exc = call.excinfo.value if call.excinfo is not None else None
    parity_report = getattr(exc, "parity_report", None)
    if folder and parity_report is not None:
        path = _write_report(pathlib.Path(folder), item.nodeid, exc, parity_report)
        report.sections.append(("trace-replay", f"parity report written to {path}"))
    return report


def _write_report(folder: pathlib.Path, nodeid: str, exc: Any, parity_report: dict) -> pathlib.Path:
    """``DIR/<test id>.json``: the message, failing requests, tolerance and full report."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") + ".json")
    tolerance = getattr(exc, "tolerance", None)
    body = {
        "test": nodeid,
        "message": str(exc),
        "failures": getattr(exc, "failures", None),
        "tolerance": None if tolerance is None or isinstance(tolerance, type) else dataclasses.asdict(tolerance),
        "report": parity_report,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path
