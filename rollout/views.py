"""What the controller shows, built from the engine's state: ``RolloutSummary`` and
``ControllerStatus``, and their JSON form for the actor's answers.

The actor answers the CLI with ``wire(view)``: the fields the controller set, as JSON (so "no
rollout" is ``{"rollout": None}``, and an event carries ``canary_bp`` only when it is a weight
change). The CLI validates an answer back into its model and renders that
(``rollout/cli/render.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel

from app.contracts import (
    CohortWindowView,
    ControllerStatus,
    EvidenceView,
    HoldView,
    InstanceReport,
    PublishedTarget,
    ReplicaRow,
    RolloutEvent,
    RolloutSummary,
    ShadowView,
    VerdictView,
    WeightsView,
    WindowView,
    clip_text,
)
from rollout.analysis import CohortStats, WindowStats
from rollout.state import RolloutState
from rollout.step_progress import step_progress

SHOWN_EVENTS: Final = 10  # of a rollout's events, the latest this many
SHOWN_NOTES: Final = 10  # alerts and errors


def wire(view: BaseModel) -> dict[str, Any]:
    """A view as the actor answers it: the fields that were set, as JSON."""
    return view.model_dump(mode="json", exclude_unset=True)


def fields_of(view: BaseModel) -> dict[str, Any]:
    """The fields set on ``view``, to build a wider view from it."""
    return {name: getattr(view, name) for name in view.model_fields_set}


def rollout_summary(
    state: RolloutState | None,
    events: Sequence[RolloutEvent] = (),
    *,
    held_since: float | None = None,
    held_reason: str | None = None,
    now: float | None = None,
) -> RolloutSummary:
    """``now`` (the controller's clock): the current step's progress is shown with it."""
    if state is None:
        return RolloutSummary(rollout=None)
    return RolloutSummary(
        rollout=state.rollout_id,
        model=state.model,
        candidate=state.candidate_artifact_id,
        baseline=state.baseline_artifact_id,
        phase=state.phase,
        finished=state.finished,
        step=state.step_index,
        step_percent=state.step_percent,
        steps=tuple(state.plan.steps),
        weights=WeightsView(stable_bp=state.weights.stable_bp, canary_bp=state.weights.canary_bp),
        failed_checks=state.failed_checks,
        reason=clip_text(state.reason),
        pending_gate=state.pending_gate,
        held=None
        if held_since is None
        else HoldView(since=held_since, reason=clip_text(held_reason) or ""),
        shadow=shadow_view(state),
        verdicts=tuple(
            VerdictView(
                step=v.step_index,
                outcome=v.outcome.value,
                reasons=tuple(clip_text(r) or "" for r in v.reasons),
                evidence=tuple(EvidenceView(**e.to_dict()) for e in v.evidence),
            )
            for v in state.verdicts
        ),
        events=tuple(events[-SHOWN_EVENTS:]),
        estimate=state.estimate,
        progress=None if now is None else step_progress(state, now),
    )


def shadow_view(state: RolloutState) -> ShadowView | None:
    evidence = state.shadow_evidence
    if evidence is None:
        return None
    return ShadowView(
        fraction_bp=state.shadow_bp,
        live=state.shadow_live_at is not None,
        basis=clip_text(evidence.basis),
        compared=evidence.compared,
        dropped=evidence.dropped,
        errors=evidence.errors,
        rbo_mean=evidence.rbo_mean,
        overlap_mean=evidence.overlap_mean,
        top1_change_rate=evidence.top1_change_rate,
        max_score_diff_p99=evidence.max_score_diff_p99,
        windows=evidence.windows,
    )


def replica_rows(reports: Mapping[str, InstanceReport], now: float) -> tuple[ReplicaRow, ...]:
    rows = (
        ReplicaRow(
            replica=replica_id,
            cohort=r.cohort,
            phase=r.phase,
            desired=r.desired_artifact,
            actual=r.actual_artifact,
            actual_revision=r.actual_revision,
            desired_revision=r.desired_revision,
            error=clip_text(r.last_error.describe()) if r.last_error is not None else None,
            age_s=round(now - r.heartbeat, 1),
            progress=r.progress,
            backbone=r.actual_backbone,
            trust_anchors=r.trust_anchors,
        )
        for replica_id, r in reports.items()
    )
    return tuple(sorted(rows, key=lambda row: (str(row.cohort), row.replica)))


def window_view(window: WindowStats) -> WindowView:
    span = max(window.duration_s, 1e-9)

    def cohort(stats: CohortStats | None) -> CohortWindowView | None:
        if stats is None:
            return None
        return CohortWindowView(
            requests=stats.requests,
            rps=round(stats.requests / span, 1),
            error_rate=stats.error_rate,
            p50_ms=stats.p50_ms,
            p99_ms=stats.p99_ms,
        )

    return WindowView(
        start=window.start,
        end=window.end,
        canary=cohort(window.canary),
        stable=cohort(window.stable),
    )


def controller_status(
    summary: RolloutSummary,
    *,
    targets: Sequence[PublishedTarget] | None,
    reports: Mapping[str, InstanceReport],
    now: float,
    last_window: WindowStats | None,
    alerts: Iterable[str],
    errors: Iterable[str],
    reports_refused: int = 0,
) -> ControllerStatus:
    return ControllerStatus(
        **fields_of(summary),
        targets=None if targets is None else tuple(targets),
        replicas=replica_rows(reports, now),
        last_window=None if last_window is None else window_view(last_window),
        alerts=tuple(clip_text(a) or "" for a in list(alerts)[-SHOWN_NOTES:]),
        errors=tuple(clip_text(e) or "" for e in list(errors)[-SHOWN_NOTES:]),
        reports_refused=reports_refused,
    )
