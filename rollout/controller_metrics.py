"""What the controller actor exports to Ray's metrics: the sequential judge's evidence.

One gauge per check and side, set after every tick from the active rollout's evidence (the
threshold judge has none), so the dashboard can plot how the evidence against and for the
canary grew over the rollout beside the bounds that decide it. Runs inside the actor only.
"""

from __future__ import annotations

from ray.util import metrics

from app import telemetry as t
from rollout.sequential import SAMPLE_RATIO, enabled_checks
from rollout.state import RolloutState, capped


class ControllerMetrics:
    def __init__(self) -> None:
        tags = (t.MODEL, t.CHECK, t.SIDE)
        self.evidence = metrics.Gauge(
            t.ROLLOUT_EVIDENCE,
            description="Sequential judge: e-value against / for the canary, per check",
            tag_keys=tags,
        )
        self.bound = metrics.Gauge(
            t.ROLLOUT_EVIDENCE_BOUND,
            description="Sequential judge: the e-value at which a check fails / passes",
            tag_keys=tags,
        )

    def publish(self, state: RolloutState | None) -> None:
        if state is None:
            return
        self._publish_shadow(state)
        if state.evidence is None:
            return
        plan = state.plan
        fail_at = enabled_checks(plan.checks) / plan.alpha
        for name, check in state.evidence.checks.items():
            for side, value, bound in (
                ("against", check.e_against, fail_at),
                ("for", check.e_for, 1 / plan.beta),
            ):
                tags = {t.MODEL: state.model, t.CHECK: name, t.SIDE: side}
                self.evidence.set(capped(value), tags=tags)
                self.bound.set(bound, tags=tags)
        tags = {t.MODEL: state.model, t.CHECK: SAMPLE_RATIO, t.SIDE: "against"}
        self.evidence.set(capped(state.evidence.e_mismatch), tags=tags)
        self.bound.set(1 / plan.alpha, tags=tags)

    def _publish_shadow(self, state: RolloutState) -> None:
        """The shadow gate's evidence, per measure: the strongest evidence against it and the
        weakest for it over its bounds (what decides FAIL and PASS)."""
        evidence = state.shadow_evidence
        if evidence is None or not evidence.bounds:
            return
        plan = state.plan
        fail_at = len(evidence.bounds) / plan.alpha
        for measure in {b.measure for b in evidence.bounds}:
            bounds = [b for b in evidence.bounds if b.measure == measure]
            for side, value, bound in (
                ("against", max(b.against.e_value for b in bounds), fail_at),
                ("for", min(b.supporting.e_value for b in bounds), 1 / plan.beta),
            ):
                tags = {t.MODEL: state.model, t.CHECK: measure, t.SIDE: side}
                self.evidence.set(capped(value), tags=tags)
                self.bound.set(bound, tags=tags)
