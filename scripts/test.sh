#!/usr/bin/env bash
# Set up .venv if needed, then lint and run the whole test suite (unit, distributed on gloo, CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# One thread per process: the distributed tests start up to 4 processes on a 2-core machine.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -q "$@"
