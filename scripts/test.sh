#!/usr/bin/env bash
# Set up .venv if needed, then lint and run the whole test suite (unit, distributed on gloo, CLI).
# MEGATRON_LIKE_ISA=avx2 (or scalar) runs it all as on a CPU without AVX-512 (without AVX2): our kernels
# and PyTorch's own dispatch take that path (scripts/isa_env.sh, docs/kernels.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/isa_env.sh
bash scripts/setup.sh
.venv/bin/ruff check .
# A forced path this CPU lacks stops here with a one-line error; otherwise print the paths taken.
.venv/bin/python -m megatron_like.kernels
# One thread per process: the distributed tests start up to 4 processes on a 2-core machine.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -q "$@"
