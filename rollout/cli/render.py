"""What the ``rollout`` commands print: one JSON line for scripts (``emit``), and the text a
person reads at a terminal (``render_status``: the controller's view of the rollout;
``standby_lines``: the router's hot standby).

The views themselves come from the controller as JSON (``app.contracts`` models, built by
``rollout/views.py``); nothing here imports the engine. Every value that came from outside
goes through ``terminal_safe``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click

from app.contracts import (
    COHORTS,
    PASS_QUANTILE_TEXT,
    ControllerStatus,
    ReplicaPhase,
    ReplicaRow,
    RolloutSummary,
    StandbyView,
    duration_text,
)
from app.safe_text import terminal_safe


def emit(payload: dict[str, Any]) -> None:
    """One JSON line on stdout, keys sorted: what a command answers a script."""
    click.echo(json.dumps(payload, sort_keys=True))


def _phase_cell(row: ReplicaRow) -> str:
    """The phase, or for a load in progress how far it is ("loading 3.1/7.0 GiB")."""
    if row.progress is None:
        return str(row.phase)
    if row.phase is ReplicaPhase.LOADING:
        return row.progress.describe()
    return f"{row.phase} ({row.progress.describe()})"


def _pct(bp: int | None) -> str:
    return "-" if bp is None else f"{bp / 100:g}%"


def _at_revision(artifact: str | None, revision: int | None) -> str:
    """``ranker-v42@7``: an artifact with the target revision it came with."""
    if artifact is None:
        return "-"
    return artifact if revision is None else f"{artifact}@{revision}"


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as wide as their widest cell (ids of any length stay aligned); the last
    column is left ragged."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    widths[-1] = 0
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]


def standby_lines(standby: StandbyView) -> list[str]:
    """The router's hot standby: where traffic goes, the guard, each breaker."""
    down = f"for {standby.down_s or 0:.0f}s"
    where = (
        f"SERVING FROM FALLBACK {down}"
        if standby.serving_from_fallback
        else f"PRIMARIES DOWN {down}, the fallback cannot answer: 503 + Retry-After"
        if standby.primaries_down
        else "on the primary cohorts"
    )
    ready = "ready" if standby.ready else "NOT ready"
    allowed = "allowed" if standby.allowed else "REFUSED"
    lines = [
        f"standby: {where}; fallback {ready}, {allowed} ({standby.allowed_reason}); "
        f"policy {standby.policy}; {standby.answered} answered"
        + (f", {standby.waiting} waiting" if standby.waiting else "")
    ]
    for b in standby.breakers:
        back = (
            ""
            if b.state == "closed"
            else "   fail-back: waits for it to serve"
            if b.fail_back_in_s is None
            else f"   fail-back in {b.fail_back_in_s:.0f}s"
        )
        why = f"   (opened {b.opened}x, last: {b.reason})" if b.opened else ""
        lines.append(
            f"  breaker {b.cohort}: {b.state} for {b.in_state_s:.0f}s, share "
            f"{b.share * 100:.0f}%{back}{why}"
        )
    return lines


def trust_disagreement(rows: Sequence[ReplicaRow]) -> list[str]:
    """A warning when replicas trust different anchors (``trust_anchors``, the digest of the
    key files' content): a key replaced in place (a ConfigMap update, a revocation) not yet
    seen by all of them, or nodes whose files differ. One line per set of anchors."""
    by_digest: dict[str | None, list[str]] = {}
    for row in rows:
        by_digest.setdefault(row.trust_anchors, []).append(row.replica)
    if len(by_digest) < 2:
        return []
    lines = ["WARNING replicas trust different signing anchors:"]
    for digest, replicas in sorted(by_digest.items(), key=lambda item: str(item[0])):
        name = f"anchors {digest[:12]}" if digest is not None else "no anchors"
        lines.append(f"  {name}: {', '.join(sorted(replicas))}")
    return lines


def _duration(seconds: float | None) -> str:
    return duration_text(seconds, unit_gap="")


def estimate_lines(view: RolloutSummary) -> list[str]:
    """The start's estimate, and the current step's way to its decision."""
    lines = []
    found = view.estimate
    if found is not None:
        lines.append(
            f"estimate at {found.rps:g} req/s (measured over {found.measured_s:.0f}s, stable "
            f"errors {found.stable_error_rate:.2%}): progress deadline "
            f"{_duration(found.deadline_s)} (from the {found.deadline_source})"
            + ("; started with --force against it" if found.forced else "")
        )
        for step in found.steps:
            mark = "" if step.fits else "  DOES NOT FIT"
            lines.append(
                f"  step {step.index + 1}/{len(found.steps)} ({step.percent:g}%): passes in "
                f"~{_duration(step.pass_s)} ({PASS_QUANTILE_TEXT} within "
                f"{_duration(step.pass_late_s)}; {step.limiting}), catches 2x a bound in "
                f"~{_duration(step.catch_s)}{mark}"
            )
    progress = view.progress
    if progress is not None:
        parts = [f"{c.check} {c.toward_pass:.0%}" for c in progress.checks]
        floor = (
            f"; {progress.canary_requests}/{progress.min_requests} canary requests"
            if progress.canary_requests < progress.min_requests
            else ""
        )
        left = (
            f"; about {_duration(progress.time_left_s)} left at "
            f"{progress.canary_rps:g} canary req/s"
            if progress.time_left_s is not None and progress.canary_rps
            else ""
        )
        lines.append(
            f"step {progress.index + 1} toward passing: " + (", ".join(parts) or "no evidence yet")
            + floor + left
        )  # fmt: skip
    return lines


def render_status(view: RolloutSummary, *, now: float | None = None) -> str:
    """The human view of ``rollout status`` (and of a command's answer: a summary alone).

    Every value that came from outside (ids, reasons, error texts) goes through
    ``terminal_safe``: a name with terminal escapes must not rewrite the screen."""
    lines = []
    if view.rollout:
        step = view.step if view.step is not None else -1
        where = f"step {step + 1}/{len(view.steps)} ({view.step_percent}%)" if step >= 0 else ""
        lines.append(
            f"rollout {view.rollout}: {view.phase} {where}  "
            f"candidate {view.candidate} over {view.baseline}"
        )
        w = view.weights
        lines.append(
            f"weights: stable {_pct(w.stable_bp if w else None)} "
            f"canary {_pct(w.canary_bp if w else None)}"
            f"   failed checks {view.failed_checks or 0}"
            + (f"   gate {view.pending_gate}" if view.pending_gate else "")
            + (f"   reason: {view.reason}" if view.reason else "")
        )
        if view.held is not None:
            lines.append(
                f"HELD since {_clock(view.held.since)} UTC (deadlines paused, serving goes on): "
                f"{view.held.reason}"
            )
    else:
        lines.append("no rollout in progress")
    status = view if isinstance(view, ControllerStatus) else None
    window = status.last_window if status is not None else None
    if window is not None:
        parts = []
        for name in COHORTS:
            c = getattr(window, name)
            if c is not None:
                err = "-" if c.error_rate is None else f"{c.error_rate * 100:.2f}%"
                p99 = "-" if c.p99_ms is None else f"{c.p99_ms:.1f}ms"
                parts.append(f"{name} {c.rps}/s err {err} p99 {p99}")
        span = window.end - window.start
        lines.append(f"last window ({span:.0f}s): " + (" | ".join(parts) or "no traffic"))
    lines.extend(estimate_lines(view))
    if view.shadow is not None:
        lines.append(view.shadow.describe())
    for verdict in view.verdicts:
        where = f"step {verdict.step + 1}" if verdict.step >= 0 else "shadow"
        lines.append(f"  verdict {where}: {verdict.outcome}: " + "; ".join(verdict.reasons))
    if status is not None:
        for target in status.targets or ():
            lines.append(
                f"target {target.cohort}: {target.artifact_id} (revision {target.revision})"
            )
        if status.replicas:
            headers = ["replica", "cohort", "phase", "desired", "actual", "heartbeat", "error"]
            rows = [
                [
                    terminal_safe(cell)  # escaped before widths are measured
                    for cell in (
                        r.replica,
                        str(r.cohort or "-"),
                        _phase_cell(r),
                        _at_revision(r.desired, r.desired_revision),
                        _at_revision(r.actual, r.actual_revision)
                        + (f" on {r.backbone}" if r.backbone else ""),
                        f"{r.age_s:.1f}s ago",
                        r.error or "",
                    )
                ]
                for r in status.replicas
            ]
            lines.extend(_table(headers, rows))
            lines.extend(trust_disagreement(status.replicas))
        if status.standby is not None:
            lines.extend(standby_lines(status.standby))
        if status.reports_refused:
            lines.append(
                f"reports refused: {status.reports_refused} (invalid, or a heartbeat ahead of "
                "the controller's clock; `rollout status --json` lists the last errors)"
            )
    for event in view.events[-5:]:
        lines.append(f"  {_clock(event.at)} {event.event}: {event.message}")
    if status is not None:
        for alert in status.alerts:
            lines.append(f"  ALERT {alert}")
    if now is not None:
        lines.append(f"(as of {_clock(now)} UTC)")
    return "\n".join(terminal_safe(line) for line in lines)
