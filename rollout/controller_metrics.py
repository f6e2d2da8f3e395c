"""What the controller actor exports to Ray's metrics: the sequential judge's evidence, and
the drift repairs (Serve's config found changed behind the controller's back), by what drifted.

One gauge per check and side, set after every tick from the active rollout's evidence (the
threshold judge has none), so the dashboard can plot how the evidence against and for the
canary grew over the rollout beside the bounds that decide it. Runs inside the actor only.

Ray's gauges cannot be removed and repeat their last value for as long as the process runs:
once a rollout has ended (or a series is no longer one it judges) its evidence is set back to
1, "no evidence", rather than left at the value it ended on, which would read as a live
verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app import telemetry as t
from rollout.sequential import SAMPLE_RATIO, judged_checks
from rollout.state import RolloutState, capped

TAG_KEYS = (t.MODEL, t.CHECK, t.SIDE)

# Makes a metric from (name, description=..., tag_keys=...), as ray.util.metrics' classes do.
MetricFactory = Callable[..., Any]


def _made(make: MetricFactory, name: str) -> Any:
    spec = t.METRIC_SPECS[name]
    return make(spec.name, description=spec.description, tag_keys=spec.labels)


class ControllerMetrics:
    """The controller's series. ``gauge`` and ``counter`` make them: Ray's metrics classes in
    the actor (the default); a recorder in the unit tests, which load no Ray."""

    def __init__(
        self, gauge: MetricFactory | None = None, counter: MetricFactory | None = None
    ) -> None:
        if gauge is None or counter is None:
            from ray.util import metrics

            gauge, counter = gauge or metrics.Gauge, counter or metrics.Counter
        # Names, descriptions and labels: app.telemetry's table.
        self.evidence = _made(gauge, t.ROLLOUT_EVIDENCE)
        self.bound = _made(gauge, t.ROLLOUT_EVIDENCE_BOUND)
        # (model, check, side) of every series set for the rollout being judged.
        self._live: set[tuple[str, str, str]] = set()
        self.drift_repairs = _made(counter, t.ROLLOUT_DRIFT_REPAIRS)
        self._drift_counted: dict[str, int] = {}

    def publish_drift(self, model: str, repairs: dict[str, int]) -> None:
        """Count the repairs made since the last call (``repairs``: the engine's totals)."""
        for what, total in repairs.items():
            new = total - self._drift_counted.get(what, 0)
            if new > 0:
                self.drift_repairs.inc(new, tags={t.MODEL: model, t.DRIFT: what})
            self._drift_counted[what] = total

    def publish(self, state: RolloutState | None) -> None:
        values: dict[tuple[str, str, str], tuple[float, float]] = {}
        if state is not None and not state.phase.is_terminal:
            values = evidence_values(state)
        for key, (value, bound) in values.items():
            tags = dict(zip(TAG_KEYS, key, strict=True))
            self.evidence.set(capped(value), tags=tags)
            self.bound.set(bound, tags=tags)
        for key in self._live - values.keys():
            self.evidence.set(1.0, tags=dict(zip(TAG_KEYS, key, strict=True)))
        self._live = set(values)


def evidence_values(state: RolloutState) -> dict[tuple[str, str, str], tuple[float, float]]:
    """``(model, check, side) -> (e-value, the bound it is held to)`` for one rollout."""
    out = _shadow_values(state)
    if state.evidence is None:
        return out
    plan = state.plan
    fail_at = judged_checks(plan) / plan.alpha
    for name, check in state.evidence.checks.items():
        out[(state.model, name, "against")] = (check.e_against, fail_at)
        out[(state.model, name, "for")] = (check.e_for, 1 / plan.beta)
    out[(state.model, SAMPLE_RATIO, "against")] = (state.evidence.e_mismatch, 1 / plan.alpha)
    return out


def _shadow_values(state: RolloutState) -> dict[tuple[str, str, str], tuple[float, float]]:
    """The shadow gate's evidence, per measure: the strongest evidence against it and the
    weakest for it over its bounds (what decides FAIL and PASS)."""
    evidence = state.shadow_evidence
    if evidence is None or not evidence.bounds:
        return {}
    plan = state.plan
    fail_at = len(evidence.bounds) / plan.alpha
    out = {}
    for measure in {b.measure for b in evidence.bounds}:
        bounds = [b for b in evidence.bounds if b.measure == measure]
        against = max(b.against.e_value for b in bounds)
        out[(state.model, measure, "against")] = (against, fail_at)
        out[(state.model, measure, "for")] = (
            min(b.supporting.e_value for b in bounds),
            1 / plan.beta,
        )
    return out
