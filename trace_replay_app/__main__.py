"""``python -m trace_replay_app``: the ``trace-replay`` command line (see :mod:`trace_replay_app.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
