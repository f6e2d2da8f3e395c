"""How far the current step has come toward its decision, for ``rollout status``.

Pure: read from the rollout's state. Each check's evidence is shown as the share of the way
its log e-value has climbed toward the bound that passes the canary (``ln e / ln(1/beta)``)
and toward the one that fails it; the step also waits for its sanity floor. The time left is
extrapolated at the canary's current rate: a check whose evidence has climbed a share ``p``
over ``n`` canary requests needs about ``n (1 - p) / p`` more (evidence grows about in
proportion to the requests); one whose evidence has not begun to climb takes what the start's
estimate said for the step, less the time spent.
"""

from __future__ import annotations

import math

from app.contracts import CheckProgressView, StepProgressView
from rollout.sequential import SAMPLE_RATIO, JudgeLevels, judged_checks
from rollout.state import Phase, RolloutState


def _share(value: float, bound: float) -> float:
    if value <= 1 or bound <= 1:
        return 0.0
    if math.isinf(value):
        return 1.0
    return min(1.0, math.log(value) / math.log(bound))


def step_progress(state: RolloutState, now: float) -> StepProgressView | None:
    """The current step's progress (None: no step judged by the sequential judge now)."""
    plan = state.plan
    if (
        plan.judge != "sequential"
        or state.phase not in (Phase.PROGRESSING, Phase.PAUSED)
        or state.step_index < 0
    ):
        return None
    levels = JudgeLevels(plan.alpha, plan.beta, judged_checks(plan))
    evidence = state.evidence
    checks = []
    if evidence is not None:
        for name, check in evidence.checks.items():
            if name == SAMPLE_RATIO:
                continue
            checks.append(
                CheckProgressView(
                    check=name,
                    toward_pass=_share(check.e_for, levels.pass_at),
                    toward_fail=_share(check.e_against, levels.fail_at),
                )
            )
    served = int(evidence.step_requests.get("canary", 0.0)) if evidence is not None else 0
    live_at = state.weights_live_at
    elapsed = now - live_at if live_at is not None else 0.0
    rate = served / elapsed if elapsed > 0 and served > 0 else None
    return StepProgressView(
        index=state.step_index,
        checks=tuple(checks),
        canary_requests=served,
        min_requests=plan.min_requests,
        canary_rps=None if rate is None else round(rate, 2),
        time_left_s=_time_left(state, checks, served, rate, elapsed),
    )


def _time_left(
    state: RolloutState,
    checks: list[CheckProgressView],
    served: int,
    rate: float | None,
    elapsed: float,
) -> float | None:
    if rate is None:
        return None
    evidence = state.evidence
    waits = [max(0.0, (state.plan.min_requests - served) / rate)]
    for check in checks:
        if check.toward_pass >= 1:
            continue
        counted = 0.0
        if evidence is not None:
            counts = evidence.checks[check.check].counts
            counted = counts.get("requests", counts.get("canary_requests", 0.0))
        if check.toward_pass > 0.05 and counted > 0:
            waits.append(counted * (1 - check.toward_pass) / check.toward_pass / rate)
            continue
        estimated = state.estimate
        step = (
            estimated.steps[state.step_index]
            if estimated is not None and state.step_index < len(estimated.steps)
            else None
        )
        if step is None or step.pass_s is None:
            return None
        waits.append(max(0.0, step.pass_s - elapsed))
    return round(max(waits), 1)


__all__ = ["step_progress"]
