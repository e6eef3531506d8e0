"""``python -m trace_replay_core``: the ``trace-replay`` command line (see
:mod:`trace_replay_core.app.cli`)."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
