#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the project and its dependencies.
# torch is pinned first: on a CPU machine whose pip finds the CPU wheel (these machines), that
# one; from PyPI on a GPU node, the CUDA build. An unpinned torch could pull any build.
# EXTRAS: the optional dependency groups (default "dev", the test tools; cluster nodes set it
# empty). The install stamp covers pyproject.toml and EXTRAS, so a change of either reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS-dev}
if [ -n "${PYTHON:-}" ]; then
    # Asked for by name (a cluster's setup): that one or nothing.
    PY=$PYTHON
    command -v "$PY" >/dev/null || { echo "setup: $PY not found" >&2; exit 1; }
else
    PY=python3.11
    command -v "$PY" >/dev/null || PY=python3
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.installed-$( (cat pyproject.toml; echo "extras=$EXTRAS") | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet "torch==2.13.0"
    .venv/bin/pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
    rm -f .venv/.installed-*
    touch "$stamp"
fi
