#!/usr/bin/env bash
# Create or update .venv/ with everything megatron_like needs (torch 2.13.0 CPU build, the compiled
# csrc/ kernels, test tools). Idempotent: returns in a second when .venv is already current.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
STAMP=.venv/.megatron_like-setup
# Everything that changes what gets installed or compiled (the CUDA twins too: a CUDA machine builds them).
fingerprint=$(cat pyproject.toml setup.py scripts/setup.sh csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh 2>/dev/null | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] && [ -x .venv/bin/python ]; then
    exit 0
fi

echo "setting up .venv (torch 2.13.0 CPU, csrc kernels, test tools)..." >&2
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch is pinned: an unpinned torch would pull a several-GB CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" setuptools wheel "pybind11>=2.12"
# --no-build-isolation: build csrc/ against the pybind11 just installed instead of fetching a fresh copy.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test]"
echo "$fingerprint" > "$STAMP"
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')" >&2
