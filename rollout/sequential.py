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

Every test here is about a Bernoulli rate with a bound ``p0`` that may change from window to
window (the canary's share of traffic changes with the weight). The e-process is a mixture of
likelihood ratios over a grid of alternatives, each an odds ratio ``phi`` against that
window's ``p0``: for ``phi > 1`` the factor ``(p1/p0)^x ((1-p1)/(1-p0))^(n-x)`` has expectation
at most 1 under any rate <= p0, and for ``phi < 1`` under any rate >= p0. A window's counts
enter as a whole (the order of requests inside a window does not matter), so the evidence
needs only the counts the metrics already give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Final

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_serializer,
    model_validator,
)

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
from rollout.persisted import stored_copy
from rollout.plan import AnalysisChecks, RolloutPlan

SAMPLE_RATIO: Final = "sample_ratio"

# The share of requests a "p99" hypothesis allows above its bound.
TAIL: Final = 0.01
# Alternatives of the mixtures, as odds ratios against the window's bound. Against the canary:
# from a mild regression (x1.5 the odds) to a broken one; for it: from a canary clearly inside
# the bound to one that never crosses it (0: no such request at all).
AGAINST_ODDS: Final = (1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1000.0)
FOR_ODDS: Final = (0.0, 0.1, 0.3, 0.6)
# The alternatives evidence was computed over before each process recorded its own grid: a
# state saved then resumes on these, whatever the constants above become.
_UNRECORDED_ODDS: Final = {
    True: (1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1000.0),
    False: (0.0, 0.1, 0.3, 0.6),
}
# The whole-rollout process' share of the evidence against the canary; the rest is shared by
# the processes restarted at each later step (see the module docstring).
ROLLOUT_SHARE: Final = 0.5
# How far the stable reference quantile is moved for each side, in binomial standard errors
# of its rank (see _stable_reference), and how many of stable's requests at a step it takes
# before the relative latency check judges the canary's (z standard errors of the p99's rank
# are then at most 0.63%; see _p99_vs_stable).
REFERENCE_Z: Final = 2.0
REFERENCE_MIN_REQUESTS: Final = 1000
# Bounds are kept inside (0, 1) so a zero floor or a cohort with no share stays finite.
_EPS: Final = 1e-9


# --------------------------------------------------------------------------- e-processes


def _mixture_log_factors(successes: int, trials: int, p0: float, odds: Sequence[float]) -> list:
    """log of each alternative's likelihood ratio against ``p0`` for one window's counts."""
    p0 = min(max(p0, _EPS), 1 - _EPS)
    failures = trials - successes
    out = []
    for phi in odds:
        p1 = phi * p0 / (1 - p0 + phi * p0)
        log_hit = math.log(p1 / p0) if p1 > 0 else -math.inf
        log_miss = math.log((1 - p1) / (1 - p0))
        value = (successes * log_hit if successes else 0.0) + failures * log_miss
        out.append(value)
    return out


def _ruled_out_from_null(value: Any) -> Any:
    return -math.inf if value is None else value


def _ruled_out_as_null(value: float) -> float | None:
    return None if value == -math.inf else value


# An alternative's running log likelihood ratio. -inf (an alternative ruled out for good) is
# not JSON: stored as null, read back as -inf.
LogWealth = Annotated[
    float,
    BeforeValidator(_ruled_out_from_null),
    PlainSerializer(_ruled_out_as_null, when_used="json"),
]


@dataclass
class RateEvidence:
    """One mixture e-process for a Bernoulli rate: ``above`` tests the null "rate <= bound"
    (evidence that the rate is above it), otherwise the null "rate >= bound". ``log_wealth``
    holds each alternative's running log likelihood ratio. ``grid`` replaces the default
    alternatives (``AGAINST_ODDS`` / ``FOR_ODDS``) for a test whose effects are finer."""

    above: bool
    log_wealth: list[LogWealth] = field(default_factory=list)
    grid: tuple[float, ...] | None = None

    # The rollout's state stores the grid with the wealth it indexes, so that a later change
    # of the default alternatives cannot pair a resumed rollout's wealth with other ones.
    @field_serializer("grid")
    def _stored_grid(self, grid: tuple[float, ...] | None) -> list[float]:
        return list(self.odds)

    @model_validator(mode="before")
    @classmethod
    def _grid_of_unrecorded_wealth(cls, data: Any) -> Any:
        # Wealth saved before each process recorded its grid was computed over these.
        if isinstance(data, Mapping) and data.get("grid") is None:
            return {**data, "grid": _UNRECORDED_ODDS[bool(data.get("above"))]}
        return data

    @model_validator(mode="after")
    def _wealth_fits_grid(self) -> RateEvidence:
        if self.log_wealth and len(self.log_wealth) != len(self.odds):
            raise ValueError(
                f"evidence holds {len(self.log_wealth)} alternatives' wealth for a grid of "
                f"{len(self.odds)}"
            )
        return self

    @property
    def odds(self) -> tuple[float, ...]:
        if self.grid is not None:
            return self.grid
        return AGAINST_ODDS if self.above else FOR_ODDS

    def update(self, successes: int, trials: int, bound: float) -> None:
        if trials <= 0:
            return
        if not 0 <= successes <= trials:
            raise ValueError(f"{successes} successes out of {trials} trials")
        factors = _mixture_log_factors(successes, trials, bound, self.odds)
        if not self.log_wealth:
            self.log_wealth = [0.0] * len(factors)
        self.log_wealth = [w + f for w, f in zip(self.log_wealth, factors, strict=True)]

    @property
    def e_value(self) -> float:
        """The mixture's value (1 before any data): the alternatives weighted equally."""
        if not self.log_wealth:
            return 1.0
        finite = [w for w in self.log_wealth if w != -math.inf]
        if not finite:
            return 0.0
        top = max(finite)
        if top > 700:  # exp overflows: the evidence is overwhelming either way
            return math.inf
        return math.exp(top) * sum(math.exp(w - top) for w in finite) / len(self.log_wealth)

    def fresh(self) -> RateEvidence:
        """A process of the same test and alternatives that has seen nothing yet."""
        return RateEvidence(above=self.above, grid=self.odds)


@dataclass
class CheckEvidence:
    """A check's evidence: against the canary and for it. The error check's union hypothesis
    (ratio or floor) has a pair of processes for each part: the canary fails only when both
    parts are rejected, and passes when either part's non-inferiority is shown.

    ``against`` runs over the whole rollout; ``against_in_step`` is the same test restarted
    at step ``step`` (an index >= 1; 0: no later step reached yet), and ``ended_in_steps``
    the sum, per part, of the earlier later steps' processes at their end. ``later_steps`` is
    how many steps after the first the plan has (0: no restarts, as a state saved before
    they existed). The state stores ``supporting`` as ``for``."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(serialize_by_alias=True)

    against: list[RateEvidence] = field(default_factory=lambda: [RateEvidence(above=True)])
    supporting: Annotated[list[RateEvidence], Field(alias="for")] = field(
        default_factory=lambda: [RateEvidence(above=False)]
    )
    # Counts the evidence is about, over the whole rollout: shown with the verdicts.
    counts: dict[str, float] = field(default_factory=dict)
    later_steps: int = 0
    step: int = 0
    against_in_step: list[RateEvidence] = field(default_factory=list)
    ended_in_steps: list[float] = field(default_factory=list)

    def enter_step(self, index: int) -> None:
        """Start the evidence restarted at step ``index`` (idempotent; steps only go up)."""
        if self.later_steps <= 0 or index <= self.step:
            return
        index = min(index, self.later_steps)
        ended = list(self.ended_in_steps) or [0.0] * len(self.against)
        for part in range(len(self.against)):
            if self.step >= 1:
                ended[part] += self.against_in_step[part].e_value
            # Steps between (none judged: their processes stayed at 1) end at 1.
            ended[part] += max(0, index - self.step - 1)
        self.ended_in_steps = ended
        self.against_in_step = [p.fresh() for p in self.against]
        self.step = index

    def update_against(self, part: int, successes: int, trials: int, bound: float) -> None:
        self.against[part].update(successes, trials, bound)
        if self.step >= 1:
            self.against_in_step[part].update(successes, trials, bound)

    def against_part(self, part: int) -> float:
        """The average of the whole-rollout process and the per-step ones (steps not reached
        yet count at their starting value 1)."""
        whole = self.against[part].e_value
        if self.later_steps <= 0:
            return whole
        ended = self.ended_in_steps[part] if self.ended_in_steps else 0.0
        current = self.against_in_step[part].e_value if self.step >= 1 else 0.0
        to_come = self.later_steps - self.step
        per_step = (ended + current + to_come) / self.later_steps
        return ROLLOUT_SHARE * whole + (1 - ROLLOUT_SHARE) * per_step

    @property
    def e_against(self) -> float:
        # Rejecting "ratio ok or floor ok" needs both rejected: the smaller value is an
        # e-value for the union.
        return min(self.against_part(part) for part in range(len(self.against)))

    @property
    def e_for(self) -> float:
        # Non-inferiority on either part is enough; the mean of e-values is an e-value.
        return sum(p.e_value for p in self.supporting) / len(self.supporting)

    def add(self, name: str, value: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    @model_validator(mode="after")
    def _one_step_process_per_part(self) -> CheckEvidence:
        if self.step >= 1 and len(self.against_in_step) != len(self.against):
            raise ValueError(f"step {self.step} evidence is not one process per part")
        return self


def _check_evidence(paired: bool, later_steps: int, step: int) -> CheckEvidence:
    parts = 2 if paired else 1
    evidence = CheckEvidence(
        against=[RateEvidence(above=True) for _ in range(parts)],
        supporting=[RateEvidence(above=False) for _ in range(parts)],
        later_steps=later_steps,
    )
    evidence.enter_step(step)
    return evidence


@dataclass
class SequentialEvidence:
    """Everything the sequential judge has learnt in one rollout, as kept in its state."""

    checks: dict[str, CheckEvidence] = field(default_factory=dict)
    # Sample-ratio guard: the canary's observed share below / above its weight's tolerance.
    share_low: RateEvidence = field(default_factory=lambda: RateEvidence(above=False))
    share_high: RateEvidence = field(default_factory=lambda: RateEvidence(above=True))
    share_counts: dict[str, float] = field(default_factory=dict)
    mismatch_alerted: bool = False
    windows: int = 0
    # The plan's steps after the first (0: no per-step restarts), and the step judged last.
    later_steps: int = 0
    step: int = 0
    # Requests each cohort served at the current step (the sanity floor ``min_requests``),
    # and stable's latency histogram over it, +Inf aside (``stable_total``): the reference of
    # the relative latency check (see _stable_reference). Both restart at each step, where
    # the load on stable changes with the weights.
    step_requests: dict[str, float] = field(default_factory=dict)
    stable_buckets: dict[float, float] = field(default_factory=dict)
    stable_total: float = 0.0
    # The step's canary latencies the relative check has not judged yet (+Inf aside, and the
    # diverted requests, which have none): held until stable's histogram can place its p99
    # (``REFERENCE_MIN_REQUESTS``), then judged as one batch (see _p99_vs_stable).
    pending_buckets: dict[float, float] = field(default_factory=dict)
    pending_total: float = 0.0
    pending_diverted: float = 0.0

    def check(self, name: str) -> CheckEvidence:
        if name not in self.checks:
            paired = name == ERROR_RATE_VS_STABLE
            self.checks[name] = _check_evidence(paired, self.later_steps, self.step)
        return self.checks[name]

    def enter_step(self, index: int) -> None:
        if index > self.step or not self.windows:
            self.step_requests = {}
            self.stable_buckets, self.stable_total = {}, 0.0
            # Canary latencies held for a reference of the step before: never judged (what
            # is left out costs only evidence, never validity).
            self.pending_buckets, self.pending_total, self.pending_diverted = {}, 0.0, 0.0
        self.step = max(self.step, index)
        for check in self.checks.values():
            check.enter_step(index)

    def count_step(self, canary: CohortStats, stable: CohortStats) -> None:
        """Add a window's requests and stable's latencies to the current step's."""
        for name, stats in (("canary", canary), ("stable", stable)):
            self.step_requests[name] = self.step_requests.get(name, 0.0) + stats.requests
        self.stable_buckets, self.stable_total = _summed(
            self.stable_buckets, self.stable_total, stable.latency_buckets
        )

    def hold_canary(self, canary: CohortStats) -> None:
        """Keep a window's canary latencies for the relative check's next batch."""
        self.pending_buckets, self.pending_total = _summed(
            self.pending_buckets, self.pending_total, canary.latency_buckets
        )
        self.pending_diverted += canary.errors.get("diverted", 0)

    def release_canary(self) -> CohortStats | None:
        """The held canary latencies as one cohort's stats (None: nothing held), and forget
        them."""
        if self.pending_total <= 0 and self.pending_diverted <= 0:
            return None
        buckets = {**self.pending_buckets, math.inf: self.pending_total}
        held = CohortStats(
            round(self.pending_total),
            {"diverted": round(self.pending_diverted)} if self.pending_diverted else {},
            latency_buckets=buckets if self.pending_total > 0 else {},
        )
        self.pending_buckets, self.pending_total, self.pending_diverted = {}, 0.0, 0.0
        return held

    def stable_histogram(self) -> dict[float, float]:
        """Stable's cumulative latency histogram over the current step (+Inf included)."""
        if self.stable_total <= 0:
            return {}
        return {**self.stable_buckets, math.inf: self.stable_total}

    @property
    def e_mismatch(self) -> float:
        return (self.share_low.e_value + self.share_high.e_value) / 2

    def copy(self) -> SequentialEvidence:
        return stored_copy(self)


# --------------------------------------------------------------------------- histograms


def _summed(
    finite: dict[float, float], total: float, buckets: Mapping[float, float]
) -> tuple[dict[float, float], float]:
    """A cumulative histogram kept as its finite bounds and its total, plus ``buckets``
    (+Inf included). Only the bounds both hold are kept: a bound that one router lacks would
    read as requests slower than it."""
    added = buckets.get(math.inf, 0.0)
    if added <= 0:
        return finite, total
    new = {b: c for b, c in buckets.items() if not math.isinf(b)}
    if total > 0:
        new = {b: c + finite[b] for b, c in new.items() if b in finite}
    return new, total + added


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


@dataclass(frozen=True)
class JudgeLevels:
    alpha: float
    beta: float
    checks: int

    @property
    def fail_at(self) -> float:
        return self.checks / self.alpha

    @property
    def pass_at(self) -> float:
        return 1 / self.beta


def _fmt_e(value: float) -> str:
    if math.isinf(value):
        return "inf"
    if value >= 1000:
        return f"{value:.3g}"
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


def _pct(rate: float) -> str:
    return f"{rate * 100:.2f}%"


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _outcome(evidence: CheckEvidence, levels: JudgeLevels) -> Outcome:
    if evidence.e_against >= levels.fail_at:
        return Outcome.FAIL
    if evidence.e_for >= levels.pass_at:
        return Outcome.PASS
    return Outcome.INCONCLUSIVE


def _evidence_text(evidence: CheckEvidence, outcome: Outcome, levels: JudgeLevels) -> str:
    against, support = evidence.e_against, evidence.e_for
    if outcome is Outcome.FAIL:
        return (
            f"e-value {_fmt_e(against)} >= {_fmt_e(levels.fail_at)} "
            f"(alpha {levels.alpha:g} over {levels.checks} checks)"
        )
    if outcome is Outcome.PASS:
        return f"within bound: e-value {_fmt_e(support)} >= {_fmt_e(levels.pass_at)} " + (
            f"(beta {levels.beta:g})"
        )
    return (
        f"e-value against {_fmt_e(against)} < {_fmt_e(levels.fail_at)}, "
        f"for {_fmt_e(support)} < {_fmt_e(levels.pass_at)}"
    )


def _result(name: str, evidence: CheckEvidence, levels: JudgeLevels, facts: str) -> CheckResult:
    outcome = _outcome(evidence, levels)
    return CheckResult(
        name,
        outcome,
        f"{facts}; {_evidence_text(evidence, outcome, levels)}",
        evidence_against=evidence.e_against,
        evidence_for=evidence.e_for,
    )


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
        f"success rate: canary {_pct(1 - _ratio(errors, requests))} "
        f"({errors:.0f} errors in {requests:.0f}) vs floor {_pct(floor)}"
    )
    return _result(SUCCESS_RATE, check, levels, facts)


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
    facts = (
        f"p99 ceiling: {_slower_text(check)} slower than {ceiling_ms:g} ms, {_pct(TAIL)} allowed"
    )
    return _result(P99_CEILING, check, levels, facts)


def _slower_text(check: CheckEvidence) -> str:
    """The certainly slower requests (what counts against the canary) and, where bucket
    edges leave some undecided, the possibly slower ones (what counts for it)."""
    counts = check.counts
    slower, requests = counts.get("slower", 0.0), counts.get("requests", 0.0)
    possibly = counts.get("possibly_slower", slower)
    text = f"{_pct(_ratio(slower, requests))} of canary requests ({slower:.0f} in {requests:.0f})"
    if possibly > slower:
        text += f", {_pct(_ratio(possibly, requests))} possibly ({possibly:.0f}),"
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
    canary_rate = _ratio(c["canary_errors"], c["canary_requests"])
    stable_rate = _ratio(c["stable_errors"], c["stable_requests"])
    facts = (
        f"errors: canary {_pct(canary_rate)} ({c['canary_errors']:.0f} in "
        f"{c['canary_requests']:.0f}) vs stable {_pct(stable_rate)} ({c['stable_errors']:.0f} in "
        f"{c['stable_requests']:.0f}), allowed {k:g}x stable or {_pct(floor)}"
    )
    return _result(ERROR_RATE_VS_STABLE, check, levels, facts)


def _p99_vs_stable(
    ev: SequentialEvidence,
    canary: CohortStats,
    stable: CohortStats,
    checks: AnalysisChecks,
    min_requests: int,
    levels: JudgeLevels,
) -> CheckResult:
    """The canary's requests slower than ``ratio x`` stable's p99, against the 1% a p99
    allows. Stable's p99 is read from its histogram over the step (see _stable_reference);
    until that holds ``REFERENCE_MIN_REQUESTS`` (or ``min_requests``, if more) the canary's
    latencies are held, then judged as one batch against it, and every later window against
    the reference of its time. Judging held requests late is valid: the limit is drawn from
    stable's requests alone, which say nothing about the canary's, so given the limit the
    held counts are as likely under the null as if judged at once; and each request is
    judged once. Judged at once against a reference of a few hundred requests, they would
    meet a limit set two standard errors low (stable's p97 or below), where a healthy
    canary's ordinary tail counts as possibly too slow, and the evidence for it, once lost,
    does not come back."""
    check = ev.check(P99_VS_STABLE)
    reference = ev.stable_histogram()
    if canary.latency_buckets or canary.errors.get("diverted"):
        ev.hold_canary(canary)
    mature = reference.get(math.inf, 0.0) >= max(min_requests, REFERENCE_MIN_REQUESTS)
    held = ev.release_canary() if mature else None
    if held is not None:
        high, low = _stable_reference(reference, +1), _stable_reference(reference, -1)
        if high is not None and low is not None:
            certainly, _ = slower_than(held.latency_buckets, _limit_from(high, checks))
            _, possibly = slower_than(held.latency_buckets, _limit_from(low, checks))
            trials, certainly, possibly = _latency_trials(held, certainly, possibly)
            check.update_against(0, certainly, trials, TAIL)
            check.supporting[0].update(possibly, trials, TAIL)
            check.add("slower", certainly)
            check.add("possibly_slower", possibly)
            check.add("requests", trials)
            # The limits this window used: stable's p99 moved up for the evidence against
            # the canary and down for the evidence for it (see _stable_reference).
            check.counts["limit_ms"] = _limit_from(high, checks)
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
        f"{_pct(TAIL)} allowed"
    )
    return _result(P99_VS_STABLE, check, levels, facts)


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
        f"sample ratio mismatch: canary served {_pct(_ratio(c['canary'], c['total']))} of "
        f"{c['total']:.0f} requests at weight {_pct(c['weight'])} (tolerance "
        f"{tolerance:.0%}); e-value {_fmt_e(ev.e_mismatch)} >= {_fmt_e(1 / alpha)}: the "
        f"comparison is biased, holding",
        evidence_against=ev.e_mismatch,
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
    levels = JudgeLevels(alpha=plan.alpha, beta=plan.beta, checks=enabled_checks(checks))
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

    outcomes = {r.outcome for r in results}
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
    "limit_for_canary",
    "slower_than",
]
