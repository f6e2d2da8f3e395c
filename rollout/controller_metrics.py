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
        if state is None or state.evidence is None:
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
