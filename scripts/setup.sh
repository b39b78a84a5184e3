#!/usr/bin/env bash
# Create .venv and install mergepipe with its test dependencies.
# torch is installed first as the CPU build 2.13.0: an unpinned torch would pull a CUDA build
# of several GB. Set MERGEPIPE_TORCH to choose another torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
# The shared-catalog tests start a PostgreSQL server of their own (Debian's postgresql package).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "note: PostgreSQL not found; the shared-catalog tests need it (apt-get install postgresql)" >&2
    fi
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${MERGEPIPE_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[dev]"
