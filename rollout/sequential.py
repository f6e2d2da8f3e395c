"""The sequential judge: evidence for and against the canary that stays valid however often it
is looked at, carried from window to window and from step to step.

Pure module: no clock, no I/O, no Ray. The state machine calls ``judge_sequential`` with each
fresh window and the evidence so far, and keeps the evidence it returns in the rollout's state
(so a restarted controller carries on with it).

The hypotheses are the plan's checks, each a statement about a rate:

- ``success_rate``: the canary's error rate is at most ``1 - success_rate_min``;
- ``p99_ceiling``: at most 1% of canary requests are slower than ``p99_max_ms`` (that is what
  "p99 <= ceiling" says);
- ``error_rate_vs_stable``: canary error rate <= ``error_rate_max_ratio`` x stable's, or at
  most ``error_rate_floor`` (either makes the canary acceptable);
- ``p99_vs_stable``: at most 1% of canary requests are slower than the limit
  ``max(p99_max_ratio x stable p99, stable p99 + p99_slack_ms)``.

Each is decided by two e-processes (nonnegative supermartingales under their null, so by
Ville's inequality the chance one *ever* crosses ``1/alpha`` is at most ``alpha``, whenever
and however often it is checked):

- against the canary (null: the hypothesis holds); crossing ``checks / alpha`` is FAIL. The
  checks share ``alpha`` (Bonferroni), so a canary that meets every hypothesis is rolled back
  by the judge in at most ``alpha`` of rollouts;
- for the canary (null: the canary is at or beyond the hypothesis' bound); crossing
  ``1 / beta`` shows non-inferiority. Every enabled check must show it for a PASS, so a canary
  that misses a hypothesis passes a step in at most ``beta`` of rollouts.

Neither crossed: INCONCLUSIVE (hold; the progress deadline bounds holding).

Evidence against the canary is kept over the whole rollout *and* restarted at each later
step: a canary that was healthy at 5% for a long time has driven the whole-rollout process far
below 1, so a regression that only shows at 50% (load, a cohort of users) would first have to
climb back. The value compared with ``checks / alpha`` is an average of e-processes fixed in
advance: half on the whole-rollout one, half shared equally by one process per later step
(started at that step, 1 before it, kept at its last value after it). An average of test
supermartingales is one, so Ville's inequality still holds for it; the price is a factor 2
on the whole-rollout process and ``2 (steps - 1)`` on a step's own.

The e-processes themselves, and what the rollout keeps of them, are in rollout.evidence; the
custom checks' verdicts in rollout.custom_judge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from rollout.analysis import (
    ERROR_RATE_VS_STABLE,
    P99_CEILING,
    P99_VS_STABLE,
    SAMPLE_SIZE,
    SUCCESS_RATE,
    CheckResult,
    CohortStats,
    Outcome,
    Verdict,
    WindowStats,
    quantile_from_buckets,
)
from rollout.custom_judge import judge_custom_counts, judge_custom_level
from rollout.evidence import (
    AGAINST_ODDS,
    FOR_ODDS,
    ROLLOUT_SHARE,
    CheckEvidence,
    JudgeLevels,
    RateEvidence,
    SequentialEvidence,
    check_result,
    fmt_e,
    pct,
    ratio,
)
from rollout.plan import AnalysisChecks, RolloutPlan

SAMPLE_RATIO: Final = "sample_ratio"

# The share of requests a "p99" hypothesis allows above its bound.
TAIL: Final = 0.01
# How far the stable reference quantile is moved for each side, in binomial standard errors
# of its rank (see _stable_reference), and how many of stable's requests at a step it takes
# before the relative latency check judges the canary's (z standard errors of the p99's rank
# are then at most 0.63%; see _p99_vs_stable).
REFERENCE_Z: Final = 2.0
REFERENCE_MIN_REQUESTS: Final = 1000


# --------------------------------------------------------------------------- histograms


def _finite_bounds(buckets: Mapping[float, float]) -> list[float]:
    return sorted(b for b in buckets if not math.isinf(b))


def slower_than(buckets: Mapping[float, float], limit: float) -> tuple[int, int]:
    """``(certainly, possibly)``: requests of a cumulative latency histogram (``le`` -> count,
    +Inf included) that are certainly / possibly slower than ``limit``.

    A bucket ``(lower, upper]`` holds requests certainly slower when ``lower >= limit`` and
    possibly slower when ``upper > limit``. The evidence against the canary counts only the
    certain ones and the evidence for it counts every possible one, so bucket boundaries only
    ever make either side slower to conclude, never wrong. Both agree when ``limit`` is a
    bucket bound; otherwise the requests of the one bucket that holds ``limit`` are undecided,
    which is why the router's bounds step by at most 1.1x where latencies of interest lie."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return 0, 0
    bounds = _finite_bounds(buckets)
    at_or_above = [b for b in bounds if b >= limit]
    at_or_below = [b for b in bounds if b <= limit]
    certainly = total - buckets[at_or_above[0]] if at_or_above else 0.0
    possibly = total - buckets[at_or_below[-1]] if at_or_below else total
    return round(max(certainly, 0.0)), round(max(possibly, 0.0))


def _latency_trials(canary: CohortStats, certainly: int, possibly: int) -> tuple[int, int, int]:
    """``(trials, certainly, possibly)`` for a latency check: the requests the histogram
    holds, plus the diverted ones (counted without a latency: possibly slower, never
    certainly). The request counter is not used: the router flushes it about once a second
    and PromQL extrapolates each series on its own, so in one window it may be ahead of or
    behind the histogram."""
    measured = round(canary.latency_buckets.get(math.inf, 0.0))
    diverted = canary.errors.get("diverted", 0)
    trials = measured + diverted
    return trials, min(certainly, trials), min(possibly + diverted, trials)


def _stable_reference(buckets: Mapping[float, float], side: int) -> float | None:
    """Stable's p99 from its histogram over the step so far, moved ``REFERENCE_Z`` standard
    errors of its rank up (``side`` +1, for the evidence against the canary) or down (-1, for
    it). Stable's p99 is itself measured; moving it to the cautious side of its uncertainty
    keeps each side's limit on its conservative side but for a few percent of the time (a
    one-sided normal bound of the rank: about 2.3% at z = 2), and then by a fraction of a
    bucket. The histogram is the step's, not the window's: evidence is added at every metrics
    export, and a few seconds of stable traffic would put the reference for the canary at
    stable's p97 or lower (z standard errors of a rank over 200 requests are 1.4%), where every
    canary request above it counts as possibly too slow and no evidence for the canary can
    grow. Over the step the rank's error shrinks as stable's requests accumulate."""
    n = buckets.get(math.inf, 0.0)
    if n <= 0:
        return None
    return quantile_from_buckets(reference_rank(n, side), buckets)


def reference_rank(requests: float, side: int) -> float:
    """The quantile of stable's latencies read as its p99 for one side (see
    _stable_reference), over ``requests`` of stable's."""
    spread = REFERENCE_Z * math.sqrt((1 - TAIL) * TAIL / requests)
    return min(1.0, max(0.5, 1 - TAIL + side * spread))


def _limit_from(reference_ms: float, checks: AnalysisChecks) -> float:
    assert checks.p99_max_ratio is not None
    return max(checks.p99_max_ratio * reference_ms, reference_ms + checks.p99_slack_ms)


def limit_for_canary(
    stable_buckets: Mapping[float, float],
    checks: AnalysisChecks,
    *,
    side: int,
    stable_requests: float | None = None,
) -> float | None:
    """The relative latency check's limit from stable's histogram: for the evidence against
    the canary (``side`` +1) or for it (-1), as placed after ``stable_requests`` of stable's
    (default: the histogram's own count). None: no stable latencies."""
    n = stable_requests or stable_buckets.get(math.inf, 0.0)
    if n <= 0:
        return None
    reference = quantile_from_buckets(reference_rank(n, side), stable_buckets)
    return None if reference is None else _limit_from(reference, checks)


# --------------------------------------------------------------------------- the judge
def _success_rate(
    ev: SequentialEvidence, canary: CohortStats, floor: float, levels: JudgeLevels
) -> CheckResult:
    check = ev.check(SUCCESS_RATE)
    allowed = 1 - floor
    check.update_against(0, canary.error_count, canary.requests, allowed)
    check.supporting[0].update(canary.error_count, canary.requests, allowed)
    check.add("errors", canary.error_count)
    check.add("requests", canary.requests)
    errors, requests = check.counts["errors"], check.counts["requests"]
    facts = (
        f"success rate: canary {pct(1 - ratio(errors, requests))} "
        f"({errors:.0f} errors in {requests:.0f}) vs floor {pct(floor)}"
    )
    return check_result(SUCCESS_RATE, check, levels, facts)


def _p99_ceiling(
    ev: SequentialEvidence, canary: CohortStats, ceiling_ms: float, levels: JudgeLevels
) -> CheckResult:
    check = ev.check(P99_CEILING)
    if canary.latency_buckets:
        trials, certainly, possibly = _latency_trials(
            canary, *slower_than(canary.latency_buckets, ceiling_ms)
        )
        check.update_against(0, certainly, trials, TAIL)
        check.supporting[0].update(possibly, trials, TAIL)
        check.add("slower", certainly)
        check.add("possibly_slower", possibly)
        check.add("requests", trials)
    facts = f"p99 ceiling: {_slower_text(check)} slower than {ceiling_ms:g} ms, {pct(TAIL)} allowed"
    return check_result(P99_CEILING, check, levels, facts)


def _slower_text(check: CheckEvidence) -> str:
    """The certainly slower requests (what counts against the canary) and, where bucket
    edges leave some undecided, the possibly slower ones (what counts for it)."""
    counts = check.counts
    slower, requests = counts.get("slower", 0.0), counts.get("requests", 0.0)
    possibly = counts.get("possibly_slower", slower)
    text = f"{pct(ratio(slower, requests))} of canary requests ({slower:.0f} in {requests:.0f})"
    if possibly > slower:
        text += f", {pct(ratio(possibly, requests))} possibly ({possibly:.0f}),"
    return text


def _errors_vs_stable(
    ev: SequentialEvidence,
    canary: CohortStats,
    stable: CohortStats,
    checks: AnalysisChecks,
    levels: JudgeLevels,
) -> CheckResult:
    """Two parts, either of which makes the canary acceptable:

    - ratio: given that an error happened, which cohort served it. With Poisson errors at
      rates ``r_c``, ``r_s`` over ``n_c``, ``n_s`` requests, an error is the canary's with
      probability ``r_c n_c / (r_c n_c + r_s n_s)``, at most ``k n_c / (k n_c + n_s)`` when
      ``r_c <= k r_s``. The bound comes from this window's own shares, so weight changes and
      uneven traffic are accounted for, and the stable's rate never has to be estimated;
    - floor: the canary's own error rate against ``error_rate_floor``.
    """
    assert checks.error_rate_max_ratio is not None
    check = ev.check(ERROR_RATE_VS_STABLE)
    k = checks.error_rate_max_ratio
    errors = canary.error_count + stable.error_count
    if errors and canary.requests and stable.requests:
        share = k * canary.requests / (k * canary.requests + stable.requests)
        check.update_against(0, canary.error_count, errors, share)
        check.supporting[0].update(canary.error_count, errors, share)
    floor = checks.error_rate_floor
    check.update_against(1, canary.error_count, canary.requests, floor)
    check.supporting[1].update(canary.error_count, canary.requests, floor)
    for name, value in (
        ("canary_errors", canary.error_count),
        ("canary_requests", canary.requests),
        ("stable_errors", stable.error_count),
        ("stable_requests", stable.requests),
    ):
        check.add(name, value)
    c = check.counts
    canary_rate = ratio(c["canary_errors"], c["canary_requests"])
    stable_rate = ratio(c["stable_errors"], c["stable_requests"])
    facts = (
        f"errors: canary {pct(canary_rate)} ({c['canary_errors']:.0f} in "
        f"{c['canary_requests']:.0f}) vs stable {pct(stable_rate)} ({c['stable_errors']:.0f} in "
        f"{c['stable_requests']:.0f}), allowed {k:g}x stable or {pct(floor)}"
    )
    return check_result(ERROR_RATE_VS_STABLE, check, levels, facts)


def _p99_vs_stable(
    ev: SequentialEvidence,
    canary: CohortStats,
    stable: CohortStats,
    checks: AnalysisChecks,
    min_requests: int,
    levels: JudgeLevels,
) -> CheckResult:
    """The canary's requests slower than ``ratio x`` stable's p99, against the 1% a p99
    allows. Stable's p99 is read from its histogram over the step (see _stable_reference).

    The two sides read it differently. Against the canary, every window is judged at once
    against the reference of its time, once stable has served ``min_requests`` at the step:
    a reference from few requests is moved *up* by its uncertainty (to stable's p99.5 or
    beyond), which only makes the evidence against the canary slower, never wrong, and a
    gross regression is still caught in seconds. For the canary, a reference from few
    requests is moved *down* (to stable's p97 or below), where a healthy canary's ordinary
    tail would count as possibly too slow and the evidence for it, once lost, does not come
    back: so the canary's latencies are held until stable's histogram holds
    ``REFERENCE_MIN_REQUESTS`` (or ``min_requests``, if more), then judged as one batch, and
    every later window at once. Judging held requests late is valid: the limit is drawn from
    stable's requests alone, which say nothing about the canary's, so given the limit the
    held counts are as likely under the null as if judged at once; and each side judges each
    request once."""
    check = ev.check(P99_VS_STABLE)
    reference = ev.stable_histogram()
    measured = reference.get(math.inf, 0.0)
    if canary.latency_buckets and measured >= min_requests:
        high = _stable_reference(reference, +1)
        if high is not None:
            certainly, _ = slower_than(canary.latency_buckets, _limit_from(high, checks))
            trials, certainly, _ = _latency_trials(canary, certainly, 0)
            check.update_against(0, certainly, trials, TAIL)
            check.add("slower", certainly)
            check.add("requests", trials)
            # The limit this window used against the canary: stable's p99 moved up.
            check.counts["limit_ms"] = _limit_from(high, checks)
    if canary.latency_buckets or canary.errors.get("diverted"):
        ev.hold_canary(canary)
    mature = measured >= max(min_requests, REFERENCE_MIN_REQUESTS)
    held = ev.release_canary() if mature else None
    if held is not None:
        low = _stable_reference(reference, -1)
        if low is not None:
            _, possibly = slower_than(held.latency_buckets, _limit_from(low, checks))
            trials, _, possibly = _latency_trials(held, 0, possibly)
            check.supporting[0].update(possibly, trials, TAIL)
            check.add("possibly_slower", possibly)
            # The limit for the canary: stable's p99 moved down.
            check.counts["limit_for_ms"] = _limit_from(low, checks)
    limit, limit_for = check.counts.get("limit_ms"), check.counts.get("limit_for_ms")
    rule = f"max({checks.p99_max_ratio:g}x stable p99, stable p99 + {checks.p99_slack_ms:g} ms)"
    if limit is None:
        limit_text = "a limit not measured yet"
    elif limit_for is None:
        limit_text = f"last {limit:.1f} ms"
    else:
        limit_text = f"last {limit:.1f} ms against the canary, {limit_for:.1f} ms for it"
    facts = (
        f"p99 vs stable: {_slower_text(check)} slower than {rule} ({limit_text}), "
        f"{pct(TAIL)} allowed"
    )
    return check_result(P99_VS_STABLE, check, levels, facts)


def _sample_ratio(
    ev: SequentialEvidence, window: WindowStats, canary_bp: int, tolerance: float, alpha: float
) -> CheckResult | None:
    """The guard: the canary's share of requests against its weight, within ``tolerance``
    (relative). Bucketing by user makes a share vary by which users fall under the weight, so
    only a departure beyond the tolerance counts; a broken split (routing, bucketing, or a
    cohort's metrics missing) soon does. None while it holds."""
    canary = window.canary.requests if window.canary else 0
    stable = window.stable.requests if window.stable else 0
    weight = canary_bp / 10_000
    if 0 < weight < 1 and canary + stable:
        ev.share_low.update(canary, canary + stable, weight * (1 - tolerance))
        high = weight * (1 + tolerance)
        if high < 1:
            ev.share_high.update(canary, canary + stable, high)
        ev.share_counts["canary"] = ev.share_counts.get("canary", 0.0) + canary
        ev.share_counts["total"] = ev.share_counts.get("total", 0.0) + canary + stable
        ev.share_counts["weight"] = weight
    if ev.e_mismatch < 1 / alpha:
        return None
    c = ev.share_counts
    return CheckResult(
        SAMPLE_RATIO,
        Outcome.INCONCLUSIVE,
        f"sample ratio mismatch: canary served {pct(ratio(c['canary'], c['total']))} of "
        f"{c['total']:.0f} requests at weight {pct(c['weight'])} (tolerance "
        f"{tolerance:.0%}); e-value {fmt_e(ev.e_mismatch)} >= {fmt_e(1 / alpha)}: the "
        f"comparison is biased, holding",
        evidence_against=ev.e_mismatch,
    )


def judged_checks(plan: RolloutPlan) -> int:
    """How many checks share ``alpha``: the enabled built-in ones and the custom counts
    checks that may act (an advisory check never fails a canary: it takes no share)."""
    return enabled_checks(plan.checks) + sum(
        1 for c in plan.custom_checks if c.counts and not c.advisory
    )


def enabled_checks(checks: AnalysisChecks) -> int:
    """How many checks share alpha: every enabled one, relative or not (a step without stable
    traffic skips the relative ones, but the rollout's other steps judge them)."""
    return sum(
        value is not None
        for value in (
            checks.success_rate_min,
            checks.p99_max_ms,
            checks.error_rate_max_ratio,
            checks.p99_max_ratio,
        )
    )


def judge_sequential(
    window: WindowStats,
    evidence: SequentialEvidence | None,
    plan: RolloutPlan,
    *,
    canary_bp: int,
    step_index: int,
) -> tuple[Verdict, SequentialEvidence]:
    """Add one window, judged at step ``step_index`` (0-based, of ``plan.steps``), to the
    evidence and judge. ``evidence`` is not modified; the updated copy is returned with the
    verdict.

    FAIL when any check's evidence against the canary crossed its bound (at once: no
    consecutive-window counter). Else INCONCLUSIVE when the sample-ratio guard tripped, or a
    cohort has served fewer than ``min_requests`` at this step (the sanity floor: evidence
    still counts, but a step does not pass on that few), or a check is undecided. Else PASS.

    A window may be as short as one metrics export: the evidence is valid however often it is
    looked at, so the controller adds each export as it arrives and acts as soon as a bound
    is crossed. What the cadence costs is latency, not validity: a decision waits for the
    export that carries its last request (Ray's report interval, 10 s by default, plus the
    router's 0.25 s flush). What the latency buckets cost is the requests that fall in the
    bucket holding a limit (see ``slower_than``)."""
    if evidence is not None:
        ev = evidence.copy()
    else:
        ev = SequentialEvidence(later_steps=max(0, len(plan.steps) - 1))
    ev.enter_step(step_index)
    ev.windows += 1
    checks = plan.checks
    relative = checks.needs_baseline and canary_bp < 10_000
    levels = JudgeLevels(alpha=plan.alpha, beta=plan.beta, checks=judged_checks(plan))
    canary = window.canary or CohortStats(0)
    stable = window.stable or CohortStats(0)
    ev.count_step(canary, stable)

    results: list[CheckResult] = []
    if checks.success_rate_min is not None:
        results.append(_success_rate(ev, canary, checks.success_rate_min, levels))
    if checks.p99_max_ms is not None:
        results.append(_p99_ceiling(ev, canary, checks.p99_max_ms, levels))
    if checks.error_rate_max_ratio is not None:
        if relative:
            results.append(_errors_vs_stable(ev, canary, stable, checks, levels))
        else:
            results.append(
                CheckResult(ERROR_RATE_VS_STABLE, Outcome.SKIPPED, "no stable traffic to compare")
            )
    if checks.p99_max_ratio is not None:
        if relative:
            results.append(_p99_vs_stable(ev, canary, stable, checks, plan.min_requests, levels))
        else:
            results.append(
                CheckResult(P99_VS_STABLE, Outcome.SKIPPED, "no stable traffic to compare")
            )

    for custom in plan.custom_checks:
        sample = window.custom.get(custom.name)
        if custom.counts:
            results.append(judge_custom_counts(ev, sample, custom, levels))
        else:
            results.append(judge_custom_level(ev, sample, custom))

    outcomes = {r.outcome for r in results if not r.advisory}
    if Outcome.FAIL in outcomes:
        return Verdict(Outcome.FAIL, tuple(results)), ev
    mismatch = _sample_ratio(ev, window, canary_bp, plan.sample_ratio_tolerance, plan.alpha)
    if mismatch is not None:
        return Verdict(Outcome.INCONCLUSIVE, (mismatch, *results)), ev
    served = ev.step_requests
    thin = [
        f"{name} served {served.get(name, 0.0):.0f} requests at this step, "
        f"{plan.min_requests} needed"
        for name, needed in (("canary", True), ("stable", relative))
        if needed and served.get(name, 0.0) < plan.min_requests
    ]
    if thin:
        floor = CheckResult(SAMPLE_SIZE, Outcome.INCONCLUSIVE, "; ".join(thin))
        return Verdict(Outcome.INCONCLUSIVE, (floor, *results)), ev
    if Outcome.INCONCLUSIVE in outcomes:
        return Verdict(Outcome.INCONCLUSIVE, tuple(results)), ev
    return Verdict(Outcome.PASS, tuple(results)), ev


__all__ = [
    "AGAINST_ODDS",
    "FOR_ODDS",
    "REFERENCE_MIN_REQUESTS",
    "ROLLOUT_SHARE",
    "SAMPLE_RATIO",
    "TAIL",
    "CheckEvidence",
    "RateEvidence",
    "SequentialEvidence",
    "enabled_checks",
    "judge_sequential",
    "judged_checks",
    "limit_for_canary",
    "slower_than",
]
