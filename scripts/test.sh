#!/usr/bin/env bash
# Set everything up, then run the test suite. Without a GPU the GPU tier is skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
