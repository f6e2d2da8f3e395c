#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the project and its dependencies.
# torch is pinned to the CPU wheel first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet "torch==2.13.0"
    .venv/bin/pip install --quiet -e ".[dev]"
    rm -f .venv/.installed-*
    touch "$stamp"
fi
