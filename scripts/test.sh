#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a Debian machine with Python 3.11:
# virtualenv + packages, PostgreSQL server binaries (Debian's package) when missing, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "installing PostgreSQL server binaries (Debian package 'postgresql')" >&2
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi

export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
