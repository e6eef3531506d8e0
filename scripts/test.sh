#!/usr/bin/env bash
# Set everything up, check lint, formatting and types (seconds), then run the test suite.
# Any finding stops the run before pytest starts. Without a GPU the GPU tier is skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for tool in ruff mypy; do
  if [ ! -x ".venv/bin/$tool" ]; then
    echo "scripts/test.sh: .venv/bin/$tool is missing; install the lint extra: .venv/bin/pip install -e '.[lint]'" >&2
    exit 2
  fi
done
echo "ruff check" && .venv/bin/ruff check .
echo "ruff format --check" && .venv/bin/ruff format --check .
echo "mypy" && .venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
