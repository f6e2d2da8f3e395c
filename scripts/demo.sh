#!/usr/bin/env bash
# The main job, from a fresh clone on a Debian machine with Python 3.11: sets up .venv, then
# runs `rollout demo` (local Ray + Serve, SQLite registry, local artifact store, a full
# rollout of ranker-v42 under load, promotion, rollback to ranker-v41, summary + timeline).
# Extra arguments go to `rollout demo` (e.g. --rate 60, --workdir /tmp/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rollout demo "$@"
