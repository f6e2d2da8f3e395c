"""Which judge decides a window, and what its verdict leaves behind: the dispatch between the
shadow gate, the sequential judge and the threshold judge (``judge_window``), and what a failed
verdict means for the rollout (``rollback_reason``).

Pure, like the state machine that calls it (rollout.machine): the evidence a judge carries
from window to window is returned, the machine keeps it in the rollout's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.analysis import Verdict, WindowStats, judge
from rollout.sequential import (
    SAMPLE_RATIO,
    JudgeLevels,
    SequentialEvidence,
    judge_sequential,
    judged_checks,
)
from rollout.shadow_judge import ShadowEvidence, judge_shadow
from rollout.state import EvidenceRecord, Phase, RolloutState, capped


@dataclass(frozen=True)
class Judged:
    """A window's verdict, the evidence records shown with it, and the judges' evidence to
    carry on (each unchanged when its judge did not run)."""

    verdict: Verdict
    evidence: tuple[EvidenceRecord, ...]
    sequential: SequentialEvidence | None
    shadow: ShadowEvidence | None


def judge_window(state: RolloutState, window: WindowStats) -> Judged:
    """The verdict on ``window`` by the judge ``state`` calls for: the shadow gate while
    shadowing, else the plan's (``sequential`` or ``threshold``)."""
    plan = state.plan
    if state.phase is Phase.SHADOWING:
        assert state.shadow_evidence is not None
        verdict, shadow = judge_shadow(
            window.shadow_of(state.candidate_artifact_id), state.shadow_evidence, plan
        )
        fail_at = len(shadow.bounds) / plan.alpha
        records = tuple(
            EvidenceRecord(
                check=c.name,
                against=capped(c.evidence_against),
                supporting=None if c.evidence_for is None else capped(c.evidence_for),
                fail_at=fail_at,
                pass_at=1 / plan.beta,
            )
            for c in verdict.checks
            if c.evidence_against is not None
        )
        return Judged(verdict, records, state.evidence, shadow)
    if plan.judge == "sequential":
        verdict, sequential = judge_sequential(
            window,
            state.evidence,
            plan,
            canary_bp=state.weights.canary_bp,
            step_index=max(state.step_index, 0),
        )
        levels = JudgeLevels(plan.alpha, plan.beta, judged_checks(plan))
        records = tuple(
            EvidenceRecord(
                check=c.name,
                against=capped(c.evidence_against),
                supporting=None if c.evidence_for is None else capped(c.evidence_for),
                fail_at=levels.fail_at if c.name != SAMPLE_RATIO else None,
                pass_at=levels.pass_at if c.name != SAMPLE_RATIO else None,
                hold_at=1 / plan.alpha if c.name == SAMPLE_RATIO else None,
            )
            for c in verdict.checks
            if c.evidence_against is not None
        )
        return Judged(verdict, records, sequential, state.shadow_evidence)
    verdict = judge(
        window,
        plan.checks,
        min_requests=plan.min_requests,
        baseline_expected=state.weights.stable_bp > 0,
    )
    return Judged(verdict, (), state.evidence, state.shadow_evidence)


def rollback_reason(state: RolloutState, verdict: Verdict, where: str) -> str | None:
    """Why a failed window rolls the rollout back, or None when it does not yet (the threshold
    judge below its count of consecutive failures). ``state.failed_checks`` counts this
    window already."""
    reasons = "; ".join(verdict.reasons)
    if state.phase is Phase.SHADOWING:
        return "shadow divergence before any user traffic: " + reasons
    if state.plan.judge == "sequential":
        return f"evidence against the canary at {where}: " + reasons
    if state.failed_checks >= state.plan.threshold:
        return (
            f"{state.failed_checks} consecutive failed checks (threshold "
            f"{state.plan.threshold}) at {where}: " + reasons
        )
    return None
