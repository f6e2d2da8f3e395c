"""The judge: every check, the sample-size rule, missing data and the relative checks."""

from __future__ import annotations

import pytest

from rollout.analysis import (
    ERROR_RATE_VS_STABLE,
    P99_CEILING,
    P99_VS_STABLE,
    SAMPLE_SIZE,
    SUCCESS_RATE,
    CohortStats,
    Outcome,
    Verdict,
    WindowStats,
    judge,
)
from rollout.plan import AnalysisChecks

CHECKS = AnalysisChecks(
    success_rate_min=0.98,
    p99_max_ms=250.0,
    error_rate_max_ratio=3.0,
    error_rate_floor=0.01,
    p99_max_ratio=1.5,
    p99_slack_ms=5.0,
)
ONLY_ABSOLUTE = AnalysisChecks(error_rate_max_ratio=None, p99_max_ratio=None)


def cohort(requests: int = 1000, errors: int = 0, p99: float | None = 40.0) -> CohortStats:
    return CohortStats(requests, {"error": errors} if errors else {}, p50_ms=10.0, p99_ms=p99)


def run(
    canary: CohortStats | None,
    stable: CohortStats | None,
    checks: AnalysisChecks = CHECKS,
    **kwargs: bool,
) -> Verdict:
    return judge(WindowStats(0, 60, canary, stable), checks, min_requests=100, **kwargs)


def outcome_of(verdict: Verdict, name: str) -> Outcome:
    (result,) = [c for c in verdict.checks if c.name == name]
    return result.outcome


def test_a_healthy_window_passes_every_check_with_reasons() -> None:
    verdict = run(cohort(), cohort())
    assert verdict.outcome is Outcome.PASS
    assert [c.name for c in verdict.checks] == [
        SUCCESS_RATE,
        P99_CEILING,
        ERROR_RATE_VS_STABLE,
        P99_VS_STABLE,
    ]
    assert all(c.outcome is Outcome.PASS for c in verdict.checks)
    assert "canary success rate 100.00% >= floor 98.00%" in verdict.summary()


def test_success_rate_floor() -> None:
    # 2.5% errors: below the 98% floor (and over the 1% relative floor).
    verdict = run(cohort(1000, errors=25), cohort(1000, errors=10))
    assert verdict.outcome is Outcome.FAIL
    assert outcome_of(verdict, SUCCESS_RATE) is Outcome.FAIL
    assert "97.50% < floor 98.00% (25 errors (error=25) in 1000)" in verdict.summary()
    # Exactly at the floor passes.
    at_floor = run(cohort(1000, errors=20), cohort(1000, errors=10))
    assert outcome_of(at_floor, SUCCESS_RATE) is Outcome.PASS


def test_errors_are_summed_over_outcomes() -> None:
    canary = CohortStats(1000, {"timeout": 15, "error": 10, "unavailable": 0}, 10.0, 40.0)
    verdict = run(canary, cohort())
    assert outcome_of(verdict, SUCCESS_RATE) is Outcome.FAIL
    assert "25 errors (error=10, timeout=15)" in verdict.summary()


def test_p99_ceiling() -> None:
    verdict = run(cohort(p99=300.0), cohort(p99=290.0))
    assert verdict.outcome is Outcome.FAIL
    assert outcome_of(verdict, P99_CEILING) is Outcome.FAIL
    assert outcome_of(verdict, P99_VS_STABLE) is Outcome.PASS  # 300 <= 1.5 x 290
    assert "canary p99 300.0 ms > ceiling 250.0 ms" in verdict.reasons


def test_error_rate_relative_to_stable() -> None:
    # Stable 1% errors: the canary may have up to 3%.
    checks = AnalysisChecks(success_rate_min=None)
    assert run(cohort(1000, errors=30), cohort(1000, errors=10), checks).outcome is Outcome.PASS
    verdict = run(cohort(1000, errors=31), cohort(1000, errors=10), checks)
    assert verdict.outcome is Outcome.FAIL
    assert outcome_of(verdict, ERROR_RATE_VS_STABLE) is Outcome.FAIL
    assert "canary error rate 3.10% > allowed 3.00% (stable 1.00% x 3" in verdict.summary()


def test_zero_baseline_errors_do_not_make_one_canary_error_fatal() -> None:
    # Stable had no errors; 3 x 0 = 0, but the floor (1%) allows a few.
    verdict = run(cohort(500, errors=1), cohort(5000, errors=0))
    assert verdict.outcome is Outcome.PASS
    assert "allowed 1.00%" in verdict.summary()
    # Above the floor still fails.
    checks = AnalysisChecks(success_rate_min=None)
    over = run(cohort(500, errors=6), cohort(5000, errors=0), checks)
    assert outcome_of(over, ERROR_RATE_VS_STABLE) is Outcome.FAIL


def test_p99_relative_to_stable() -> None:
    assert run(cohort(p99=60.0), cohort(p99=40.0)).outcome is Outcome.PASS  # 1.5 x 40 = 60
    verdict = run(cohort(p99=61.0), cohort(p99=40.0))
    assert verdict.outcome is Outcome.FAIL
    assert outcome_of(verdict, P99_VS_STABLE) is Outcome.FAIL
    assert "canary p99 61.0 ms > allowed 60.0 ms (stable 40.0 ms x 1.5" in verdict.summary()


def test_p99_slack_keeps_jitter_on_a_fast_baseline_from_failing() -> None:
    # 2 ms baseline: 1.5x would be 3 ms; the 5 ms slack allows up to 7 ms.
    assert run(cohort(p99=7.0), cohort(p99=2.0)).outcome is Outcome.PASS
    assert run(cohort(p99=7.5), cohort(p99=2.0)).outcome is Outcome.FAIL


def test_too_few_canary_requests_is_inconclusive_never_a_failure() -> None:
    # Every request failed, but 20 requests prove nothing at min_requests=100.
    verdict = run(cohort(20, errors=20), cohort())
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.reasons == ("canary served 20 requests, 100 needed",)
    assert [c.name for c in verdict.checks] == [SAMPLE_SIZE]


def test_too_few_baseline_requests_is_inconclusive_when_relative_checks_are_on() -> None:
    verdict = run(cohort(), cohort(99))
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.reasons == ("stable served 99 requests, 100 needed",)
    # Without relative checks the baseline is not needed.
    assert run(cohort(), cohort(99), ONLY_ABSOLUTE).outcome is Outcome.PASS


def test_missing_cohorts_are_inconclusive() -> None:
    verdict = run(None, None)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert set(verdict.reasons) == {
        "no metrics for the canary cohort",
        "no metrics for the stable cohort",
    }
    assert run(cohort(), None, ONLY_ABSOLUTE).outcome is Outcome.PASS


def test_missing_latency_is_inconclusive_but_a_failure_still_wins() -> None:
    verdict = run(cohort(p99=None), cohort())
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert outcome_of(verdict, P99_CEILING) is Outcome.INCONCLUSIVE
    assert "no canary latency data" in verdict.reasons
    assert run(cohort(p99=40.0), cohort(p99=None)).reasons == ("no stable latency data",)
    failing = run(cohort(1000, errors=100, p99=None), cohort())
    assert failing.outcome is Outcome.FAIL


def test_relative_checks_are_skipped_when_no_baseline_traffic_is_expected() -> None:
    verdict = run(cohort(), CohortStats(0), baseline_expected=False)
    assert verdict.outcome is Outcome.PASS
    assert outcome_of(verdict, ERROR_RATE_VS_STABLE) is Outcome.SKIPPED
    assert outcome_of(verdict, P99_VS_STABLE) is Outcome.SKIPPED
    # The absolute checks still decide.
    slow = run(cohort(p99=400.0), CohortStats(0), baseline_expected=False)
    assert slow.outcome is Outcome.FAIL


def test_disabled_checks_are_not_run() -> None:
    checks = AnalysisChecks(success_rate_min=None, p99_max_ms=None, p99_max_ratio=None)
    verdict = run(cohort(), cohort(), checks)
    assert [c.name for c in verdict.checks] == [ERROR_RATE_VS_STABLE]


@pytest.mark.parametrize(
    ("requests", "errors"),
    [(-1, {}), (10, {"error": -1}), (10, {"error": 11})],
)
def test_impossible_counts_are_refused(requests: int, errors: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        CohortStats(requests, errors)
