#!/usr/bin/env bash
# Set everything up, then run `trace-replay demo` (CPU by default; pass --device cuda on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/trace-replay demo "$@"
