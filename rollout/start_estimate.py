"""What ``rollout start`` knows before a rollout begins: the traffic of the last minutes, what
each step will take at it (rollout/estimate.py), the progress deadline the rollout runs with,
and whether the plan fits at all.

Pure: the engine hands it the metrics window it measured and the plan; it answers the plan to
run (its deadline set where the plan leaves it to the estimate), the estimate to keep with the
rollout, or ``PlanDoesNotFit`` naming the step and two changes that would fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Final

from app.contracts import (
    PASS_QUANTILE_TEXT,
    PlanEstimateView,
    StepEstimateView,
    duration_text,
)
from app.errors import PlanDoesNotFit
from rollout.analysis import WindowStats
from rollout.estimate import (
    PlanEstimate,
    StepEstimate,
    Traffic,
    estimate,
    scaled_deadline_s,
)
from rollout.plan import RolloutPlan

# The traffic an estimate is made from: the last five minutes (the controller scrapes while
# idle, every IDLE_OBSERVE_S), and no estimate from fewer of stable's requests than this.
TRAFFIC_LOOKBACK_S: Final = 300.0
MIN_TRAFFIC_REQUESTS: Final = 200


@dataclass(frozen=True)
class MeasuredTraffic:
    traffic: Traffic
    seconds: float  # over how long it was measured


def measured_traffic(window: WindowStats | None) -> MeasuredTraffic | None:
    """The traffic of a metrics window of the time before the start (None: too little to
    estimate from: no window yet, or fewer than ``MIN_TRAFFIC_REQUESTS`` of stable's)."""
    if window is None or window.duration_s <= 0:
        return None
    stable = window.stable
    if stable is None or stable.requests < MIN_TRAFFIC_REQUESTS or not stable.latency_buckets:
        return None
    total = stable.requests + (window.canary.requests if window.canary else 0)
    return MeasuredTraffic(
        Traffic(
            requests_per_s=total / window.duration_s,
            error_rate=stable.error_count / stable.requests,
            latency_buckets=dict(stable.latency_buckets),
        ),
        window.duration_s,
    )


def describe_step(step: StepEstimate, steps: int) -> str:
    """One step's estimate in words (what ``rollout start`` prints)."""
    where = f"step {step.index + 1}/{steps} ({step.percent:g}%)"
    if step.seconds_to_pass is None:
        return f"{where}: a healthy canary cannot pass at this traffic ({step.limiting})"
    catch = (
        f"; a regression of twice a bound caught in about {duration_text(step.seconds_to_catch)}"
        if step.seconds_to_catch is not None
        else ""
    )
    return (
        f"{where}: a healthy canary passes in about {duration_text(step.seconds_to_pass)} "
        f"({PASS_QUANTILE_TEXT} within {duration_text(step.seconds_to_pass_late)}; "
        f"set by {step.limiting}){catch}"
    )


def _larger_step(plan: RolloutPlan, traffic: Traffic, step: StepEstimate, deadline: float) -> str:
    """The least weight (whole percent) at which the step fits the deadline, or why none.
    A step's time goes about as one over its weight: scaled, then checked."""
    late = step.seconds_to_pass_late
    if late is None:
        return "no larger step helps: a canary like stable is outside a bound"
    percent = min(100.0, float(math.ceil(step.percent * late / deadline)))
    steps = list(plan.steps)
    steps[step.index] = percent
    if any(b <= a for a, b in itertools.pairwise(steps)):
        return f"a step of {percent:g}% or more (the later steps above it)"
    wider = plan.model_copy(update={"steps": tuple(steps)})
    again = estimate(wider, traffic).steps[step.index]
    if again.fits(deadline):
        return f"a step of {percent:g}% instead of {step.percent:g}%"
    return f"a step of more than {percent:g}%"


def plan_for_start(
    plan: RolloutPlan,
    measured: MeasuredTraffic | None,
    *,
    per_step_overhead_s: float,
    force: bool,
) -> tuple[RolloutPlan, PlanEstimateView | None]:
    """The plan a rollout starts with, and its estimate (None: none was made: the threshold
    judge, or no traffic measured; the plan's deadline or the default then applies).

    Raises ``PlanDoesNotFit`` (unless ``force``) when a step does not fit: 99.5% of healthy
    canaries would not pass it within the plan's deadline, or none can at this traffic."""
    if plan.judge != "sequential" or measured is None:
        return plan, None
    found = estimate(plan, measured.traffic, per_step_overhead_s=per_step_overhead_s)
    source = "plan"
    if plan.progress_deadline_s is None:
        source = "estimate"
        deadline = scaled_deadline_s(found, plan.deadline_s)
        if deadline is not None:
            plan = plan.model_copy(update={"progress_deadline_s": deadline})
            found = dataclasses.replace(found, deadline_s=deadline)
        else:
            found = dataclasses.replace(found, deadline_s=plan.deadline_s)
    misfits = found.too_slow
    if misfits and not force:
        raise PlanDoesNotFit(_refusal(plan, measured, found, misfits[0], source))
    return plan, _view(found, measured, source, forced=bool(misfits))


def _refusal(
    plan: RolloutPlan,
    measured: MeasuredTraffic,
    found: PlanEstimate,
    step: StepEstimate,
    source: str,
) -> str:
    traffic = measured.traffic
    seen = (
        f"at the {traffic.requests_per_s:.1f} req/s measured over the last "
        f"{measured.seconds:.0f} s (stable's error rate {traffic.error_rate:.2%})"
    )
    head = f"plan: {describe_step(step, len(plan.steps))}, {seen}"
    if step.seconds_to_pass_late is None:
        return f"{head}; the plan cannot promote a healthy canary here (--force starts it anyway)"
    longer = scaled_deadline_s(found, found.deadline_s)
    deadline_change = (
        f"progress_deadline_s: {longer:.0f}"
        + (" (or leave it out: the estimate sets it)" if source == "plan" else "")
        if longer is not None
        else "a longer progress_deadline_s"
    )
    return (
        f"{head}; the progress deadline is {found.deadline_s:.0f} s. Changes that fit: "
        f"{_larger_step(plan, traffic, step, found.deadline_s)}, or {deadline_change}. "
        "--force starts it anyway"
    )


def _view(
    found: PlanEstimate, measured: MeasuredTraffic, source: str, *, forced: bool
) -> PlanEstimateView:
    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    return PlanEstimateView(
        rps=round(measured.traffic.requests_per_s, 2),
        stable_error_rate=measured.traffic.error_rate,
        measured_s=round(measured.seconds, 1),
        steps=tuple(
            StepEstimateView(
                index=s.index,
                percent=s.percent,
                canary_rps=round(s.canary_per_s, 2),
                pass_s=seconds(s.seconds_to_pass),
                pass_late_s=seconds(s.seconds_to_pass_late),
                limiting=s.limiting,
                catch_s=seconds(s.seconds_to_catch),
                fits=s.fits(found.deadline_s),
            )
            for s in found.steps
        ),
        deadline_s=found.deadline_s,
        deadline_source=source,
        forced=forced,
    )


def estimate_note(estimated: PlanEstimateView | None, plan: RolloutPlan) -> str:
    """The start's estimate as one event message."""
    if estimated is None:
        why = (
            "the threshold judge decides per window"
            if plan.judge != "sequential"
            else "not enough traffic measured before the start"
        )
        return f"no estimate ({why}); progress deadline {plan.deadline_s:g} s"
    first = estimated.steps[0] if estimated.steps else None
    took = (
        f"step 1 passes a healthy canary in about {first.pass_s:.0f} s "
        f"({PASS_QUANTILE_TEXT} within {first.pass_late_s:.0f} s), set by {first.limiting}; "
        if first is not None and first.pass_s is not None and first.pass_late_s is not None
        else ""
    )
    return (
        f"at {estimated.rps:g} req/s: {took}progress deadline {estimated.deadline_s:g} s "
        f"(from the {estimated.deadline_source})"
        + ("; started with --force against the estimate" if estimated.forced else "")
    )


__all__ = [
    "MIN_TRAFFIC_REQUESTS",
    "TRAFFIC_LOOKBACK_S",
    "MeasuredTraffic",
    "describe_step",
    "estimate_note",
    "measured_traffic",
    "plan_for_start",
]
