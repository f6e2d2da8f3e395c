"""The sequential judge's evidence: e-processes for and against the canary, per check, and
what the rollout keeps of them from one metrics export to the next and across restarts.

Pure module: no clock, no I/O, no Ray. The judge (rollout.sequential) feeds them the counts of
each window; the rollout's state persists them (rollout.state), with the alternatives each
process was computed over.

Every test here is about a Bernoulli rate with a bound ``p0`` that may change from window to
window (the canary's share of traffic changes with the weight). The e-process is a mixture of
likelihood ratios over a grid of alternatives, each an odds ratio ``phi`` against that
window's ``p0``: for ``phi > 1`` the factor ``(p1/p0)^x ((1-p1)/(1-p0))^(n-x)`` has expectation
at most 1 under any rate <= p0, and for ``phi < 1`` under any rate >= p0. A window's counts
enter as a whole (the order of requests inside a window does not matter), so the evidence
needs only the counts the metrics already give, and a window may be as short as one export.
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

from rollout.analysis import ERROR_RATE_VS_STABLE, CheckResult, CohortStats, Outcome
from rollout.persisted import stored_copy

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
    # Custom level checks: evaluations out of bounds in a row, by check.
    gate_failures: dict[str, int] = field(default_factory=dict)

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


# --------------------------------------------------------------------------- verdicts


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


def fmt_e(value: float) -> str:
    if math.isinf(value):
        return "inf"
    if value >= 1000:
        return f"{value:.3g}"
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


def pct(rate: float) -> str:
    return f"{rate * 100:.2f}%"


def ratio(a: float, b: float) -> float:
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
            f"e-value {fmt_e(against)} >= {fmt_e(levels.fail_at)} "
            f"(alpha {levels.alpha:g} over {levels.checks} checks)"
        )
    if outcome is Outcome.PASS:
        return f"within bound: e-value {fmt_e(support)} >= {fmt_e(levels.pass_at)} " + (
            f"(beta {levels.beta:g})"
        )
    return (
        f"e-value against {fmt_e(against)} < {fmt_e(levels.fail_at)}, "
        f"for {fmt_e(support)} < {fmt_e(levels.pass_at)}"
    )


def check_result(
    name: str, evidence: CheckEvidence, levels: JudgeLevels, facts: str
) -> CheckResult:
    outcome = _outcome(evidence, levels)
    return CheckResult(
        name,
        outcome,
        f"{facts}; {_evidence_text(evidence, outcome, levels)}",
        evidence_against=evidence.e_against,
        evidence_for=evidence.e_for,
    )


__all__ = [
    "AGAINST_ODDS",
    "FOR_ODDS",
    "ROLLOUT_SHARE",
    "CheckEvidence",
    "JudgeLevels",
    "RateEvidence",
    "SequentialEvidence",
    "check_result",
    "fmt_e",
    "pct",
    "ratio",
]
