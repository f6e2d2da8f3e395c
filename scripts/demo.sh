#!/usr/bin/env bash
# The main job, from a fresh clone on a Debian machine with Python 3.11.
# Until `rollout demo` (the rollout under load) lands, this runs what exists end to end:
# write the demo artifacts, then verify + strictly load + dry-run each one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ROLLOUT=.venv/bin/rollout
if $ROLLOUT demo --help >/dev/null 2>&1; then
    exec $ROLLOUT demo "$@"
fi
echo "rollout demo is not available yet: packing and verifying the demo artifacts instead" >&2
mkdir -p var
rm -rf var/demo-artifacts
$ROLLOUT make-demo-artifacts var/demo-artifacts | tee var/demo-artifacts.jsonl
while read -r line; do
    uri=$(printf '%s' "$line" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["manifest_uri"])')
    sha=$(printf '%s' "$line" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["manifest_sha256"])')
    $ROLLOUT verify "$uri" --sha256 "$sha" --cache var/cache --load
done < var/demo-artifacts.jsonl
