"""The human view of ``rollout status``: what an operator reads when something is down. The
CLI validates the controller's answer into ``ControllerStatus`` (or a command's answer into
its summary) and renders that."""

from __future__ import annotations

from typing import Any

from app.contracts import CommandAccepted, ControllerStatus
from rollout.cli.render import render_status


def view(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout": "ranker-v42-abc123",
        "phase": "progressing",
        "step": 1,
        "steps": [20.0, 50.0, 100.0],
        "step_percent": 50.0,
        "candidate": "ranker-v42",
        "baseline": "ranker-v41",
        "weights": {"stable_bp": 5000, "canary_bp": 5000},
        "failed_checks": 0,
        "held": None,
        "targets": None,
        "alerts": [],
    }
    return {**base, **changes}


def render(answer: dict[str, Any]) -> str:
    return render_status(ControllerStatus.model_validate(answer))


def test_a_held_rollout_says_so_with_since_and_why() -> None:
    text = render(
        view(
            held={"since": 1_764_400_000.0, "reason": "registry unavailable: connection refused"},
            alerts=["warning: rollout ranker-v42-abc123 held: registry unavailable"],
        )
    )
    lines = text.splitlines()
    assert lines[0].startswith("rollout ranker-v42-abc123: progressing step 2/3 (50.0%)")
    held = [line for line in lines if line.startswith("HELD")]
    assert held == [
        "HELD since 07:06:40 UTC (deadlines paused, serving goes on): "
        "registry unavailable: connection refused"
    ]
    assert any(line.strip().startswith("ALERT warning") for line in lines)


def test_a_rollout_that_is_not_held_has_no_held_line() -> None:
    assert "HELD" not in render(view())
    assert render({"rollout": None}) == "no rollout in progress"


def target(cohort: str, artifact_id: str, revision: int) -> dict[str, Any]:
    return {
        "model": "ranker",
        "environment": "default",
        "cohort": cohort,
        "revision": revision,
        "artifact_id": artifact_id,
        "manifest_uri": f"file:///artifacts/{artifact_id}/manifest.json",
        "manifest_sha256": "a" * 64,
        "feature_schema": "ranker-features-v3",
        "updated_at": "2030-01-01T00:00:00+00:00",
    }


def replica(
    name: str,
    cohort: str | None,
    phase: str,
    actual: str | None,
    rev: int | None,
    desired: tuple[str, int] | None = None,
):
    return {
        "replica": name,
        "cohort": cohort,
        "phase": phase,
        "desired": desired[0] if desired else actual,
        "desired_revision": desired[1] if desired else rev,
        "actual": actual,
        "actual_revision": rev,
        "error": "load: shape mismatch" if phase == "failed" else None,
        "age_s": 0.4,
    }


def test_everything_the_status_shows() -> None:
    answer = view(
        phase="paused",
        step=0,
        step_percent=20.0,
        weights={"stable_bp": 8000, "canary_bp": 2000},
        failed_checks=1,
        pending_gate="step:1",
        verdicts=[{"step": 0, "outcome": "fail", "reasons": ["canary p99 300.0 ms", "x"]}],
        events=[
            {"key": None, "event": "created", "message": "rollout of ranker-v42", "at": 1.0},
            {"key": "r/1", "event": "started", "message": "rolling out", "at": 2.0},
            {
                "key": None,
                "event": "weights",
                "message": "canary 20%",
                "at": 3.0,
                "canary_bp": 2000,
            },
        ],
        targets=[target("stable", "ranker-v41", 1), target("canary", "ranker-v42", 2)],
        replicas=[
            replica("canary-abcdefghijklmn", "canary", "ready", "ranker-v42", 2),
            replica("s1", "stable", "failed", "ranker-v41", 1, desired=("ranker-v43", 3)),
            replica("u1", None, "idle", None, None),
        ],
        last_window={
            "start": 100.0,
            "end": 120.5,
            "canary": {
                "requests": 100,
                "rps": 4.9,
                "error_rate": 0.05,
                "p50_ms": 10.0,
                "p99_ms": 40.25,
            },
            "stable": {
                "requests": 300,
                "rps": 14.6,
                "error_rate": 0.0,
                "p50_ms": None,
                "p99_ms": None,
            },
        },
        alerts=["warning: held"],
        reports_refused=2,
    )
    assert render(answer).splitlines() == [
        "rollout ranker-v42-abc123: paused step 1/3 (20.0%)  candidate ranker-v42 over ranker-v41",
        "weights: stable 80% canary 20%   failed checks 1   gate step:1",
        "last window (20s): stable 14.6/s err 0.00% p99 - | canary 4.9/s err 5.00% p99 40.2ms",
        "  verdict step 1: fail: canary p99 300.0 ms; x",
        "target stable: ranker-v41 (revision 1)",
        "target canary: ranker-v42 (revision 2)",
        "replica                cohort  phase   desired       actual        heartbeat  error",
        "canary-abcdefghijklmn  canary  ready   ranker-v42@2  ranker-v42@2  0.4s ago",
        "s1                     stable  failed  ranker-v43@3  ranker-v41@1  0.4s ago   "
        "load: shape mismatch",
        "u1                     -       idle    -             -             0.4s ago",
        "reports refused: 2 (invalid, or a heartbeat ahead of the controller's clock; "
        "`rollout status --json` lists the last errors)",
        "  00:00:01 created: rollout of ranker-v42",
        "  00:00:02 started: rolling out",
        "  00:00:03 weights: canary 20%",
        "  ALERT warning: held",
    ]
    # A command's answer is the summary alone: no window, targets, replicas or alerts.
    summary = {
        k: v
        for k, v in answer.items()
        if k not in ("targets", "replicas", "last_window", "alerts", "errors", "reports_refused")
    }
    text = render_status(CommandAccepted.model_validate({**summary, "queued": "abort"}))
    assert text.splitlines() == [
        "rollout ranker-v42-abc123: paused step 1/3 (20.0%)  candidate ranker-v42 over ranker-v41",
        "weights: stable 80% canary 20%   failed checks 1   gate step:1",
        "  verdict step 1: fail: canary p99 300.0 ms; x",
        "  00:00:01 created: rollout of ranker-v42",
        "  00:00:02 started: rolling out",
        "  00:00:03 weights: canary 20%",
    ]


def test_long_ids_keep_the_columns_aligned_and_escapes_are_shown_not_run() -> None:
    long_id = "stable-" + "x" * 60
    answer = view(
        replicas=[
            replica(long_id, "stable", "ready", "ranker-v41", 1),
            replica("s2", "stable", "ready", "ranker-v41\x1b[2J", 1),
        ],
        events=[{"key": None, "event": "held", "message": "a\x1b]0;title\x07b", "at": 61.0}],
    )
    lines = render(answer).splitlines()
    table = [line for line in lines if line.startswith(("replica", "stable-", "s2"))]
    assert len(table) == 3
    # Every row's cohort column starts where the header's does.
    header = table[0]
    assert {row.index("stable", 3) for row in table[1:]} == {header.index("cohort")}, table
    assert "\x1b" not in "".join(lines)
    assert "ranker-v41\\x1b[2J" in table[2]
    assert "  00:01:01 held: a\\x1b]0;title\\x07b" in lines


def test_controller_settings_are_shown_with_their_credentials_masked(capsys: Any) -> None:
    from rollout.cli.operate import _show_ping

    _show_ping(
        {
            "registry_url": "postgresql://ranker:hunter2@db:5432/registry",
            "dashboard_url": "https://ops:t0ken-secret@head:8265",
            "prometheus_url": "https://prom/api?token=abc123xyz",
            "pid": 7,
            "ticks": 3,
            "repaired": None,
        }
    )
    out = capsys.readouterr().out
    assert "hunter2" not in out and "t0ken-secret" not in out and "abc123xyz" not in out
    assert "postgresql://ranker:***@db:5432/registry" in out


def test_the_hot_standby_shows_where_traffic_goes_the_guard_and_each_breaker() -> None:
    standby = {
        "policy": "auto",
        "primaries_down": True,
        "down_s": 42.0,
        "serving_from_fallback": True,
        "ready": True,
        "allowed": True,
        "allowed_reason": "within 5%: fallback ndcg_at_10 0.401 vs stable 0.412",
        "metric": "ndcg_at_10",
        "fallback_metric": 0.401,
        "stable_metric": 0.412,
        "answered": 812,
        "waiting": 0,
        "breakers": [
            {
                "cohort": "stable",
                "state": "half_open",
                "in_state_s": 30.0,
                "share": 0.05,
                "fail_back_in_s": 120.0,
                "opened": 2,
                "reason": "failed again while failing back: ActorDiedError",
            },
            {"cohort": "canary", "state": "open", "in_state_s": 50.0, "share": 0.0,
             "fail_back_in_s": None, "opened": 1, "reason": "3 probes in a row unanswered"},
        ],
    }  # fmt: skip
    lines = render(view(standby=standby)).splitlines()
    assert (
        "standby: SERVING FROM FALLBACK for 42s; fallback ready, allowed (within 5%: fallback "
        "ndcg_at_10 0.401 vs stable 0.412); policy auto; 812 answered" in lines
    )
    assert (
        "  breaker stable: half_open for 30s, share 5%   fail-back in 120s   "
        "(opened 2x, last: failed again while failing back: ActorDiedError)" in lines
    )
    assert any(
        line.startswith("  breaker canary: open for 50s, share 0%   fail-back: waits for it to "
                        "serve") for line in lines
    )  # fmt: skip
    # Down, and the fallback may not answer: said as such.
    refused = {**standby, "serving_from_fallback": False, "allowed": False,
               "allowed_reason": "policy never: the operator refuses the fallback"}  # fmt: skip
    assert render(view(standby=refused)).splitlines()[-1].startswith("  breaker canary") and (
        "standby: PRIMARIES DOWN for 42s, the fallback cannot answer: 503 + Retry-After; "
        "fallback ready, REFUSED (policy never" in render(view(standby=refused))
    )
    # No fallback deployment: no standby lines at all.
    assert "standby" not in render(view())


def test_a_loading_replica_shows_how_far_its_load_is() -> None:
    loading = replica("c1", "canary", "loading", "ranker-v41", 1, desired=("ranker-v42", 2))
    loading["progress"] = {
        "revision": 2,
        "artifact_id": "ranker-v42",
        "stage": "load",
        "done_bytes": int(3.1 * (1 << 30)),
        "total_bytes": 7 * (1 << 30),
        "elapsed_s": 12.5,
    }
    fetching = replica("c2", "canary", "loading", None, None, desired=("ranker-v42", 2))
    fetching["progress"] = dict(loading["progress"], stage="fetch", done_bytes=512 << 20)
    lines = render(view(replicas=[loading, fetching])).splitlines()
    row = next(line for line in lines if line.startswith("c1 "))
    assert "  loading 3.1/7.0 GiB  " in row and "ranker-v42@2" in row
    assert "  fetching 0.5/7.0 GiB  " in next(line for line in lines if line.startswith("c2 "))
