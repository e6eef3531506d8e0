"""``python -m helpers.ctrl_c_child CASE ARGS...``: ``python -m trace_replay_app ARGS...`` with the
gpt2 family's decode loop replaced by one that sends the process a real SIGINT, at a moment that
a real Ctrl-C reaches only now and then (CASE):

- ``exec``: the ``KeyboardInterrupt`` passes through code run by ``exec`` of a string, as when
  the Ctrl-C lands while a dataclass or a named tuple is being defined (thousands of times while
  torch is imported);
- ``unraisable``: the ``KeyboardInterrupt`` is raised in a ``__del__`` (as in an import's weakref
  callbacks), where Python cannot raise it, and the framework goes on;
- ``twice``: a second SIGINT arrives while the command reports the first;
- ``after``: a second SIGINT arrives after :func:`trace_replay_app.cli.main` returned.

It runs as ``python -m`` (CPython's exit status then depends on how a ``KeyboardInterrupt`` went),
and the command's ``__main__`` module runs as that does."""

import os
import runpy
import signal
import sys
import time

from trace_replay_app import cli
from trace_replay_app.models import get_family


def _sigint_and_wait() -> None:
    """SIGINT to this process, then 0.2 s in which its Python handler runs (whichever thread the
    signal reaches, the main thread runs the handler between two short sleeps)."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(20):
        time.sleep(0.01)


class _SigintWhenDeleted:
    def __del__(self):
        _sigint_and_wait()


def _loop(case):
    def loop(config, weights, requests, **kw):
        kw["on_step"](1)
        if case == "exec":
            exec("from helpers.ctrl_c_child import _sigint_and_wait\n_sigint_and_wait()")
        elif case == "unraisable":
            _SigintWhenDeleted()  # deleted at once
            kw["on_step"](1)
            raise RuntimeError("the framework went on after the interrupt")
        else:
            _sigint_and_wait()
        raise AssertionError("the SIGINT did not interrupt the loop")

    return loop


class _SigintWhenReported:
    """stderr, sending a second SIGINT once the command has written that it was interrupted."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        if "interrupted" in text:
            _sigint_and_wait()
        return n

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _main_then_sigint(main):
    def wrapped(*args, **kwargs):
        status = main(*args, **kwargs)
        _sigint_and_wait()
        return status

    return wrapped


if __name__ == "__main__":
    case = sys.argv.pop(1)
    assert case in ("exec", "unraisable", "twice", "after"), case
    get_family("gpt2").load_loop = lambda framework: _loop(case)
    if case == "twice":
        sys.stderr = _SigintWhenReported(sys.stderr)
    elif case == "after":
        cli.main = _main_then_sigint(cli.main)
    runpy.run_module("trace_replay_app", run_name="__main__", alter_sys=True)
