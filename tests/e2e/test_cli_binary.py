"""The operator's commands as the installed `rollout` binary, against this cluster's running
controller: who gave each command and why lands in the rollout's events, and
`rollout status --watch` ends with the rollout's outcome as its exit code (CI gates on it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ray

from rollout.exit_codes import EXIT_ROLLOUT_ABORTED
from tests.e2e.harness import CANDIDATE, FAST_PLAN, RolloutEnv, failed

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
HANG_GUARD_S = 120


def test_operator_commands_record_who_and_why_and_watch_exits_with_the_outcome(
    rollout_env: RolloutEnv, tmp_path: Path
) -> None:
    env = rollout_env
    env.controller  # noqa: B018 - make sure it runs (the binary attaches to it)
    address = ray.get_runtime_context().gcs_address
    # The test cluster has token auth on (Ray's default for a new local cluster).
    child_env = {**os.environ, "RAY_AUTH_MODE": "token"}

    def rollout(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [ROLLOUT, *args, *(("--address", address) if args[0] != "history" else ())],
            cwd=tmp_path, capture_output=True,
            text=True, timeout=HANG_GUARD_S, check=False, env=child_env,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        return done

    run = env.traffic()
    started = env.start(CANDIDATE, {**FAST_PLAN, "gates": {"pause_before_steps": [50]}})
    env.wait_for_phase("paused", timeout=90)
    for args in (
        ("pause", "--reason", "hold for a look", "--actor", "alice"),
        ("resume", "--reason", "looked fine", "--actor", "bob"),
        ("abort", "--reason", "enough for today", "--actor", "dave"),
    ):
        done = rollout(*args, "--json")
        assert done.returncode == 0, (args, done.stderr)

    watched = rollout("status", "--watch", "--interval", "0.5")
    assert watched.returncode == EXIT_ROLLOUT_ABORTED, (watched.returncode, watched.stderr)
    assert "\x1b[2J" not in watched.stdout  # not a terminal: no screen clearing
    assert "aborted" in watched.stdout

    done = rollout("history", "--db", env.settings.registry_url, "--json", "--limit", "1")
    record = json.loads(done.stdout.splitlines()[0])
    assert record["id"] == started["rollout"] and record["phase"] == "aborted"
    messages = [e["message"] for e in record["state"]["events"] if e["event"] == "operator"]
    assert messages == [
        "pause by alice: hold for a look",
        "resume by bob: looked fine",
        "abort by dave: enough for today",
    ], messages
    assert not failed(run.stop())
