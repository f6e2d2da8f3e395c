"""The judge: one analysis window of canary and stable statistics in, a verdict out.

Pure module: plain dataclasses, no clock, no I/O. The metrics reader (rollout/metrics.py)
produces ``WindowStats`` for a window; the state machine calls ``judge`` and decides what a
verdict means for the rollout (hold, count a failure, advance).

Rules:
- A cohort that served fewer than ``min_requests`` in the window makes the window
  inconclusive; so does a missing cohort. The stable cohort is only needed when a relative
  check is enabled and the baseline is expected to carry traffic. Too little data is never a
  failure.
- A check whose input is missing (no latency recorded) is inconclusive, not failed.
- Verdict: fail if any check failed, else inconclusive if any check was inconclusive, else pass.
- ``errors`` counts failed answers by outcome (e.g. ``error``, ``timeout``, ``unavailable``).
  Client mistakes (422) are not failures of the model and must not be passed in as errors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from app.divergence import DivergenceSums
from rollout.plan import AnalysisChecks


class Outcome(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"  # a check that does not apply to this window (no baseline traffic)


@dataclass(frozen=True)
class CohortStats:
    """One cohort's traffic in one window. Latencies are end-to-end, in milliseconds;
    ``latency_buckets`` is the window's latency histogram as Prometheus keeps it (upper bound
    ``le`` -> cumulative count, +Inf included), empty when the source gives none."""

    requests: int
    errors: Mapping[str, int] = field(default_factory=dict)
    p50_ms: float | None = None
    p99_ms: float | None = None
    latency_buckets: Mapping[float, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.requests < 0 or any(count < 0 for count in self.errors.values()):
            raise ValueError("request and error counts are never negative")
        if self.error_count > self.requests:
            raise ValueError(f"{self.error_count} errors out of {self.requests} requests")

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float | None:
        return self.error_count / self.requests if self.requests else None

    def describe_errors(self) -> str:
        if not self.error_count:
            return "no errors"
        by_outcome = ", ".join(f"{name}={n}" for name, n in sorted(self.errors.items()) if n)
        return f"{self.error_count} errors ({by_outcome})"


@dataclass(frozen=True)
class ShadowStats(DivergenceSums):
    """Mirrored copies in one window (the shadow phase): sums over the compared ones of their
    rank-biased overlap, top-k overlap and top-1 changes (app/divergence.py), the p99 of their
    largest score difference, and the copies dropped (no room in flight) or unanswered."""

    compared: int = 0
    rbo_sum: float = 0.0
    overlap_sum: float = 0.0
    top1_changed: float = 0.0
    max_score_diff_p99: float | None = None
    dropped: int = 0
    errors: int = 0

    def __post_init__(self) -> None:
        if min(self.compared, self.dropped, self.errors) < 0:
            raise ValueError("copy counts are never negative")


@dataclass(frozen=True)
class CustomSample:
    """A custom check's reading over a window, per cohort: counts (``events`` out of
    ``trials``) or a level (``value``); a cohort the query had no data for is absent."""

    events: Mapping[str, int] = field(default_factory=dict)
    trials: Mapping[str, int] = field(default_factory=dict)
    value: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowStats:
    """Both cohorts over the same window ``[start, end)`` (seconds, the controller's clock).
    A cohort is None when the metrics source has no series for it at all. ``shadow`` holds
    the mirrored comparisons by the canary artifact that answered them; ``shadow_outcomes``
    the copies by outcome ("compared", "dropped", "error")."""

    start: float
    end: float
    canary: CohortStats | None
    stable: CohortStats | None
    shadow: Mapping[str, ShadowStats] = field(default_factory=dict)
    shadow_outcomes: Mapping[str, int] = field(default_factory=dict)
    custom: Mapping[str, CustomSample] = field(default_factory=dict)  # by check name

    def shadow_of(self, artifact_id: str) -> ShadowStats | None:
        """The candidate's comparisons with the window's dropped and unanswered copies (None:
        no copy at all)."""
        found = self.shadow.get(artifact_id)
        dropped = int(self.shadow_outcomes.get("dropped", 0))
        errors = int(self.shadow_outcomes.get("error", 0))
        if found is None and not dropped and not errors:
            return None
        base = found or ShadowStats()
        return dataclasses.replace(base, dropped=dropped, errors=errors)

    @property
    def duration_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CheckResult:
    """One check's result. The sequential judge also gives its e-values: the evidence against
    the canary and for it (None from the threshold judge)."""

    name: str
    outcome: Outcome
    reason: str
    evidence_against: float | None = None
    evidence_for: float | None = None
    advisory: bool = False  # shown, never deciding (a custom check with advisory: true)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    checks: tuple[CheckResult, ...]

    @property
    def reasons(self) -> tuple[str, ...]:
        """The reasons that decided the outcome (every check's on a pass)."""
        if self.outcome is Outcome.PASS:
            return tuple(c.reason for c in self.checks)
        return tuple(c.reason for c in self.checks if c.outcome is self.outcome and not c.advisory)

    def summary(self) -> str:
        return f"{self.outcome.value}: " + "; ".join(self.reasons)


# Names of the checks, as they appear in CheckResult.name.
SAMPLE_SIZE = "sample_size"
SUCCESS_RATE = "success_rate"
P99_CEILING = "p99_ceiling"
ERROR_RATE_VS_STABLE = "error_rate_vs_stable"
P99_VS_STABLE = "p99_vs_stable"


def quantile_from_buckets(q: float, buckets: Mapping[float, float]) -> float | None:
    """``histogram_quantile``: linear interpolation inside the bucket holding rank q*count.

    ``buckets`` maps upper bound (``le``, +Inf included) to cumulative count.
    """
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0 or not math.isinf(bounds[-1]):
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                # Beyond the largest finite bound: report that bound, as Prometheus does.
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _pct(rate: float) -> str:
    return f"{rate * 100:.2f}%"


def _sample_size(
    cohort_name: str, stats: CohortStats | None, min_requests: int
) -> CheckResult | None:
    """None when the cohort has enough requests; otherwise the inconclusive result."""
    if stats is None:
        return CheckResult(
            SAMPLE_SIZE, Outcome.INCONCLUSIVE, f"no metrics for the {cohort_name} cohort"
        )
    if stats.requests < min_requests:
        return CheckResult(
            SAMPLE_SIZE,
            Outcome.INCONCLUSIVE,
            f"{cohort_name} served {stats.requests} requests, {min_requests} needed",
        )
    return None


def _success_rate(canary: CohortStats, floor: float) -> CheckResult:
    rate = 1 - canary.error_count / canary.requests
    ok = rate >= floor
    relation = ">=" if ok else "<"
    return CheckResult(
        SUCCESS_RATE,
        Outcome.PASS if ok else Outcome.FAIL,
        f"canary success rate {_pct(rate)} {relation} floor {_pct(floor)} "
        f"({canary.describe_errors()} in {canary.requests})",
    )


def _p99_ceiling(canary: CohortStats, ceiling_ms: float) -> CheckResult:
    if canary.p99_ms is None:
        return CheckResult(P99_CEILING, Outcome.INCONCLUSIVE, "no canary latency data")
    ok = canary.p99_ms <= ceiling_ms
    return CheckResult(
        P99_CEILING,
        Outcome.PASS if ok else Outcome.FAIL,
        f"canary p99 {canary.p99_ms:.1f} ms {'<=' if ok else '>'} ceiling {ceiling_ms:.1f} ms",
    )


def allowed_error_rate(stable_rate: float, checks: AnalysisChecks) -> float:
    assert checks.error_rate_max_ratio is not None
    return max(checks.error_rate_max_ratio * stable_rate, checks.error_rate_floor)


def allowed_p99_ms(stable_p99_ms: float, checks: AnalysisChecks) -> float:
    assert checks.p99_max_ratio is not None
    return max(checks.p99_max_ratio * stable_p99_ms, stable_p99_ms + checks.p99_slack_ms)


def _error_rate_vs_stable(
    canary: CohortStats, stable: CohortStats, checks: AnalysisChecks
) -> CheckResult:
    canary_rate = canary.error_count / canary.requests
    stable_rate = stable.error_count / stable.requests
    allowed = allowed_error_rate(stable_rate, checks)
    ok = canary_rate <= allowed
    return CheckResult(
        ERROR_RATE_VS_STABLE,
        Outcome.PASS if ok else Outcome.FAIL,
        f"canary error rate {_pct(canary_rate)} {'<=' if ok else '>'} allowed {_pct(allowed)} "
        f"(stable {_pct(stable_rate)} x {checks.error_rate_max_ratio:g}, "
        f"floor {_pct(checks.error_rate_floor)})",
    )


def _p99_vs_stable(canary: CohortStats, stable: CohortStats, checks: AnalysisChecks) -> CheckResult:
    if canary.p99_ms is None or stable.p99_ms is None:
        missing = "canary" if canary.p99_ms is None else "stable"
        return CheckResult(P99_VS_STABLE, Outcome.INCONCLUSIVE, f"no {missing} latency data")
    allowed = allowed_p99_ms(stable.p99_ms, checks)
    ok = canary.p99_ms <= allowed
    return CheckResult(
        P99_VS_STABLE,
        Outcome.PASS if ok else Outcome.FAIL,
        f"canary p99 {canary.p99_ms:.1f} ms {'<=' if ok else '>'} allowed {allowed:.1f} ms "
        f"(stable {stable.p99_ms:.1f} ms x {checks.p99_max_ratio:g}, "
        f"slack {checks.p99_slack_ms:g} ms)",
    )


def _combine(results: list[CheckResult]) -> Verdict:
    outcomes = {r.outcome for r in results}
    if Outcome.FAIL in outcomes:
        overall = Outcome.FAIL
    elif Outcome.INCONCLUSIVE in outcomes:
        overall = Outcome.INCONCLUSIVE
    else:
        overall = Outcome.PASS
    return Verdict(overall, tuple(results))


def judge(
    window: WindowStats,
    checks: AnalysisChecks,
    *,
    min_requests: int,
    baseline_expected: bool = True,
) -> Verdict:
    """Judge one window. ``baseline_expected`` is False when the stable cohort carries no
    traffic by design (a step at 100%); relative checks are then skipped, not inconclusive."""
    relative = checks.needs_baseline and baseline_expected
    too_little = [
        result
        for result in (
            _sample_size("canary", window.canary, min_requests),
            _sample_size("stable", window.stable, min_requests) if relative else None,
        )
        if result is not None
    ]
    if too_little:
        return Verdict(Outcome.INCONCLUSIVE, tuple(too_little))

    canary = window.canary
    assert canary is not None  # sample size checked above
    results: list[CheckResult] = []
    if checks.success_rate_min is not None:
        results.append(_success_rate(canary, checks.success_rate_min))
    if checks.p99_max_ms is not None:
        results.append(_p99_ceiling(canary, checks.p99_max_ms))
    relative_checks = [
        (ERROR_RATE_VS_STABLE, checks.error_rate_max_ratio, _error_rate_vs_stable),
        (P99_VS_STABLE, checks.p99_max_ratio, _p99_vs_stable),
    ]
    for name, limit, check in relative_checks:
        if limit is None:
            continue
        if not relative:
            results.append(CheckResult(name, Outcome.SKIPPED, "no stable traffic to compare with"))
            continue
        assert window.stable is not None  # sample size checked above
        results.append(check(canary, window.stable, checks))
    return _combine(results)
