#!/usr/bin/env bash
# Create .venv and install mergepipe with its test dependencies.
# torch is installed first as the CPU build 2.13.0: an unpinned torch would pull a CUDA build
# of several GB. Set MERGEPIPE_TORCH to choose another torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${MERGEPIPE_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[dev]"
