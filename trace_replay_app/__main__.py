"""``python -m trace_replay_app``: the ``trace-replay`` command line (see :mod:`trace_replay_app.cli`)."""

from .cli import run

if __name__ == "__main__":
    run()
