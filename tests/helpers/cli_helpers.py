"""Helpers shared by the command-line test modules: in-process runs, child processes, sentinels."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time

from trace_replay_app import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGE = "trace-replay: stage "  # what the command says at each stage when TRACE_REPLAY_TEST_STAGES is set


def load(path):
    """The JSON document at ``path``."""
    with open(path) as f:
        return json.load(f)


def main(*args):
    """Run ``trace-replay args...`` in this process; return (exit status, what it printed)."""
    out = io.StringIO()
    status = cli.main(list(args), out=out)
    return status, out.getvalue()


def sentinel(path) -> str:
    """Write random bytes at ``path`` (a file an output must not replace); return their sha256."""
    data = os.urandom(64)
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclasses.dataclass
class Child:
    """A finished ``python -m trace_replay_app`` child: exit status, stdout, and stderr without
    the stage lines."""

    status: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one line of stderr (no traceback); fails the test otherwise."""
        assert "Traceback" not in self.err, self.err
        lines = self.err.splitlines()
        assert len(lines) == 1, self.err
        return lines[0]


def _env(stages: bool, extra: dict | None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "adapters"), env.get("PYTHONPATH", "")])
    env.pop("TRACE_REPLAY_TEST_STAGES", None)
    if stages:
        env["TRACE_REPLAY_TEST_STAGES"] = "1"
    return env


def _command(args, memory_limit: int | None) -> list[str]:
    if memory_limit is None:
        return [sys.executable, "-m", "trace_replay_app", *args]
    start = (  # the address-space cap set inside the child: no fork-time hook in this process
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({memory_limit}, {memory_limit})); "
        "sys.argv[0] = 'trace-replay'; runpy.run_module('trace_replay_app', run_name='__main__')"
    )
    return [sys.executable, "-c", start, *args]


def child(
    *args: str,
    cwd,
    interrupt_at: str | None = None,
    memory_limit: int | None = None,
    env: dict | None = None,
    timeout_s: float = 120,
) -> Child:
    """Run ``python -m trace_replay_app args...`` in ``cwd``; with ``interrupt_at``, send it
    SIGINT as soon as it says it reached that stage (fails if it ends first). ``memory_limit``
    caps its address space (bytes), so a run that would take the machine's memory fails instead;
    ``env``: variables set for it."""
    proc = subprocess.Popen(
        _command(args, memory_limit),
        cwd=cwd,
        env=_env(interrupt_at is not None, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and proc.stdout is not None
    err: list[str] = []
    deadline = time.monotonic() + timeout_s
    if interrupt_at is not None:
        for line in proc.stderr:  # the stage lines arrive flushed, one by one
            err.append(line)
            if line.strip() == STAGE + interrupt_at:
                proc.send_signal(signal.SIGINT)
                break
        else:
            raise AssertionError(f"the command ended before stage {interrupt_at!r}: {''.join(err)}")
    try:
        out, rest = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    err.append(rest)
    kept = "".join(line for line in "".join(err).splitlines(keepends=True) if not line.startswith(STAGE))
    return Child(proc.returncode, out, kept)
