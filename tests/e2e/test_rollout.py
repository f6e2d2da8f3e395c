"""The rollout controller on a real Ray Serve cluster, under load (tests/e2e/harness.py: a
second application driven by the real controller). Every test starts with stable on
ranker-v41 and no rollout active, and ends the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from app.polling import wait_until
from rollout.actor import get_controller
from rollout.cli.exit_codes import EXIT_ROLLOUT_ABORTED
from rollout.local.traffic import cohort_share
from tests import artifacts
from tests.e2e.harness import BASELINE, CANDIDATE, FAST_PLAN, RolloutEnv, failed, register

pytestmark = pytest.mark.e2e


def test_controller_killed_mid_rollout_resumes_and_promotes_in_place(
    rollout_env: RolloutEnv,
) -> None:
    """Held at 20%, the controller crashes twice (once for good: the next command starts one
    that resumes from the registry; once restarted by Ray) and each new one resumes at the same
    step. Resumed, the rollout takes its last step (50%) and promotes in place: stable swaps
    while it still carries half the traffic, so the controller must see, from the replicas'
    reports, that the candidate fits beside the resident model. (Promotion by shift, FAST_PLAN's,
    is tests/e2e/test_acceptance.py's first scenario, with the same assertions.)"""
    env = rollout_env
    stable_ids = env.replica_ids("stable")
    audited = env.registry.history("ranker", "default", limit=1)[0].id  # the app is shared
    promotion = "in_place"
    plan = {
        **FAST_PLAN,
        "steps": [20, 50],
        "gates": {"pause_before_steps": [50]},
        "promotion": promotion,
    }
    run = env.traffic()
    wait_until(lambda: len(run.records) >= 20, 60, "traffic flowing")
    started = run.now_s()
    env.start(CANDIDATE, plan)
    held = env.wait_for_phase("paused", timeout=90)
    assert held["weights"]["canary_bp"] == 2000 and held["pending_gate"]

    ray.kill(get_controller(), no_restart=True)  # a crash; nothing runs the rollout now
    wait_until(lambda: get_controller() is None, 30, "controller gone", retry_on=(Exception,))
    assert len(run.records) > 0
    resumed = env.status()  # ensure_controller starts a new one: it resumes from the registry
    assert resumed["rollout"] == held["rollout"]
    assert (resumed["phase"], resumed["step"], resumed["weights"]) == (
        "paused",
        held["step"],
        held["weights"],
    )
    # Ray restarts a controller that dies on its own (max_restarts): same story.
    before = ray.get(env.controller.ping.remote(), timeout=60)["pid"]
    ray.kill(get_controller(), no_restart=False)

    def restarted_and_paused() -> bool:
        # Calls may still reach the old process until the kill lands: wait for a new one.
        pid = ray.get(get_controller().ping.remote(), timeout=30)["pid"]
        return pid != before and env.status()["phase"] == "paused"

    wait_until(
        restarted_and_paused, 90, "controller restarted by Ray, paused", retry_on=(Exception,)
    )

    env.command("resume")
    view = env.wait_for_phase("succeeded", "rolled_back", "failed", finished=True, timeout=150)
    records = run.stop()
    assert view["phase"] == "succeeded", (view["reason"], view["verdicts"], view["events"])
    assert not failed(records), failed(records)[:5]
    assert env.stable_target() == CANDIDATE
    # Promotion moved stable by hot swap: the same replicas, now answering from v42.
    assert env.replica_ids("stable") == stable_ids
    assert {r.artifact_id for r in records if r.start_s > run.now_s() - 1} <= {CANDIDATE}
    canary_answers = [r for r in records if r.start_s > started and r.cohort == "canary"]
    assert canary_answers and {r.artifact_id for r in canary_answers} == {CANDIDATE}
    # Every target change went through the registry with an audit row: stable's promotion
    # in this rollout, and each canary generation that answered (an earlier rollout of v42 in
    # the session may have published the canary target this one found in place).
    history = env.registry.history("ranker", "default", limit=1000)
    assert any(
        h.cohort == "stable" and h.new_artifact_id == CANDIDATE and h.id > audited for h in history
    )
    published = {(h.new_artifact_id, h.new_revision) for h in history if h.cohort == "canary"}
    assert {(r.artifact_id, r.revision) for r in canary_answers} <= published
    events = [e["event"] for e in view["events"]]
    assert "finished" in events
    record = env.registry.list_rollouts("ranker", "default", limit=1)[0]
    assert record.phase == "succeeded" and not record.active
    said = [e["message"] for e in record.state["events"] if e["event"] == "promoting"]
    assert said == [f"promoting {CANDIDATE} by {promotion}"], record.state["events"]


def test_registry_conflict_stops_the_rollout_without_overwriting(rollout_env: RolloutEnv) -> None:
    env = rollout_env
    plan = {**FAST_PLAN, "gates": {"pause_before_steps": [50]}}
    run = env.traffic()
    env.start(CANDIDATE, plan)
    env.wait_for_phase("paused", timeout=90)

    # Another writer (an operator's script) points canary elsewhere behind the rollout's back.
    current = env.registry.get_target("ranker", "default", "canary")
    theirs = env.registry.publish(
        "ranker", "default", "canary", BASELINE, current.revision, actor="someone", reason="x"
    )
    view = env.wait_for_phase("aborted", finished=True, timeout=60)
    records = run.stop()

    assert "registry conflict" in (view["reason"] or ""), view
    assert view["weights"] == {"stable_bp": 10_000, "canary_bp": 0}
    after = env.registry.get_target("ranker", "default", "canary")
    assert (after.revision, after.artifact_id) == (theirs.revision, BASELINE), "overwritten"
    assert env.stable_target() == BASELINE
    assert not failed(records), failed(records)[:5]


def test_candidate_that_fails_its_dry_run_fails_the_rollout(
    rollout_env: RolloutEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = rollout_env
    bad = artifacts.nan_weights_artifact(tmp_path_factory.mktemp("nan") / "art")
    register(env.registry, bad)
    run = env.traffic()
    env.start(bad.artifact_id)
    view = env.wait_for_phase("failed", "rolled_back", finished=True, timeout=90)
    records = run.stop()

    assert view["phase"] == "failed", view
    assert "dry_run" in (view["reason"] or ""), view["reason"]
    assert not failed(records)
    assert not [r for r in records if r.artifact_id == bad.artifact_id], "bad model answered"
    assert env.stable_target() == BASELINE


ROLLOUT = str(Path(sys.executable).with_name("rollout"))
HANG_GUARD_S = 120


def rollout_binary(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed ``rollout`` binary, attached to this session's cluster by address (but
    ``history``, which reads the registry alone); the test cluster has token auth on (Ray's
    default for a new local cluster)."""
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [ROLLOUT, *args, *(("--address", address) if args[0] != "history" else ())],
        cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_operator_rollback_is_weights_first(rollout_env: RolloutEnv, tmp_path: Path) -> None:
    """The operator's rollback, typed as a user types it (the installed binary, attaching to
    the cluster by address), moves every client to stable at once."""
    env = rollout_env
    plan = {**FAST_PLAN, "gates": {"pause_before_steps": [50]}}
    run = env.traffic(rate=40)
    env.start(CANDIDATE, plan)
    env.wait_for_phase("paused", timeout=90)
    asked = run.now_s()
    done = rollout_binary("rollback", "--reason", "operator saw something", cwd=tmp_path)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    view = env.wait_for_phase("rolled_back", finished=True, timeout=60)

    def all_stable_since(records: list) -> float | None:
        # In order of start (records arrive in order of answer: a slow canary request started
        # before the switch may still be in flight), from 60 answers on (at 20% canary, 20
        # stable answers in a row come by chance).
        recent = sorted((r for r in records if r.start_s > asked and r.cohort),
                        key=lambda r: r.start_s)  # fmt: skip
        for i, record in enumerate(recent):
            if all(r.cohort == "stable" for r in recent[i:]) and len(recent) - i >= 60:
                return record.start_s
        return None

    wait_until(lambda: all_stable_since(run.records), 30, "clients answered by stable only")
    records = run.stop()  # every request answered: none still in flight
    switched_at = all_stable_since(records)
    assert switched_at is not None
    assert view["reason"] == "operator saw something"
    assert not failed(records)
    assert switched_at - asked < 10, f"{switched_at - asked:.1f}s to stable 100%"
    # Routed answers are stable's alone from then on. A failover (a stable call that failed or
    # timed out, retried on the canary while it still serves) is the design, not a weight.
    after = [r for r in records if r.start_s >= switched_at and r.cohort]
    routed = [r for r in after if not r.failover]
    assert cohort_share(routed, switched_at, float("inf")) == {"stable": 1.0}, [
        (round(r.start_s - asked, 2), r.cohort, r.artifact_id)
        for r in routed
        if r.cohort != "stable"
    ]


# The operator's commands against this cluster's running controller, both ways a user types
# them: `rollout.cli.main` in this process and the installed `rollout` binary (a subprocess
# attaching to the cluster by address). Who gave each command and why lands in the rollout's
# events, and `rollout status --watch` ends with the rollout's outcome as its exit code (CI
# gates on it). One rollout, held at a gate, carries both (each had its own before).


def test_operator_commands_in_process_and_by_the_binary_record_who_and_why(
    rollout_env: RolloutEnv, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import yaml

    from rollout.cli import main

    env = rollout_env
    env.controller  # noqa: B018 - make sure it runs (the CLI attaches to it)
    db = ["--db", env.settings.registry_url]

    def in_process(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    def binary(*args: str) -> subprocess.CompletedProcess[str]:
        return rollout_binary(*args, cwd=tmp_path)

    code, out, err = in_process("pause", *db)
    assert code == 5 and "no rollout" in err, (code, out, err)

    run = env.traffic()  # the steps are judged on real traffic
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({**FAST_PLAN, "gates": {"pause_before_steps": [50]}}))
    code, out, err = in_process(
        "start", "ranker", CANDIDATE, "--plan", str(plan_file), *db, "--json"
    )
    assert code == 0, err
    started = json.loads(out)
    assert started["candidate"] == CANDIDATE
    code, out, err = in_process("start", "ranker", CANDIDATE, *db)
    assert code == 5 and "still" in err, (code, err)

    env.wait_for_phase("paused", timeout=90)
    code, out, err = in_process("status", *db)
    assert code == 0 and "paused" in out and "canary 20%" in out, out
    code, out, err = in_process(
        "pause", "--reason", "hold for a look", "--actor", "alice", *db, "--json"
    )
    assert code == 0 and json.loads(out)["queued"] == "pause", (code, out, err)
    done = binary("resume", "--reason", "looked fine", "--actor", "bob", "--json")
    assert done.returncode == 0, done.stderr
    code, out, err = in_process(
        "abort", "--reason", "enough for today", "--actor", "dave", *db, "--json"
    )
    assert code == 0 and json.loads(out)["queued"] == "abort", (code, out, err)

    watched = binary("status", "--watch", "--interval", "0.5")
    assert watched.returncode == EXIT_ROLLOUT_ABORTED, (watched.returncode, watched.stderr)
    assert "\x1b[2J" not in watched.stdout  # not a terminal: no screen clearing
    assert "aborted" in watched.stdout
    code, out, err = in_process("history", *db)
    assert code == 0 and started["rollout"] in out and "aborted" in out, out

    done = binary("history", "--db", env.settings.registry_url, "--json", "--limit", "1")
    record = json.loads(done.stdout.splitlines()[0])
    assert record["id"] == started["rollout"] and record["phase"] == "aborted"
    messages = [e["message"] for e in record["state"]["events"] if e["event"] == "operator"]
    assert messages == [
        "pause by alice: hold for a look",
        "resume by bob: looked fine",
        "abort by dave: enough for today",
    ], messages

    # A plan no healthy canary can pass at this traffic within its deadline (1% of about 30
    # requests a second, a few hundred needed, 10 s allowed): refused before anything moves,
    # with the step, the estimate and two changes that fit. The controller has measured the
    # traffic of this test (it scrapes every tick of a rollout, every 15 s between them).
    tight = tmp_path / "tight.yaml"
    tight.write_text(
        yaml.safe_dump(
            {**FAST_PLAN, "judge": "sequential", "steps": [1, 100], "progress_deadline_s": 10}
        )
    )
    refused = binary("start", "ranker", CANDIDATE, "--plan", str(tight))
    assert refused.returncode == 6, (refused.returncode, refused.stdout, refused.stderr)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error[")]
    assert len(errors) == 1, refused.stderr  # one line, whatever Ray logged before it
    assert errors[0].startswith(
        "error[config]: plan: step 1/2 (1%): a healthy canary passes in about"
    ), errors
    for said in ("req/s measured over the last", "Changes that fit: a step of", "--force"):
        assert said in errors[0], errors
    done = binary("history", "--db", env.settings.registry_url, "--json", "--limit", "1")
    assert json.loads(done.stdout.splitlines()[0])["id"] == started["rollout"]  # none created
    assert not failed(run.stop())
