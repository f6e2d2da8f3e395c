"""The sequential judge's verdicts on a plan's custom checks (rollout.plan.CustomCheck): the
team's own signals, read from Prometheus per cohort (rollout/custom_checks.py).

Pure module. A counts check is decided with the same evidence as the built-in rate checks
(rollout.evidence), sharing ``alpha`` with them unless advisory; a level check is a gate, with
no evidence to carry but its run of evaluations out of bounds. An advisory check's result is
marked so: shown and exported, never deciding.
"""

from __future__ import annotations

import dataclasses

from rollout.analysis import CheckResult, CustomSample, Outcome
from rollout.evidence import JudgeLevels, SequentialEvidence, check_result, pct, ratio
from rollout.plan import CustomCheck


def judge_custom_counts(
    ev: SequentialEvidence, sample: CustomSample | None, check: CustomCheck, levels: JudgeLevels
) -> CheckResult:
    """A custom counts check: the canary's events per trial against ``max_rate``, decided as
    the success rate is. PromQL's ``increase`` extrapolates, so counts arrive as decimals:
    rounded (events never above trials)."""
    assert check.max_rate is not None
    evidence = ev.check(check.name)
    trials = round(sample.trials.get("canary", 0)) if sample is not None else 0
    if sample is not None and trials > 0:
        events = min(max(round(sample.events.get("canary", 0)), 0), trials)
        evidence.update_against(0, events, trials, check.max_rate)
        evidence.supporting[0].update(events, trials, check.max_rate)
        evidence.add("events", events)
        evidence.add("trials", trials)
    seen_events = evidence.counts.get("events", 0.0)
    seen_trials = evidence.counts.get("trials", 0.0)
    facts = (
        f"{check.name}{' (advisory)' if check.advisory else ''}: canary "
        f"{pct(ratio(seen_events, seen_trials))} ({seen_events:.0f} in {seen_trials:.0f}) vs "
        f"at most {pct(check.max_rate)}"
    )
    return dataclasses.replace(
        check_result(check.name, evidence, levels, facts), advisory=check.advisory
    )


def judge_custom_level(
    ev: SequentialEvidence, sample: CustomSample | None, check: CustomCheck
) -> CheckResult:
    """A custom level check, a gate: the canary's value within ``min``/``max`` passes this
    evaluation; out of them it holds the step, and ``failure_limit`` evaluations out of them
    in a row fail the canary. No data for the canary holds too (and breaks no run)."""
    value = sample.value.get("canary") if sample is not None else None
    label = f"{check.name}{' (advisory)' if check.advisory else ''}"
    bounds = " and ".join(
        part
        for part in (
            None if check.min is None else f"at least {check.min:g}",
            None if check.max is None else f"at most {check.max:g}",
        )
        if part
    )
    if value is None:
        return CheckResult(
            check.name,
            Outcome.INCONCLUSIVE,
            f"{label}: no value for the canary",
            advisory=check.advisory,
        )
    inside = (check.max is None or value <= check.max) and (check.min is None or value >= check.min)
    failures = 0 if inside else ev.gate_failures.get(check.name, 0) + 1
    ev.gate_failures[check.name] = failures
    stable = sample.value.get("stable") if sample is not None else None
    seen = f"canary {value:g}" + ("" if stable is None else f" (stable {stable:g})")
    if inside:
        outcome, tail = Outcome.PASS, "within"
    else:
        outcome = Outcome.FAIL if failures >= check.failure_limit else Outcome.INCONCLUSIVE
        tail = f"out of bounds {failures} time(s) in a row ({check.failure_limit} fail it)"
    return CheckResult(
        check.name, outcome, f"{label}: {seen}, {bounds}: {tail}", advisory=check.advisory
    )


__all__ = ["judge_custom_counts", "judge_custom_level"]
