"""Helpers shared by the command-line test modules."""

import io
import json

from trace_replay_app import cli


def load(path):
    """The JSON document at ``path``."""
    with open(path) as f:
        return json.load(f)


def main(*args):
    """Run ``trace-replay args...`` in this process; return (exit status, what it printed)."""
    out = io.StringIO()
    status = cli.main(list(args), out=out)
    return status, out.getvalue()
