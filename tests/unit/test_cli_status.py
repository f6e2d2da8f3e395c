"""The human view of ``rollout status``: what an operator reads when something is down."""

from __future__ import annotations

from typing import Any

from rollout.cli import render_status


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


def test_a_held_rollout_says_so_with_since_and_why() -> None:
    text = render_status(
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
    assert "HELD" not in render_status(view())
    assert render_status({"rollout": None}) == "no rollout in progress"
