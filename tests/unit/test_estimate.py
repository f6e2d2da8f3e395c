"""The start-time estimate (rollout/estimate.py) against the judge it estimates: seeded
simulations of rollouts judged at every metrics export, as the controller judges them.

Each simulated step draws, per 5 s export, the requests of a service at a given rate (each to
the canary with the step's weight), their errors, and their latencies (lognormal, the same for
both cohorts unless a scenario slows the canary), and hands them to ``judge_sequential`` until
it decides. 80 rollouts per scenario: the median of 80 first-passage times is within about 10%
of its own value (the spread of these times is wide; see the estimate's docstring)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.telemetry import LATENCY_BOUNDARIES_MS
from rollout.analysis import CohortStats, Outcome, WindowStats
from rollout.estimate import PASS_QUANTILE, Traffic, estimate, scaled_deadline_s
from rollout.plan import RolloutPlan
from rollout.sequential import judge_sequential

BOUNDS = np.array(LATENCY_BOUNDARIES_MS, dtype=float)
EXPORT_S = 5
ROLLOUTS = 80


def histogram(latencies: np.ndarray) -> dict[float, float]:
    counts = np.searchsorted(np.sort(latencies), BOUNDS, side="right")
    out = {float(b): float(c) for b, c in zip(BOUNDS, counts, strict=True)}
    out[math.inf] = float(len(latencies))
    return out


def latencies(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    return rng.lognormal(math.log(40.0), 0.4, n) * scale


def cohort(rng: np.random.Generator, n: int, error_rate: float, scale: float = 1.0) -> CohortStats:
    errors = int(rng.binomial(n, error_rate)) if n else 0
    return CohortStats(
        n, {"error": errors} if errors else {}, latency_buckets=histogram(latencies(rng, n, scale))
    )


def traffic(rate: float, error_rate: float) -> Traffic:
    """What the controller would see of stable over five minutes before the start."""
    rng = np.random.default_rng(99)
    return Traffic(rate, error_rate, histogram(latencies(rng, int(rate * 300))))


def first_step_seconds(
    plan: RolloutPlan, rate: float, error_rate: float, canary_error_rate: float, scale: float,
    seed: int,
) -> tuple[Outcome, float]:  # fmt: skip
    """How one simulated first step ends, and after how many seconds."""
    rng = np.random.default_rng(seed)
    evidence = None
    canary_bp = plan.step_bp(0)
    for export in range(1, 100_000):
        total = int(rng.poisson(rate * EXPORT_S))
        n_canary = int(rng.binomial(total, canary_bp / 10_000))
        window = WindowStats(
            0.0,
            EXPORT_S,
            cohort(rng, n_canary, canary_error_rate, scale),
            cohort(rng, total - n_canary, error_rate),
        )
        verdict, evidence = judge_sequential(
            window, evidence, plan, canary_bp=canary_bp, step_index=0
        )
        if verdict.outcome is not Outcome.INCONCLUSIVE:
            return verdict.outcome, export * EXPORT_S
    raise AssertionError("undecided")


PLAN = RolloutPlan(steps=(10, 50, 100), min_requests=100)


@pytest.mark.parametrize(
    ("rate", "error_rate"),
    [(100.0, 0.002), (400.0, 0.005)],
    ids=["100rps-0.2pct", "400rps-0.5pct"],
)
def test_the_time_a_healthy_canary_takes_to_pass_matches_the_estimate(rate, error_rate):
    found = estimate(PLAN, traffic(rate, error_rate), per_step_overhead_s=EXPORT_S / 2)
    step = found.steps[0]
    assert step.seconds_to_pass is not None and step.seconds_to_pass_late is not None
    ended = [
        first_step_seconds(PLAN, rate, error_rate, error_rate, 1.0, seed)
        for seed in range(ROLLOUTS)
    ]
    assert all(outcome is Outcome.PASS for outcome, _ in ended)
    seconds = [s for _, s in ended]
    median = float(np.median(seconds))
    assert abs(median - step.seconds_to_pass) <= 0.3 * median, (median, step)
    # The late quantile is what a deadline must cover: nearly every simulated step is in.
    within = np.mean([s <= step.seconds_to_pass_late for s in seconds])
    assert within >= PASS_QUANTILE - 0.04, (within, step.seconds_to_pass_late, max(seconds))


def test_the_time_to_catch_a_regression_of_the_stated_size_matches_the_estimate():
    # The canary fails at twice the success-rate bound (4% against 98%), all else healthy:
    # the estimate's stated regression for that check.
    plan = RolloutPlan(
        steps=(10, 50, 100),
        min_requests=100,
        checks={"p99_max_ms": None, "error_rate_max_ratio": None, "p99_max_ratio": None},
    )
    rate = 200.0
    found = estimate(plan, traffic(rate, 0.002), per_step_overhead_s=EXPORT_S / 2)
    check = next(c for c in found.steps[0].checks if c.check == "success_rate")
    assert check.requests_to_catch is not None
    expected_s = check.requests_to_catch / (rate * 0.1) + EXPORT_S / 2
    ended = [first_step_seconds(plan, rate, 0.002, 0.04, 1.0, seed) for seed in range(ROLLOUTS)]
    assert all(outcome is Outcome.FAIL for outcome, _ in ended)
    median = float(np.median([s for _, s in ended]))
    assert abs(median - expected_s) <= 0.3 * median, (median, expected_s)


def test_a_step_no_healthy_canary_passes_within_its_deadline_is_named():
    slow = RolloutPlan(steps=(1, 50, 100), progress_deadline_s=300)
    found = estimate(slow, traffic(40.0, 0.002))
    assert [s.index for s in found.too_slow] == [0]
    assert found.steps[0].limiting in ("error_rate_vs_stable", "p99_vs_stable")
    deadline = scaled_deadline_s(found, 300)
    assert deadline is not None and deadline % 60 == 0
    assert deadline >= (found.steps[0].seconds_to_pass_late or math.inf)
    stretched = slow.model_copy(update={"progress_deadline_s": deadline})
    assert estimate(stretched, traffic(40.0, 0.002)).too_slow == []


def test_a_canary_like_a_stable_outside_the_bound_never_passes():
    # Stable itself fails 3% of requests: a canary like it misses the 98% success rate.
    found = estimate(PLAN, traffic(200.0, 0.03))
    assert found.steps[0].seconds_to_pass is None
    assert found.seconds_to_promote is None
    assert scaled_deadline_s(found, 600) is None
    assert [s.index for s in found.too_slow] == [0]


def test_later_steps_wait_only_for_their_sanity_floors():
    found = estimate(PLAN, traffic(200.0, 0.002))
    first, second, last = found.steps
    assert first.seconds_to_pass is not None and second.seconds_to_pass is not None
    assert second.seconds_to_pass < first.seconds_to_pass / 2
    assert second.limiting == "stable's p99 at this step"  # 1000 of stable's at 100 req/s
    assert second.seconds_to_pass == pytest.approx(1000 / 100)
    # At 100% there is no stable traffic: the relative checks are not judged there.
    assert {c.check for c in last.checks} == {"success_rate", "p99_ceiling"}
    assert last.limiting == "min_requests"
