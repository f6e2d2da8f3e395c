#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a Debian machine with Python 3.11:
# virtualenv + packages, PostgreSQL server binaries, rsync and Prometheus (Debian packages) when
# missing, the style checks (ruff check, ruff format --check), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
# --fast (first argument): the tiers without a Ray cluster only (tests/unit, tests/inprocess,
# tests/integration), for the inner loop, on two pytest-xdist workers that each take a module at
# a time; no arguments: the whole suite, as CI runs it, in one process. TEST_WORKERS sets the
# worker count (0: pytest's own process). The whole suite stays in one process: its e2e tier is
# CPU-bound, and run beside anything else on two cores its judged latencies go to seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
TIERS=()
WORKERS=${TEST_WORKERS:-0}
if [ "${1:-}" = "--fast" ]; then
    shift
    TIERS=(tests/unit tests/inprocess tests/integration)
    WORKERS=${TEST_WORKERS:-2}
fi
bash scripts/setup.sh

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "installing PostgreSQL server binaries (Debian package 'postgresql')" >&2
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi

if ! command -v rsync >/dev/null; then
    # The cluster launcher syncs files with rsync; its test runs the very same command.
    echo "installing rsync (Debian package 'rsync')" >&2
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends rsync >/dev/null
fi

if [ ! -x /usr/bin/prometheus ]; then
    echo "installing the Prometheus server (Debian package 'prometheus')" >&2
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    # The package's postinst starts a daemon on :9090 (invoke-rc.d for /etc/init.d/prometheus,
    # deb-systemd-invoke under systemd); the tests start their own server. Both helpers ask
    # /usr/sbin/policy-rc.d first, and its exit status 101 forbids the start. Containers usually
    # have one; where there is none, one is put in place for this install only. Afterwards the
    # service is disabled at boot (the postinst enables it), so no daemon comes up later.
    POLICY_RC=/usr/sbin/policy-rc.d
    OWN_POLICY_RC=""
    if [ ! -e "$POLICY_RC" ]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY_RC" >/dev/null
        $SUDO chmod 755 "$POLICY_RC"
        OWN_POLICY_RC=1
        trap '$SUDO rm -f "$POLICY_RC"' EXIT
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
    if [ -n "$OWN_POLICY_RC" ]; then
        $SUDO rm -f "$POLICY_RC"
        trap - EXIT
    fi
fi

# The style the code promises, checked before any test runs: lint rules and formatting.
.venv/bin/ruff check .
.venv/bin/ruff format --check .

export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider -n "$WORKERS" --dist loadfile "${TIERS[@]}" "$@"
