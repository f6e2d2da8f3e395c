"""The shadow phase's gate: is the canary's ranking as far from stable's as it should be?

Pure module: no clock, no I/O, no Ray. The state machine calls ``judge_shadow`` with each
fresh window of mirrored comparisons and the evidence so far, and keeps the evidence it returns
in the rollout's state (a restarted controller carries on with it).

Two measures, each a mean of a value in [0, 1] over the compared copies:

- ``shadow_rbo``: the divergence ``1 - RBO`` (rank-biased overlap, app/divergence.py);
- ``shadow_top1``: whether the first candidate changed (0 or 1).

Each bound on a mean ("at most u", "at least l") is decided by the same mixture e-processes
as the live checks (rollout/sequential.py's ``RateEvidence``), fed with a window's sum and
count. That test is exact for 0/1 values; for values anywhere in [0, 1] it stays valid,
because ``e^(lambda x) <= 1 - x + x e^lambda`` on [0, 1] (convexity; Hoeffding 1963) gives
every bounded value with mean ``mu`` at most the exponential moment of a Bernoulli(``mu``):
each factor of the likelihood-ratio product still has expectation at most 1 under the null,
so Ville's inequality bounds the chance it ever crosses ``1/alpha`` by ``alpha``. Values
strictly inside (0, 1) only make it conservative (their variance is below a Bernoulli's).

A copy the canary did not answer (error or timeout) counts as divergence 1 in both measures;
copies dropped for want of room count in neither.

Bounds:
- with an expectation recorded offline against this rollout's baseline
  (``metadata.expected_divergence``): each measure within ``tolerance`` of what was recorded,
  on both sides where the band does not reach the end of [0, 1] (a candidate recorded as
  diverging less than ``tolerance`` has no lower side: ranking exactly like the baseline is
  within its band);
- otherwise the plan's absolute limits: mean RBO >= ``rbo_mean_min`` (divergence at most
  ``1 - rbo_mean_min``) and top-1 change rate <= ``top1_change_max``.

FAIL as soon as the evidence that a mean is beyond one bound crosses ``bounds / alpha``
(Bonferroni over the bounds); PASS once every bound's supporting evidence crossed ``1 / beta``
and at least ``min_compared`` copies were compared; otherwise INCONCLUSIVE (hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from app.contracts import ExpectedDivergence
from app.divergence import DivergenceSums
from rollout.analysis import CheckResult, Outcome, ShadowStats, Verdict
from rollout.persisted import stored_copy
from rollout.plan import RolloutPlan, ShadowPlan
from rollout.sequential import RateEvidence

SHADOW_RBO: Final = "shadow_rbo"
SHADOW_TOP1: Final = "shadow_top1"
SHADOW_SAMPLE: Final = "shadow_sample"
MEASURES: Final = (SHADOW_RBO, SHADOW_TOP1)
# How a measure reads in a reason: (what is shown, how the mean is turned into it).
_SHOWN: Final = {SHADOW_RBO: "mean RBO", SHADOW_TOP1: "top-1 change rate"}

Side = Literal["upper", "lower"]

# Alternatives of the gate's mixtures, as odds ratios against a bound. Finer near 1 than the
# live checks': a band's edges are a tolerance (a few hundredths) from what a healthy
# candidate shows, an odds ratio of 1.1-1.3, and a mixture whose nearest alternative is far
# beyond that gathers evidence for it only slowly.
ABOVE_ODDS: Final = (1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0)
BELOW_ODDS: Final = (0.0, 0.2, 0.5, 0.7, 0.8, 0.9)


def _shown_value(measure: str, mean_divergence: float) -> float:
    """What people read: RBO itself (1 - divergence) for ``shadow_rbo``."""
    return 1 - mean_divergence if measure == SHADOW_RBO else mean_divergence


@dataclass
class BoundEvidence:
    """One bound on a measure's mean divergence: ``upper`` (at most ``bound``) or ``lower``
    (at least ``bound``). ``against``: evidence the mean is beyond it; ``supporting``: that it
    is within."""

    measure: str
    side: Side
    bound: float
    against: RateEvidence = field(default_factory=lambda: RateEvidence(above=True))
    supporting: RateEvidence = field(default_factory=lambda: RateEvidence(above=False))

    @classmethod
    def new(cls, measure: str, side: Side, bound: float) -> BoundEvidence:
        def process(above: bool) -> RateEvidence:
            return RateEvidence(above=above, grid=ABOVE_ODDS if above else BELOW_ODDS)

        upper = side == "upper"
        return cls(measure, side, bound, against=process(upper), supporting=process(not upper))

    def update(self, total: float, count: int) -> None:
        self.against.update(total, count, self.bound)
        self.supporting.update(total, count, self.bound)

    def describe(self) -> str:
        shown = _shown_value(self.measure, self.bound)
        # An upper bound on the divergence is a lower bound on RBO.
        at_least = (self.side == "upper") == (self.measure == SHADOW_RBO)
        return f"{_SHOWN[self.measure]} {'>=' if at_least else '<='} {shown:.3f}"


@dataclass
class ShadowEvidence(DivergenceSums):
    """Everything the shadow phase has seen, as kept in the rollout's state."""

    bounds: list[BoundEvidence]
    basis: str = ""  # what the bounds come from, in words
    expected: dict[str, Any] | None = None  # the ExpectedDivergence the bounds come from
    compared: int = 0
    dropped: int = 0
    errors: int = 0
    rbo_sum: float = 0.0
    overlap_sum: float = 0.0
    top1_changed: float = 0.0
    max_score_diff_p99: float | None = None  # the last window's
    windows: int = 0

    def copy(self) -> ShadowEvidence:
        return stored_copy(self)


def expectation_applies(
    expected: ExpectedDivergence | None,
    shadow: ShadowPlan,
    *,
    baseline_artifact_id: str,
    baseline_manifest_sha256: str | None,
) -> tuple[bool, str]:
    """Whether the candidate's recorded expectation is about this comparison, and why not."""
    if expected is None:
        return False, "no expected_divergence in the candidate's manifest"
    if expected.baseline_artifact_id != baseline_artifact_id:
        return False, (
            f"expected_divergence was recorded against {expected.baseline_artifact_id}, "
            f"not this rollout's baseline {baseline_artifact_id}"
        )
    if baseline_manifest_sha256 is not None and (
        expected.baseline_manifest_sha256 != baseline_manifest_sha256.lower()
    ):
        return False, (
            f"expected_divergence names {baseline_artifact_id} with manifest "
            f"{expected.baseline_manifest_sha256[:12]}, the registry's is "
            f"{baseline_manifest_sha256[:12]}"
        )
    if expected.top_k != shadow.top_k or not math.isclose(expected.rbo_p, shadow.rbo_p):
        return False, (
            f"expected_divergence was measured with top_k {expected.top_k} and rbo_p "
            f"{expected.rbo_p:g}, the plan compares with {shadow.top_k} and {shadow.rbo_p:g}"
        )
    return True, f"expected_divergence vs {baseline_artifact_id} ({expected.requests} requests)"


def _band(measure: str, centre: float, tolerance: float) -> list[BoundEvidence]:
    out = []
    if centre + tolerance < 1:
        out.append(BoundEvidence.new(measure, "upper", centre + tolerance))
    if centre - tolerance > 0:
        out.append(BoundEvidence.new(measure, "lower", centre - tolerance))
    return out


def new_shadow_evidence(
    shadow: ShadowPlan, expected: ExpectedDivergence | None, why_not: str = ""
) -> ShadowEvidence:
    """The bounds for a shadow phase: the recorded band when ``expected`` is given (already
    checked to apply), else the plan's absolute limits."""
    if expected is not None:
        bounds = _band(SHADOW_RBO, 1 - expected.rbo_mean, shadow.tolerance) + _band(
            SHADOW_TOP1, expected.top1_change_rate, shadow.tolerance
        )
        basis = (
            f"expected vs {expected.baseline_artifact_id}: mean RBO {expected.rbo_mean:.3f}, "
            f"top-1 change rate {expected.top1_change_rate:.3f}, +/- {shadow.tolerance:g}"
        )
        return ShadowEvidence(bounds, basis, expected=expected.model_dump(mode="json"))
    bounds = [
        BoundEvidence.new(SHADOW_RBO, "upper", 1 - shadow.rbo_mean_min),
        BoundEvidence.new(SHADOW_TOP1, "upper", shadow.top1_change_max),
    ]
    basis = (
        f"absolute limits: mean RBO >= {shadow.rbo_mean_min:g}, top-1 change rate <= "
        f"{shadow.top1_change_max:g}" + (f" ({why_not})" if why_not else "")
    )
    return ShadowEvidence(bounds, basis)


def _fmt_e(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def _observed(evidence: ShadowEvidence, measure: str) -> float | None:
    if measure == SHADOW_RBO:
        return evidence.rbo_mean
    return evidence.top1_change_rate


def judge_shadow(
    stats: ShadowStats | None, evidence: ShadowEvidence, plan: RolloutPlan
) -> tuple[Verdict, ShadowEvidence]:
    """One window of comparisons added to the evidence; the verdict and the new evidence
    (``evidence`` itself is not changed)."""
    shadow = plan.shadow
    assert shadow is not None, "judge_shadow needs a plan with a shadow phase"
    evidence = evidence.copy()
    evidence.windows += 1
    if stats is not None:
        evidence.dropped += stats.dropped
        evidence.errors += stats.errors
        if stats.compared > 0:
            evidence.add_sums(stats)
            if stats.max_score_diff_p99 is not None:
                evidence.max_score_diff_p99 = stats.max_score_diff_p99
        # A copy the canary did not answer (an error or a timeout: not one dropped for want
        # of room) counts as wholly divergent in both measures: a candidate that fails on
        # some requests and matches stable on the rest must not pass.
        trials = max(stats.compared, 0) + max(stats.errors, 0)
        if trials > 0:
            divergence = {
                SHADOW_RBO: min(max(stats.compared - stats.rbo_sum, 0.0), stats.compared)
                + stats.errors,
                SHADOW_TOP1: min(max(stats.top1_changed, 0.0), stats.compared) + stats.errors,
            }
            for bound in evidence.bounds:
                bound.update(divergence[bound.measure], trials)
    fail_at = len(evidence.bounds) / plan.alpha
    pass_at = 1 / plan.beta
    results: list[CheckResult] = []
    for measure in MEASURES:
        bounds = [b for b in evidence.bounds if b.measure == measure]
        if not bounds:
            continue
        observed = _observed(evidence, measure)
        seen = (
            f"{_SHOWN[measure]} {observed:.3f} over {evidence.compared} copies"
            if observed is not None
            else "no copy compared yet"
        )
        failing = [b for b in bounds if b.against.e_value >= fail_at]
        if failing:
            worst = max(failing, key=lambda b: b.against.e_value)
            results.append(
                CheckResult(
                    measure,
                    Outcome.FAIL,
                    f"shadow divergence: {seen}, outside {worst.describe()} "
                    f"({evidence.basis}): e-value {_fmt_e(worst.against.e_value)} >= "
                    f"{_fmt_e(fail_at)}",
                    evidence_against=max(b.against.e_value for b in bounds),
                    evidence_for=min(b.supporting.e_value for b in bounds),
                )
            )
            continue
        weakest = min(bounds, key=lambda b: b.supporting.e_value)
        shown = all(b.supporting.e_value >= pass_at for b in bounds)
        results.append(
            CheckResult(
                measure,
                Outcome.PASS if shown else Outcome.INCONCLUSIVE,
                f"shadow: {seen}, "
                + ("within " if shown else "not yet shown within ")
                + " and ".join(b.describe() for b in bounds)
                + f": e-value {_fmt_e(weakest.supporting.e_value)} "
                + (">=" if shown else "<")
                + f" {_fmt_e(pass_at)}",
                evidence_against=max(b.against.e_value for b in bounds),
                evidence_for=weakest.supporting.e_value,
            )
        )
    if not any(r.outcome is Outcome.FAIL for r in results) and evidence.compared < (
        shadow.min_compared
    ):
        results.append(
            CheckResult(
                SHADOW_SAMPLE,
                Outcome.INCONCLUSIVE,
                f"{evidence.compared} copies compared, {shadow.min_compared} needed "
                f"({evidence.dropped} dropped, {evidence.errors} unanswered)",
            )
        )
    outcomes = {r.outcome for r in results}
    if Outcome.FAIL in outcomes:
        overall = Outcome.FAIL
    elif Outcome.INCONCLUSIVE in outcomes:
        overall = Outcome.INCONCLUSIVE
    elif not results:
        # A band as wide as [0, 1] bounds nothing: any copies are within it.
        overall = Outcome.PASS
    else:
        overall = Outcome.PASS
    return Verdict(overall, tuple(results)), evidence
