"""The sequential judge's tests, tested: error rates under the null by simulation, power under
alternatives, cohorts without traffic or errors, weights changing mid-stream, histogram edges,
the sample-ratio guard, and what the machine does with its verdicts.

Simulations are seeded and small (a few seconds in all); their bounds leave room for binomial
noise of the simulated rate (3 standard errors), never for a test that cannot fail: each
bound is also checked to be crossed by the same simulation under the alternative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.contracts import ReplicaPhase
from app.errors import ConfigError
from app.telemetry import LATENCY_BOUNDARIES_MS
from rollout import evidence, machine
from rollout.analysis import (
    ERROR_RATE_VS_STABLE,
    P99_VS_STABLE,
    CohortStats,
    Outcome,
    WindowStats,
    quantile_from_buckets,
)
from rollout.machine import Alert, Observations, PoolView, ReplicaObservation, advance
from rollout.persisted import read, written
from rollout.plan import RolloutPlan, plan_from_mapping
from rollout.sequential import (
    SAMPLE_RATIO,
    CheckEvidence,
    RateEvidence,
    SequentialEvidence,
    _stable_reference,
    judge_sequential,
    slower_than,
)
from rollout.state import Phase, RolloutState, Weights

INF = math.inf
BOUNDS = np.array(LATENCY_BOUNDARIES_MS, dtype=float)


def histogram(latencies: np.ndarray) -> dict[float, float]:
    """A cumulative histogram with the router's bounds, as Prometheus keeps it."""
    counts = np.searchsorted(np.sort(latencies), BOUNDS, side="right")
    out = {float(b): float(c) for b, c in zip(BOUNDS, counts, strict=True)}
    out[INF] = float(len(latencies))
    return out


def cohort(rng: np.random.Generator, n: int, error_rate: float, scale: float = 1.0) -> CohortStats:
    latencies = rng.lognormal(math.log(20.0), 0.35, n) * scale
    errors = int(rng.binomial(n, error_rate)) if n else 0
    buckets = histogram(latencies)
    return CohortStats(
        n,
        {"error": errors} if errors else {},
        p99_ms=quantile_from_buckets(0.99, buckets),
        latency_buckets=buckets,
    )


def window(canary: CohortStats | None, stable: CohortStats | None) -> WindowStats:
    return WindowStats(0.0, 60.0, canary, stable)


# --------------------------------------------------------------------------- e-processes


def crossing_rate(rate_of: float, bound: float, *, above: bool, level: float, seed: int) -> float:
    """Share of 2000 streams of 40 windows (120 Bernoulli trials each, the bound changing
    from window to window) whose evidence ever reaches ``1 / level``."""
    rng = np.random.default_rng(seed)
    crossed = 0
    for _ in range(2000):
        evidence = RateEvidence(above=above)
        for index in range(40):
            window_bound = bound * (1 + 0.5 * (index % 3))  # the bound moves with the weight
            p = min(1.0, window_bound * rate_of)
            evidence.update(int(rng.binomial(120, p)), 120, window_bound)
            if evidence.e_value >= 1 / level:
                crossed += 1
                break
    return crossed / 2000


def _slack(level: float) -> float:
    return 3 * math.sqrt(level * (1 - level) / 2000)


@pytest.mark.parametrize("above", [True, False])
def test_at_the_bound_the_evidence_crosses_1_over_alpha_at_most_alpha_of_the_time(above: bool):
    # The worst case of each null is its boundary: the rate exactly at the bound, every window.
    rate = crossing_rate(1.0, 0.01, above=above, level=0.05, seed=1 if above else 2)
    assert rate <= 0.05 + _slack(0.05), rate


@pytest.mark.parametrize("above", [True, False])
def test_looked_at_every_export_the_evidence_still_crosses_at_most_level_of_the_time(above):
    """The controller adds evidence at every metrics export, a few requests at a time, and
    acts the moment a bound is crossed: 1000 streams of 300 exports of 10 requests, exactly
    at the bound, each looked at after every export."""
    rng = np.random.default_rng(11 if above else 12)
    bound, level, crossed = 0.02, 0.05, 0
    for _ in range(1000):
        evidence = RateEvidence(above=above)
        for hits in rng.binomial(10, bound, size=300):
            evidence.update(int(hits), 10, bound)
            if evidence.e_value >= 1 / level:
                crossed += 1
                break
    assert crossed / 1000 <= level + 3 * math.sqrt(level * (1 - level) / 1000), crossed


def test_inside_the_null_the_evidence_against_hardly_ever_crosses():
    assert crossing_rate(0.3, 0.01, above=True, level=0.05, seed=3) <= 0.01


def test_beyond_the_bound_the_evidence_against_crosses_nearly_always():
    # Three times the allowed rate: the power the bounds above are no excuse for.
    assert crossing_rate(3.0, 0.01, above=True, level=0.05, seed=4) >= 0.95


def test_well_inside_the_bound_the_evidence_for_crosses_nearly_always():
    assert crossing_rate(0.1, 0.01, above=False, level=0.05, seed=5) >= 0.95


def test_evidence_is_the_same_whatever_the_split_into_windows():
    one, many = RateEvidence(above=True), RateEvidence(above=True)
    one.update(12, 1000, 0.01)
    for successes in (3, 0, 5, 4):
        many.update(successes, 250, 0.01)
    assert one.e_value == pytest.approx(many.e_value, rel=1e-9)


def test_an_update_with_more_successes_than_trials_is_refused():
    with pytest.raises(ValueError, match="3 successes out of 2 trials"):
        RateEvidence(above=True).update(3, 2, 0.01)


def test_evidence_survives_a_json_round_trip_including_ruled_out_alternatives():
    evidence = SequentialEvidence()
    check = evidence.check(ERROR_RATE_VS_STABLE)
    check.supporting[1].update(2, 100, 0.01)  # the "no error ever" alternative is ruled out
    assert None in written(check.supporting[1])["log_wealth"]
    again = read(SequentialEvidence, written(evidence))
    assert written(again) == written(evidence)
    assert again.check(ERROR_RATE_VS_STABLE).e_for == check.e_for


def test_the_alternatives_are_stored_with_the_wealth_they_index(monkeypatch):
    process = RateEvidence(above=True)
    process.update(3, 100, 0.01)
    saved = written(process)
    assert saved["grid"] == list(evidence.AGAINST_ODDS)
    # A later release with other default alternatives resumes on the stored ones.
    monkeypatch.setattr(evidence, "AGAINST_ODDS", (2.0, 4.0))
    resumed = read(RateEvidence, saved)
    assert resumed.odds == tuple(saved["grid"]) and resumed.e_value == process.e_value
    # Wealth saved before grids were stored is read against the grid it was computed over.
    saved.pop("grid")
    assert read(RateEvidence, saved).e_value == process.e_value
    # Wealth that does not fit its grid is refused, not paired with the wrong alternatives.
    saved["grid"] = [2.0, 4.0]
    with pytest.raises(ValueError, match="8 alternatives' wealth for a grid of 2"):
        read(RateEvidence, saved)


# --------------------------------------------------------------------------- the judge

ERRORS_ONLY = {
    "success_rate_min": None,
    "p99_max_ms": None,
    "p99_max_ratio": None,
    "error_rate_max_ratio": 3.0,
    "error_rate_floor": 0.0,  # no floor: the ratio alone decides
}


def step_of(plan: RolloutPlan, canary_bp: int) -> int:
    """The step a stream's window is at, from its weight (the plan's steps, else the first)."""
    percents = [round(p * 100) for p in plan.steps]
    return percents.index(canary_bp) if canary_bp in percents else 0


def run_stream(plan: RolloutPlan, windows, *, seed: int) -> tuple[Outcome, int]:
    """Judge (canary_bp, canary CohortStats, stable CohortStats) windows until a decision."""
    evidence = None
    verdict = None
    for index, (bp, canary, stable) in enumerate(windows(np.random.default_rng(seed))):
        verdict, evidence = judge_sequential(
            window(canary, stable), evidence, plan, canary_bp=bp, step_index=step_of(plan, bp)
        )
        if verdict.outcome is Outcome.FAIL:
            return Outcome.FAIL, index + 1
    assert verdict is not None
    return verdict.outcome, index + 1


def weight_changing_errors(canary_over_stable: float, stable_rate: float = 0.01):
    """5% -> 25% -> 50%, four windows each, 2000 requests a window."""

    def windows(rng):
        for bp in (500,) * 4 + (2500,) * 4 + (5000,) * 4:
            n_canary = int(rng.binomial(2000, bp / 10_000))
            yield (
                bp,
                cohort(rng, n_canary, stable_rate * canary_over_stable),
                cohort(rng, 2000 - n_canary, stable_rate),
            )

    return windows


def test_error_ratio_type_one_error_with_weights_changing_mid_stream():
    # The canary at exactly 3x stable's error rate (the hypothesis' edge), shares changing
    # from step to step: each window's null comes from that window's own shares.
    plan = RolloutPlan(checks=ERRORS_ONLY, alpha=0.05)
    fails = sum(
        run_stream(plan, weight_changing_errors(3.0), seed=seed)[0] is Outcome.FAIL
        for seed in range(300)
    )
    assert fails / 300 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300), fails


def test_error_ratio_catches_ten_times_the_baseline_within_the_first_step():
    plan = RolloutPlan(checks=ERRORS_ONLY, alpha=0.05)
    results = [run_stream(plan, weight_changing_errors(10.0), seed=s) for s in range(100)]
    assert sum(outcome is Outcome.FAIL for outcome, _ in results) >= 95
    assert np.median([n for _, n in results]) <= 4


def good_then_bad(bad_over_stable: float, good_windows: int = 30, bad_windows: int = 40):
    """A canary as good as stable for ``good_windows`` at 5%, then ``bad_over_stable`` x its
    error rate at 50% (step 3 of 5 -> 25 -> 50), 4000 requests a window."""

    def windows(rng):
        for bp, rate, count in (
            (500, 0.01, good_windows),
            (5000, 0.01 * bad_over_stable, bad_windows),
        ):
            for _ in range(count):
                n_canary = int(rng.binomial(4000, bp / 10_000))
                yield bp, cohort(rng, n_canary, rate), cohort(rng, 4000 - n_canary, 0.01)

    return windows


def test_a_regression_that_shows_only_at_a_later_step_is_not_masked_by_earlier_health():
    # 30 healthy windows at 5% drive the whole-rollout evidence against the canary far below
    # 1; the process restarted at 50% starts afresh and catches 6x the errors there.
    plan = RolloutPlan(checks=ERRORS_ONLY, steps=(5, 25, 50))
    for seed in range(10):
        evidence = None
        failed_at = None
        for index, (bp, canary, stable) in enumerate(
            good_then_bad(6.0)(np.random.default_rng(seed))
        ):
            verdict, evidence = judge_sequential(
                window(canary, stable), evidence, plan, canary_bp=bp, step_index=step_of(plan, bp)
            )
            if verdict.outcome is Outcome.FAIL:
                failed_at = index + 1 - 30
                break
        assert failed_at is not None and 1 <= failed_at <= 10, (seed, failed_at)
        check = evidence.checks[ERROR_RATE_VS_STABLE]
        # The whole-rollout process alone was still nowhere near its bound.
        assert check.against[0].e_value < 1, check.against[0].e_value
        assert check.step == 2 and check.against_in_step[0].e_value > 100


def test_the_per_step_restarts_keep_type_one_error_across_steps():
    # At the hypothesis' edge in every step (3x), the average of the whole-rollout and
    # per-step processes crosses its bound in at most alpha of the rollouts.
    plan = RolloutPlan(checks=ERRORS_ONLY, alpha=0.05, steps=(5, 25, 50))

    def at_the_edge(rng):
        for bp in (500,) * 5 + (2500,) * 5 + (5000,) * 5:
            n_canary = int(rng.binomial(2000, bp / 10_000))
            yield bp, cohort(rng, n_canary, 0.03), cohort(rng, 2000 - n_canary, 0.01)

    fails = sum(run_stream(plan, at_the_edge, seed=s)[0] is Outcome.FAIL for s in range(300))
    assert fails / 300 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300), fails


def test_entering_a_step_ends_the_last_steps_process_and_counts_skipped_ones_at_one():
    check = CheckEvidence(later_steps=3)
    assert check.e_against == 1.0  # 0.5 x 1 + 0.5 x (three steps to come at 1) / 3
    check.update_against(0, 0, 1000, 0.05)  # step 1: no canary errors: evidence drops
    whole = check.against[0].e_value
    assert whole < 1 and check.e_against == pytest.approx(0.5 * whole + 0.5)
    check.enter_step(1)
    check.update_against(0, 0, 1000, 0.05)
    in_step = check.against_in_step[0].e_value
    assert in_step == pytest.approx(whole)  # the same counts from a fresh start
    check.enter_step(3)  # step 2 never judged: its process ended at 1
    assert check.ended_in_steps == [pytest.approx(in_step + 1.0)]
    assert check.against_in_step[0].log_wealth == [] and check.step == 3
    expected = 0.5 * check.against[0].e_value + 0.5 * (in_step + 1.0 + 1.0) / 3
    assert check.e_against == pytest.approx(expected)
    check.enter_step(2)  # steps only go up
    assert check.step == 3
    assert written(read(CheckEvidence, written(check))) == written(check)


def test_the_inputs_of_the_judge_are_left_as_they_were():
    plan = RolloutPlan(checks=ERRORS_ONLY, steps=(5, 25, 50))
    rng = np.random.default_rng(5)
    _, evidence = judge_sequential(
        window(cohort(rng, 500, 0.01), cohort(rng, 9500, 0.01)),
        None,
        plan,
        canary_bp=500,
        step_index=0,
    )
    before = written(evidence)
    judge_sequential(
        window(cohort(rng, 5000, 0.2), cohort(rng, 5000, 0.01)),
        evidence,
        plan,
        canary_bp=5000,
        step_index=2,
    )
    assert written(evidence) == before


def test_the_stable_reference_moves_to_each_sides_cautious_side():
    rng = np.random.default_rng(2)
    buckets = histogram(rng.lognormal(3.5, 0.5, 2000))
    against, supporting = _stable_reference(buckets, +1), _stable_reference(buckets, -1)
    assert against is not None and supporting is not None
    middle = quantile_from_buckets(0.99, buckets)
    assert supporting < middle < against


def test_no_errors_anywhere_leaves_the_ratio_undecided_and_the_floor_shows_the_canary_fine():
    plan = RolloutPlan(checks={**ERRORS_ONLY, "error_rate_floor": 0.01})
    canary, stable = CohortStats(2000), CohortStats(20_000)
    evidence = None
    for _ in range(3):
        verdict, evidence = judge_sequential(
            window(canary, stable), evidence, plan, canary_bp=909, step_index=0
        )
    assert evidence is not None
    parts = evidence.checks[ERROR_RATE_VS_STABLE]
    assert parts.against[0].log_wealth == [] and parts.supporting[0].log_wealth == []
    assert parts.supporting[1].e_value > 1e6  # 6000 canary requests, not one error
    assert verdict.outcome is Outcome.PASS, verdict.summary()


def test_a_cohort_without_traffic_adds_no_evidence_and_never_fails():
    plan = RolloutPlan()
    verdict, evidence = judge_sequential(
        window(None, None), None, plan, canary_bp=500, step_index=0
    )
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert all(c.e_against == 1.0 and c.e_for == 1.0 for c in evidence.checks.values())
    assert "canary served 0 requests" in verdict.summary()


def test_a_step_cannot_pass_before_each_cohort_served_min_requests_at_it():
    """The sanity floor counts a step's requests, not a window's: evidence arrives at every
    metrics export, in windows of a few seconds each, and the floor restarts at each step."""
    plan = RolloutPlan(min_requests=3000)
    rng = np.random.default_rng(7)

    def judged(evidence, step):
        return judge_sequential(
            window(cohort(rng, 1000, 0.0), cohort(rng, 1000, 0.0)),
            evidence,
            plan,
            canary_bp=5000,
            step_index=step,
        )

    verdict, evidence = judged(None, 0)
    verdict, evidence = judged(evidence, 0)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert "canary served 2000 requests at this step, 3000 needed" in verdict.summary()
    verdict, evidence = judged(evidence, 0)
    assert verdict.outcome is Outcome.PASS, verdict.summary()
    verdict, evidence = judged(evidence, 1)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert "canary served 1000 requests at this step, 3000 needed" in verdict.summary()


def latency_stream(scale: float, windows: int = 10, canary_n: int = 600, stable_n: int = 3000):
    def stream(rng):
        for _ in range(windows):
            yield 1667, cohort(rng, canary_n, 0.0, scale), cohort(rng, stable_n, 0.0)

    return stream


LATENCY_ONLY = {
    "success_rate_min": None,
    "p99_max_ms": None,
    "error_rate_max_ratio": None,
    "p99_max_ratio": 1.5,
    "p99_slack_ms": 0.0,
}


def test_latency_a_a_is_not_failed_and_a_2x_tail_is():
    plan = RolloutPlan(checks=LATENCY_ONLY, alpha=0.05)
    same = [run_stream(plan, latency_stream(1.0), seed=s)[0] for s in range(200)]
    slow = [run_stream(plan, latency_stream(2.0), seed=s) for s in range(100)]
    assert sum(o is Outcome.FAIL for o in same) / 200 <= 0.05
    assert sum(o is Outcome.PASS for o in same) / 200 >= 0.9  # and it does pass, in time
    assert sum(o is Outcome.FAIL for o, _ in slow) >= 95
    assert np.median([n for _, n in slow]) <= 2


def test_explanations_name_the_rates_the_evidence_and_the_bound():
    plan = RolloutPlan(checks=ERRORS_ONLY)
    canary = CohortStats(1000, {"error": 60})
    stable = CohortStats(19_000, {"error": 57})
    verdict, _ = judge_sequential(window(canary, stable), None, plan, canary_bp=500, step_index=0)
    assert verdict.outcome is Outcome.FAIL
    (reason,) = verdict.reasons
    assert reason.startswith("errors: canary 6.00% (60 in 1000) vs stable 0.30% (57 in 19000)")
    assert "e-value" in reason and ">= 100 (alpha 0.01 over 1 checks)" in reason


# --------------------------------------------------------------------------- histograms


def test_slower_than_counts_certain_and_possible_requests_by_bucket_edges():
    buckets = {10.0: 50.0, 20.0: 80.0, 50.0: 95.0, INF: 100.0}
    assert slower_than(buckets, 20.0) == (20, 20)  # on a bound: exact
    assert slower_than(buckets, 15.0) == (20, 50)  # inside (10, 20]: that bucket is possible
    assert slower_than(buckets, 5.0) == (50, 100)  # below every bound: all possible
    assert slower_than(buckets, 60.0) == (0, 5)  # in the +Inf bucket: only possible
    assert slower_than({INF: 0.0}, 10.0) == (0, 0)


def test_a_cohort_without_a_histogram_adds_no_latency_evidence():
    plan = RolloutPlan(checks=LATENCY_ONLY)
    canary, stable = CohortStats(1000), CohortStats(1000)
    verdict, evidence = judge_sequential(
        window(canary, stable), None, plan, canary_bp=5000, step_index=0
    )
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert evidence.checks[P99_VS_STABLE].e_against == 1.0


def test_a_slow_tail_inside_one_bucket_is_counted_on_each_side_conservatively():
    # Stable's p99 sits on 50 ms; moved up for the evidence against the canary it is about
    # 56 ms, a limit of about 84 ms, inside the bucket (75, 100]. Requests in that bucket are
    # possibly slower, never certainly: only those beyond 100 ms count against the canary.
    stable = {50.0: 990.0, 60.0: 1000.0, 75.0: 1000.0, 100.0: 1000.0, 125.0: 1000.0, INF: 1000.0}
    plan = RolloutPlan(checks=LATENCY_ONLY)

    def judged(canary: dict[float, float]):
        return judge_sequential(
            window(
                CohortStats(1000, latency_buckets=canary),
                CohortStats(1000, latency_buckets=stable),
            ),
            None,
            plan,
            canary_bp=5000,
            step_index=0,
        )

    straddling = {50.0: 900.0, 60.0: 900.0, 75.0: 950.0, 100.0: 1000.0, 125.0: 1000.0, INF: 1000.0}
    verdict, evidence = judged(straddling)
    assert evidence.checks[P99_VS_STABLE].counts["slower"] == 0
    assert verdict.outcome is not Outcome.FAIL
    # For the canary the same tail is possibly slower: 100 of 1000 (10% > 1%), no support.
    assert evidence.checks[P99_VS_STABLE].e_for < 1
    beyond = {**straddling, 100.0: 950.0}  # 50 of them in (100, 125] instead
    _, evidence = judged(beyond)
    assert evidence.checks[P99_VS_STABLE].counts["slower"] == 50


# --------------------------------------------------------------------------- sample ratio


def test_a_share_far_from_its_weight_holds_and_says_so():
    plan = RolloutPlan(checks=ERRORS_ONLY)
    rng = np.random.default_rng(9)
    verdict = None
    evidence = None
    for _ in range(3):  # the canary gets 1% of requests at a 20% weight
        verdict, evidence = judge_sequential(
            window(cohort(rng, 100, 0.0), cohort(rng, 9900, 0.0)),
            evidence,
            plan,
            canary_bp=2000,
            step_index=0,
        )
    assert verdict is not None and verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.checks[0].name == SAMPLE_RATIO
    assert "sample ratio mismatch: canary served 1.00% of 30000 requests at weight 20.00%" in (
        verdict.summary()
    )


def test_a_share_within_tolerance_of_its_weight_is_not_a_mismatch():
    plan = RolloutPlan(checks=ERRORS_ONLY)
    rng = np.random.default_rng(10)
    evidence = None
    for _ in range(30):  # 15% of requests at a 20% weight: a few users more or less
        verdict, evidence = judge_sequential(
            window(cohort(rng, 1500, 0.0), cohort(rng, 8500, 0.0)),
            evidence,
            plan,
            canary_bp=2000,
            step_index=0,
        )
        assert all(c.name != SAMPLE_RATIO for c in verdict.checks)


# --------------------------------------------------------------------------- plan fields


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"judge": "bayes"}, "judge"),
        ({"alpha": 0}, "alpha"),
        ({"alpha": 1e-9}, "alpha"),
        ({"alpha": 0.9}, "alpha"),
        ({"beta": -1}, "beta"),
        ({"sample_ratio_tolerance": 1.0}, "sample_ratio_tolerance"),
    ],
)
def test_judge_fields_are_validated_by_name(changes: dict, field: str):
    with pytest.raises(ConfigError) as caught:
        plan_from_mapping(changes)
    assert caught.value.ids["field"] == field
    assert f"invalid rollout plan: {field}:" in str(caught.value)


# --------------------------------------------------------------------------- in the machine

V41, V42 = "ranker-v41", "ranker-v42"
PLAN = RolloutPlan(
    steps=(5, 25, 50),
    interval_s=60,
    min_requests=100,
    progress_deadline_s=600,
    checks={"error_rate_floor": 0.01},
    canary_scaling={"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
)


def ready() -> PoolView:
    return PoolView((ReplicaObservation("canary-1", V42, V42, ReplicaPhase.READY),), expected=1)


class Run:
    """A rollout driven tick by tick with windows drawn from ``make_window(rng, canary_bp)``."""

    def __init__(
        self, make_window, seed: int = 0, export_s: float | None = None, plan: RolloutPlan = PLAN
    ) -> None:
        self.export_s = export_s
        self.state = RolloutState.new(
            plan,
            rollout_id="r1",
            model="ranker",
            candidate_artifact_id=V42,
            baseline_artifact_id=V41,
            now=0.0,
        )
        self.now = 0.0
        self.rng = np.random.default_rng(seed)
        self.make_window = make_window
        self.actions: list = []
        self.windows = 0
        self.tick(None)  # pending -> preparing
        self.tick(None)  # canary ready -> step 1 weights set
        self.tick(None)  # router applies them

    def tick(self, win: WindowStats | None):
        self.now += 1.0
        obs = Observations(
            canary=ready(),
            router_weights=self.state.weights,
            window=win,
            in_place_fits=False,
            evidence_interval_s=self.export_s,
        )
        self.state, actions = advance(self.state, obs, self.now)
        self.actions += actions
        return actions

    def window(self):
        """One window of ``export_s`` (an export) or else of the plan's interval."""
        length = self.export_s or self.state.plan.interval_s
        start = max(self.state.weights_live_at or 0.0, self.state.last_analysis_at or 0.0)
        self.now = start + length
        canary, stable = self.make_window(self.rng, self.state.weights.canary_bp)
        self.windows += 1
        self.now -= 1.0
        return self.tick(WindowStats(start, start + length, canary, stable))

    def until_decided(self, limit: int = 60) -> None:
        while not self.state.phase.is_terminal and self.state.phase is not Phase.PROMOTING:
            assert self.windows < limit, self.state.verdicts[-1]
            self.window()
            self.tick(None)  # new weights confirmed by the router


def traffic(canary_error_rate: float, stable_error_rate: float = 0.001, rate: int = 4000):
    def make(rng, canary_bp):
        n_canary = int(rng.binomial(rate, canary_bp / 10_000))
        return (
            cohort(rng, n_canary, canary_error_rate),
            cohort(rng, rate - n_canary, stable_error_rate),
        )

    return make


def test_one_failing_window_rolls_back_at_once_weights_first():
    run = Run(traffic(canary_error_rate=0.2))
    actions = run.window()
    assert run.state.phase is Phase.ROLLED_BACK
    assert run.windows == 1
    assert actions[1].__class__.__name__ == "SetWeights" and actions[1].canary_bp == 0
    assert "evidence against the canary at step 1/3 (5%)" in (run.state.reason or "")
    record = run.state.verdicts[-1]
    assert record.outcome is Outcome.FAIL
    failing = [e for e in record.evidence if e.fail_at is not None and e.against >= e.fail_at]
    assert failing and failing[0].check == "success_rate"


def test_evidence_carries_across_steps_so_later_steps_pass_in_one_window():
    run = Run(traffic(canary_error_rate=0.001))
    run.until_decided()
    assert run.state.phase is Phase.PROMOTING, run.state.verdicts[-1]
    by_step = [v.step_index for v in run.state.verdicts]
    assert by_step.count(1) == 1 and by_step.count(2) == 1  # step 1 took the time it needed
    assert run.state.evidence is not None and run.state.evidence.windows == len(by_step)


def test_evidence_at_every_export_rolls_back_without_waiting_for_the_interval():
    run = Run(traffic(canary_error_rate=0.2, rate=200), export_s=2.0)
    live_at = run.state.weights_live_at or 0.0
    run.window()
    assert run.state.phase is Phase.ROLLED_BACK and run.windows == 1
    assert run.state.last_analysis_at == live_at + 2.0  # not live_at + interval_s (60)
    assert [v.outcome for v in run.state.verdicts] == [Outcome.FAIL]


def test_exports_between_decisions_show_one_verdict_per_interval():
    # 2 s exports of 20 requests at 5% (one canary request each): far from any decision.
    run = Run(traffic(canary_error_rate=0.001, rate=20), export_s=2.0)
    for _ in range(29):
        run.window()
    assert run.state.evidence is not None and run.state.evidence.windows == 29
    assert run.state.verdicts == [] and run.state.inconclusive_windows == 0
    run.window()  # the 30th export closes the first 60 s window of display
    assert [v.outcome for v in run.state.verdicts] == [Outcome.INCONCLUSIVE]
    assert run.state.inconclusive_windows == 1 and run.state.display_since is None
    assert run.state.evidence.windows == 30


def test_a_healthy_canary_is_promoted_at_the_first_export_whose_evidence_suffices():
    # No errors anywhere, 100 req/s: the evidence grows with the requests alone. Judged once
    # a minute, each step waits for its minute to end; judged per export, it passes as soon
    # as its requests suffice.
    by_interval = Run(traffic(canary_error_rate=0.0, stable_error_rate=0.0, rate=6000), seed=5)
    by_interval.until_decided()
    by_export = Run(
        traffic(canary_error_rate=0.0, stable_error_rate=0.0, rate=200), seed=5, export_s=2.0
    )
    by_export.until_decided(limit=3000)
    assert by_interval.state.phase is by_export.state.phase is Phase.PROMOTING
    assert by_export.now < by_interval.now - 60, (by_export.now, by_interval.now)
    assert [v.outcome for v in by_export.state.verdicts][-3:] == [Outcome.PASS] * 3


def test_the_threshold_judge_keeps_its_windows_whatever_the_export_interval():
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "judge": "threshold"})
    run = Run(traffic(canary_error_rate=0.2, rate=200), export_s=2.0, plan=plan)
    live_at = run.state.weights_live_at or 0.0
    run.window()  # 2 s: shorter than the threshold judge's window, not judged
    assert run.state.last_analysis_at is None and run.state.phase is Phase.PROGRESSING
    assert machine.next_window(run.state, live_at + 59, 2.0) is None
    assert machine.next_window(run.state, live_at + 60, 2.0) == (live_at, live_at + 60)


def test_a_restarted_controller_judges_the_next_window_exactly_as_before():
    run = Run(traffic(canary_error_rate=0.001), seed=3)
    run.window()
    run.window()
    saved = RolloutState.from_dict(run.state.to_dict())
    assert saved.evidence is not None and written(saved.evidence) == written(run.state.evidence)
    rng = np.random.default_rng(11)
    canary, stable = traffic(0.001)(rng, run.state.weights.canary_bp)
    start = run.state.last_analysis_at or 0.0
    win = WindowStats(start, start + 60, canary, stable)
    obs = Observations(canary=ready(), router_weights=run.state.weights, window=win)
    live, _ = advance(run.state, obs, start + 60)
    resumed, _ = advance(saved, obs, start + 60)
    assert live.verdicts[-1] == resumed.verdicts[-1]
    assert written(live.evidence) == written(resumed.evidence)


def test_a_state_saved_before_the_sequential_judge_existed_resumes_on_the_threshold_judge():
    run = Run(traffic(0.001))
    old = run.state.to_dict()
    old["schema_version"] = 1
    old.pop("evidence")
    for name in ("judge", "alpha", "beta", "sample_ratio_tolerance"):
        old["plan"].pop(name)  # a version 1 plan had none of these
    for verdict in old["verdicts"]:
        verdict.pop("evidence")
    resumed = RolloutState.from_dict(old)
    assert resumed.evidence is None
    assert resumed.plan.judge == "threshold"  # the judge it was started with


def test_a_histogram_ahead_of_the_request_counter_is_judged_not_refused():
    # The router's histogram is recorded per request, its counter flushed every quarter
    # second: a window may hold more timed requests than counted ones, all of them slow.
    slow = {100.0: 0.0, 5000.0: 0.0, INF: 40.0}
    plan = RolloutPlan()
    verdict, evidence = judge_sequential(
        window(
            CohortStats(30, {"error": 25}, latency_buckets=slow),
            CohortStats(1000, latency_buckets={100.0: 1000.0, INF: 1000.0}),
        ),
        None,
        plan,
        canary_bp=5000,
        step_index=0,
    )
    assert verdict.outcome is Outcome.FAIL, verdict.summary()
    assert evidence.checks["p99_ceiling"].counts == {
        "slower": 40,
        "possibly_slower": 40,
        "requests": 40,
    }


def test_a_sample_ratio_mismatch_holds_alerts_once_and_the_deadline_ends_it():
    # 1% of the traffic at weight 5%: 200 canary requests a window, over min_requests, none
    # failed, as fast as stable. Only the guard stands between these windows and a pass.
    def skewed(rng, canary_bp):
        return cohort(rng, 200, 0.0), cohort(rng, 19_800, 0.0)

    run = Run(skewed)
    for _ in range(12):
        if run.state.phase.is_terminal:
            break
        run.window()
    alerts = [a for a in run.actions if isinstance(a, Alert) and "sample ratio" in a.message]
    assert len(alerts) == 1 and alerts[0].severity == "warning"
    assert run.state.phase is Phase.ROLLED_BACK
    assert "no progress at step 1/3 (5%)" in (run.state.reason or "")
    last = run.state.verdicts[-1]
    guard = next(e for e in last.evidence if e.check == SAMPLE_RATIO)
    assert guard.fail_at is None and guard.pass_at is None and guard.hold_at == 1 / PLAN.alpha
    assert guard.against >= guard.hold_at
    # Every check of the canary itself had passed: the guard is what held the step.
    others = [e for e in last.evidence if e.check != SAMPLE_RATIO]
    assert others and all(e.supporting >= e.pass_at for e in others), others
    assert any("sample ratio mismatch" in r for r in last.reasons)
    assert Weights.stable_only() == run.state.weights
