"""How long each step of a plan will take under the sequential judge, before it starts.

Pure module: no clock, no I/O, no Ray. Given the traffic the controller sees now (the request
rate, stable's error rate and latency histogram) and a plan, it says for each step how many
canary requests, and so how many seconds, the judge needs

- to pass a healthy canary: one that behaves as stable does now (its error rate, its
  latencies), which is what an A/A rollout is: the typical time (the median) and the time
  by which 99.5% of healthy canaries pass;
- to catch a regression of the size the plan states: a canary whose rate is twice what a
  check allows (twice the error bound, twice the 1% a p99 bound allows beyond its limit).

The arithmetic is the judge's own (rollout.sequential): each check's evidence is the same
mixture of likelihood ratios over the same alternatives, fed with requests drawn at the
healthy (or regressed) rates, in 600 seeded runs per check; the estimate is the median of the
canary requests at which the evidence first reaches its level (``1 / beta`` to pass; ``checks
/ alpha`` to fail, twice that while only the first step is judged: the whole-rollout process
holds half of the evidence against), and the 99.5th percentile is what a progress deadline
must cover (a little beyond 99%: the checks' times are not independent of each other, and a
step passes only once all of them are in). A healthy canary's evidence counts rare events (an
error, a request near a latency limit), so the spread is wide: most rollouts pass well before
the mean, a few much later.
Wald's approximation, ``ln level / g`` with ``g`` the expected log likelihood ratio of one
request, sizes each run. Checks are run one by one (the judge passes a step when all are
in at once: the slowest check's times are the step's).

Evidence for the canary carries from step to step, so a later step needs only its sanity
floor (``min_requests``) and, for the relative latency check, the stable requests that place
stable's p99 at that step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from app.contracts import PASS_QUANTILE
from rollout.analysis import ERROR_RATE_VS_STABLE, P99_CEILING, P99_VS_STABLE, SUCCESS_RATE
from rollout.plan import RolloutPlan
from rollout.sequential import (
    AGAINST_ODDS,
    FOR_ODDS,
    REFERENCE_MIN_REQUESTS,
    ROLLOUT_SHARE,
    TAIL,
    judged_checks,
    limit_for_canary,
    slower_than,
)

# How a regression of the stated size is drawn: a canary whose rate is this many times what
# its check allows.
REGRESSION_FACTOR = 2.0


@dataclass(frozen=True)
class Traffic:
    """What the controller measured of the service before the start: all requests per
    second (both cohorts), stable's error rate and its cumulative latency histogram (``le``
    -> count, +Inf included)."""

    requests_per_s: float
    error_rate: float
    latency_buckets: Mapping[float, float]

    @property
    def requests(self) -> float:
        return self.latency_buckets.get(math.inf, 0.0)


@dataclass(frozen=True)
class CheckEstimate:
    """One check at the first step: canary requests to pass a healthy canary (the median
    and the ``PASS_QUANTILE`` quantile) and to catch a regression (the median); None: never
    at this traffic (a canary like stable is not inside the bound)."""

    check: str
    requests_to_pass: float | None
    requests_to_pass_late: float | None
    requests_to_catch: float | None
    # The healthy canary's rate and the bound it is judged against (for the explanation).
    healthy_rate: float
    bound: float


@dataclass(frozen=True)
class StepEstimate:
    index: int
    percent: float
    canary_per_s: float
    # A healthy canary passes the step in about this long (the median), and 99.5% of them
    # within ``seconds_to_pass_late``; None: it cannot pass at this traffic.
    seconds_to_pass: float | None
    seconds_to_pass_late: float | None
    limiting: str  # what sets seconds_to_pass: a check or a sanity floor
    seconds_to_catch: float | None  # the slowest check to catch its stated regression
    checks: tuple[CheckEstimate, ...]

    def fits(self, deadline_s: float) -> bool:
        late = self.seconds_to_pass_late
        return late is not None and late <= deadline_s


@dataclass(frozen=True)
class PlanEstimate:
    traffic: Traffic
    steps: tuple[StepEstimate, ...]
    deadline_s: float

    @property
    def too_slow(self) -> list[StepEstimate]:
        """The steps that not every healthy canary (``PASS_QUANTILE`` of them) passes within
        the progress deadline."""
        return [s for s in self.steps if not s.fits(self.deadline_s)]

    @property
    def seconds_to_promote(self) -> float | None:
        if any(s.seconds_to_pass is None for s in self.steps):
            return None
        return sum(s.seconds_to_pass or 0.0 for s in self.steps)


def scaled_deadline_s(found: PlanEstimate, at_least_s: float) -> float | None:
    """The progress deadline of a plan that leaves it to the estimate: the time by which
    ``PASS_QUANTILE`` of healthy canaries pass the slowest step, never below ``at_least_s``,
    rounded up to a whole minute. None: a healthy canary cannot pass some step at this
    traffic."""
    late = [s.seconds_to_pass_late for s in found.steps]
    if any(s is None for s in late):
        return None
    return max(at_least_s, 60.0 * math.ceil(max(s or 0.0 for s in late) / 60.0))


# --------------------------------------------------------------------------- first passage

RUNS = 600  # seeded runs per check (the 99.5th percentile is the 3rd latest)
BATCHES = 400  # batches of requests per run
_SEED = 20261207


@dataclass(frozen=True)
class Passage:
    """Canary requests at which a check's evidence first reached its level: the median and
    the ``PASS_QUANTILE`` quantile of the runs (None: not within the runs' horizon, which is
    many times what the evidence's expected growth needs)."""

    median: float | None
    late: float | None


def _odds_terms(bound: float, odds: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Per alternative, the log likelihood ratio of a hit and of a miss against ``bound``."""
    bound = min(max(bound, 1e-12), 1 - 1e-12)
    alt = np.array([phi * bound / (1 - bound + phi * bound) for phi in odds])
    with np.errstate(divide="ignore"):
        hit = np.log(alt / bound)
    return hit, np.log((1 - alt) / (1 - bound))


def _drift(rate: float, bound: float, odds: Sequence[float]) -> float:
    """The best alternative's expected log likelihood ratio per trial."""
    hit, miss = _odds_terms(bound, odds)
    with np.errstate(invalid="ignore"):
        drift = np.where(
            np.isinf(hit), np.where(rate > 0, -np.inf, miss), rate * hit + (1 - rate) * miss
        )
    return float(np.max(drift))


def _log_mixture(
    hits: np.ndarray, trials: np.ndarray, bound: float, odds: Sequence[float]
) -> np.ndarray:
    """The log of the judge's mixture for cumulative ``hits`` out of ``trials`` (any shape)."""
    hit, miss = _odds_terms(bound, odds)
    h = hits[..., None]
    with np.errstate(invalid="ignore"):
        terms = np.where(h > 0, h * hit, 0.0) + (trials[..., None] - h) * miss
    top = np.max(terms, axis=-1)
    safe = np.where(np.isfinite(top), top, 0.0)
    total = np.sum(np.exp(terms - safe[..., None]), axis=-1)
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(top), safe + np.log(total), -np.inf) - math.log(len(odds))


def _passage(reached: np.ndarray, requests: np.ndarray) -> Passage:
    """``reached``: (batches, runs) booleans; ``requests``: canary requests per batch end."""
    first = np.where(reached.any(axis=0), reached.argmax(axis=0), -1)
    times = np.where(first >= 0, requests[np.maximum(first, 0)], np.inf)

    def quantile(q: float) -> float | None:
        value = float(np.quantile(times, q))
        return None if math.isinf(value) else value

    return Passage(quantile(0.5), quantile(PASS_QUANTILE))


def _horizon(expected_requests: float) -> tuple[int, np.ndarray]:
    """Batch size and the canary requests at each batch's end for runs long enough to see
    nearly every run reach its level: many times the expected requests."""
    horizon = max(40.0, 40 * expected_requests)
    batch = max(1, math.ceil(horizon / BATCHES))
    return batch, batch * np.arange(1, BATCHES + 1, dtype=float)


def _rate_passage(rate: float, bound: float, odds: Sequence[float], level: float) -> Passage:
    """One rate against its bound, as the judge's success-rate and latency checks are."""
    drift = _drift(rate, bound, odds)
    if drift <= 0:
        return Passage(None, None)
    batch, requests = _horizon(math.log(level * len(odds)) / drift)
    rng = np.random.default_rng(_SEED)
    hits = np.cumsum(rng.binomial(batch, rate, size=(BATCHES, RUNS)), axis=0).astype(float)
    log_e = _log_mixture(hits, requests[:, None] * np.ones(RUNS), bound, odds)
    return _passage(log_e >= math.log(level), requests)


def _rate_check(
    name: str, healthy: float, bound: float, pass_at: float, fail_at: float
) -> CheckEstimate:
    bad = min(REGRESSION_FACTOR * bound, 1.0)
    passing = _rate_passage(healthy, bound, FOR_ODDS, pass_at)
    catching = _rate_passage(bad, bound, AGAINST_ODDS, fail_at)
    return CheckEstimate(name, passing.median, passing.late, catching.median, healthy, bound)


def _slower_share(buckets: Mapping[float, float], limit: float) -> float:
    """Share of requests possibly slower than ``limit``: what counts against a pass."""
    total = buckets.get(math.inf, 0.0)
    return slower_than(buckets, limit)[1] / total if total > 0 else 0.0


def _p99_vs_stable(
    buckets: Mapping[float, float],
    plan: RolloutPlan,
    weight: float,
    pass_at: float,
    fail_at: float,
) -> CheckEstimate:
    """The relative latency check for a canary whose latencies are stable's: its share
    possibly slower than the limit the judge uses for it, which tightens as stable's
    requests at the step accumulate (``REFERENCE_MIN_REQUESTS`` at first; a few fixed-point
    rounds find the count at the time the check passes)."""
    stable_requests = float(max(plan.min_requests, REFERENCE_MIN_REQUESTS))
    found = _rate_check(P99_VS_STABLE, 1.0, TAIL, pass_at, fail_at)
    for _ in range(4):
        limit = limit_for_canary(buckets, plan.checks, side=-1, stable_requests=stable_requests)
        healthy = _slower_share(buckets, limit) if limit is not None else 1.0
        if healthy == found.healthy_rate:
            break  # the limit moved within its bucket: nothing changes
        found = _rate_check(P99_VS_STABLE, healthy, TAIL, pass_at, fail_at)
        if found.requests_to_pass is None:
            break
        stable_requests = max(stable_requests, found.requests_to_pass * (1 - weight) / weight)
    return found


def _error_vs_stable(
    traffic: Traffic, plan: RolloutPlan, weight: float, pass_at: float, fail_at: float
) -> CheckEstimate:
    """Two parts fed by the same errors: the ratio (each error a trial, the canary's with its
    share of the errors, allowed the share ``error_rate_max_ratio`` x stable's rate would give
    it) and the floor (the canary's errors against ``error_rate_floor``). The judge passes
    the canary on the mean of the parts' evidence and fails it when both parts do."""
    checks = plan.checks
    assert checks.error_rate_max_ratio is not None
    k, floor, p = checks.error_rate_max_ratio, checks.error_rate_floor, traffic.error_rate
    share = k * weight / (k * weight + 1 - weight)
    stable_per_canary = (1 - weight) / weight

    def run(canary_rate: float, odds: Sequence[float], level: float, passing: bool) -> Passage:
        drifts = [
            _drift(canary_rate, floor, odds),
            _drift(
                canary_rate / (canary_rate + p * stable_per_canary) if canary_rate else 0.0,
                share,
                odds,
            )
            * (canary_rate + p * stable_per_canary),
        ]
        useful = [d for d in drifts if d > 0]
        if not useful if passing else len(useful) < 2:
            return Passage(None, None)
        growth = max(useful) if passing else min(useful)
        batch, requests = _horizon(math.log(2 * level * len(odds)) / growth)
        rng = np.random.default_rng(_SEED)
        canary = np.cumsum(rng.binomial(batch, canary_rate, size=(BATCHES, RUNS)), axis=0)
        stable = np.cumsum(rng.poisson(batch * stable_per_canary * p, size=(BATCHES, RUNS)), axis=0)
        trials = requests[:, None] * np.ones(RUNS)
        by_floor = _log_mixture(canary.astype(float), trials, floor, odds)
        by_ratio = _log_mixture(canary.astype(float), (canary + stable).astype(float), share, odds)
        if passing:
            reached = np.logaddexp(by_floor, by_ratio) - math.log(2) >= math.log(level)
        else:
            reached = np.minimum(by_floor, by_ratio) >= math.log(level)
        return _passage(reached, requests)

    bad = min(REGRESSION_FACTOR * max(k * p, floor), 1.0)
    passing = run(p, FOR_ODDS, pass_at, passing=True)
    catching = run(bad, AGAINST_ODDS, fail_at, passing=False)
    return CheckEstimate(
        ERROR_RATE_VS_STABLE, passing.median, passing.late, catching.median, p, max(k * p, floor)
    )


# --------------------------------------------------------------------------- the plan


def estimate(
    plan: RolloutPlan, traffic: Traffic, *, per_step_overhead_s: float = 0.0
) -> PlanEstimate:
    """The time each step of ``plan`` needs at ``traffic`` (see the module docstring).
    ``per_step_overhead_s``: what every step costs besides evidence (the router confirming
    the weights, the wait for their first export)."""
    checks = plan.checks
    pass_at = 1 / plan.beta
    share_against = ROLLOUT_SHARE if len(plan.steps) > 1 else 1.0
    fail_at = judged_checks(plan) / plan.alpha / share_against
    buckets = traffic.latency_buckets
    steps = []
    for index, percent in enumerate(plan.steps):
        weight = percent / 100
        canary_per_s = traffic.requests_per_s * weight
        stable_per_s = traffic.requests_per_s * (1 - weight)
        relative = checks.needs_baseline and weight < 1
        found: list[CheckEstimate] = []
        if checks.success_rate_min is not None:
            bound = 1 - checks.success_rate_min
            found.append(_rate_check(SUCCESS_RATE, traffic.error_rate, bound, pass_at, fail_at))
        if checks.p99_max_ms is not None:
            healthy = _slower_share(buckets, checks.p99_max_ms)
            found.append(_rate_check(P99_CEILING, healthy, TAIL, pass_at, fail_at))
        if relative and checks.error_rate_max_ratio is not None:
            found.append(_error_vs_stable(traffic, plan, weight, pass_at, fail_at))
        if relative and checks.p99_max_ratio is not None:
            found.append(_p99_vs_stable(buckets, plan, weight, pass_at, fail_at))

        def per_s(requests: float | None, rate: float) -> float:
            return math.inf if requests is None or rate <= 0 else requests / rate

        # Sanity floors: every step waits for them (seconds, the same median or late).
        floors = {"min_requests": per_s(plan.min_requests, canary_per_s)}
        if relative:
            floors["min_requests (stable)"] = per_s(plan.min_requests, stable_per_s)
            if checks.p99_max_ratio is not None:
                wanted = max(plan.min_requests, REFERENCE_MIN_REQUESTS)
                floors["stable's p99 at this step"] = per_s(wanted, stable_per_s)
        typical, late = dict(floors), dict(floors)
        if index == 0:  # later steps carry the evidence on
            for check in found:
                typical[check.check] = per_s(check.requests_to_pass, canary_per_s)
                late[check.check] = per_s(check.requests_to_pass_late, canary_per_s)
        limiting = max(typical, key=lambda name: typical[name])
        seconds, seconds_late = typical[limiting], max(late.values())
        catch = [per_s(c.requests_to_catch, canary_per_s) for c in found]
        slowest_catch = max(catch, default=math.inf)
        steps.append(
            StepEstimate(
                index=index,
                percent=percent,
                canary_per_s=canary_per_s,
                seconds_to_pass=None if math.isinf(seconds) else seconds + per_step_overhead_s,
                seconds_to_pass_late=(
                    None if math.isinf(seconds_late) else seconds_late + per_step_overhead_s
                ),
                limiting=limiting,
                seconds_to_catch=(
                    None if math.isinf(slowest_catch) else slowest_catch + per_step_overhead_s
                ),
                checks=tuple(found),
            )
        )
    return PlanEstimate(traffic, tuple(steps), plan.deadline_s)


__all__ = [
    "PASS_QUANTILE",
    "REGRESSION_FACTOR",
    "CheckEstimate",
    "PlanEstimate",
    "StepEstimate",
    "Traffic",
    "estimate",
    "scaled_deadline_s",
]
