#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a Debian machine with Python 3.11:
# virtualenv + packages, PostgreSQL server binaries, rsync and Prometheus (Debian packages) when
# missing, the style checks (ruff check, ruff format --check), the documentation build (MkDocs,
# --strict: a broken link or anchor between pages, or a page missing from the nav, fails it;
# built into a temporary directory, so the checkout gets no site/), then pytest.
# --fast (first argument): the tiers without a Ray cluster only (tests/unit, tests/inprocess,
# tests/integration), for the inner loop. Every mode runs the style checks and the docs build
# first. No arguments: the whole suite, as CI runs it, in two
# pytest runs: those three tiers first, then tests/e2e, which gets the machine to itself (its
# tier is CPU-bound: run beside anything else on two cores its judged latencies go to
# seconds). The tiers without a cluster run on two pytest-xdist workers that each take a
# module at a time; TEST_WORKERS sets the count (0: pytest's own process). Other arguments:
# one pytest run of exactly what they name, in pytest's own process unless TEST_WORKERS says.
set -euo pipefail
cd "$(dirname "$0")/.."
NO_CLUSTER=(tests/unit tests/inprocess tests/integration)
MODE=whole
if [ "${1:-}" = "--fast" ]; then
    shift
    MODE=fast
elif [ $# -gt 0 ]; then
    MODE=args
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

# The documentation (docs/, mkdocs.yml) builds without a warning: --strict fails on a broken
# link or anchor and on a page missing from the nav. Built into a temporary directory, removed
# after, so the checkout gets no site/.
SITE_DIR=$(mktemp -d)
.venv/bin/mkdocs build --strict --site-dir "$SITE_DIR"
rm -rf "$SITE_DIR"

export PYTHONUNBUFFERED=1
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider --dist loadfile)
case "$MODE" in
fast) exec "${PYTEST[@]}" -n "${TEST_WORKERS:-2}" "${NO_CLUSTER[@]}" "$@" ;;
args) exec "${PYTEST[@]}" -n "${TEST_WORKERS:-0}" "$@" ;;
esac
# The whole suite: both runs go ahead whatever the first one's verdict (a red unit test must
# not hide an e2e failure); the exit status is the first failure's.
status=0
"${PYTEST[@]}" -n "${TEST_WORKERS:-2}" "${NO_CLUSTER[@]}" || status=$?
"${PYTEST[@]}" -n 0 tests/e2e || { rc=$?; [ "$status" != 0 ] || status=$rc; }
exit "$status"
