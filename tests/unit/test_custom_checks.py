"""Custom checks in a plan (rollout.plan.CustomCheck): validation, the queries as Prometheus gets
them, and the sequential judge's verdicts on their readings (rollout.custom_judge). The same
against a real Prometheus server: tests/integration/test_custom_checks_prometheus.py."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from rollout.analysis import CohortStats, CustomSample, Outcome, WindowStats
from rollout.custom_checks import render
from rollout.plan import RolloutPlan, plan_from_mapping
from rollout.sequential import judge_sequential, judged_checks

CHECKOUT = {
    "name": "checkout_errors",
    "events": 'sum(increase(checkout_failures_total{cohort="{{cohort}}"}[{{window}}]))',
    "trials": 'sum(increase(checkout_attempts_total{cohort="{{cohort}}"}[{{window}}]))',
    "max_rate": 0.02,
}
QUEUE = {"name": "queue_depth", "query": 'max(queue{cohort="{{cohort}}"})', "max": 100.0}


def plan(*custom: dict, **changes) -> RolloutPlan:
    # Only the success rate among the built-in checks, so that the custom ones decide.
    checks = {"p99_max_ms": None, "error_rate_max_ratio": None, "p99_max_ratio": None}
    return RolloutPlan.model_validate(
        {"steps": [50, 100], "min_requests": 10, "checks": checks,
         "custom_checks": list(custom), **changes}
    )  # fmt: skip


def window(**custom: CustomSample) -> WindowStats:
    healthy = CohortStats(1000)
    return WindowStats(0.0, 5.0, healthy, healthy, custom=custom)


def counts(canary: tuple[int, int], stable: tuple[int, int] = (0, 1000)) -> CustomSample:
    return CustomSample(
        events={"canary": canary[0], "stable": stable[0]},
        trials={"canary": canary[1], "stable": stable[1]},
    )


@pytest.mark.parametrize(
    ("check", "field", "says"),
    [
        ({**CHECKOUT, "max_rate": None}, "custom_checks", "events, trials and max_rate"),
        ({**CHECKOUT, "query": "up"}, "custom_checks", "no query, max or min"),
        ({"name": "q", "query": "up"}, "custom_checks", "a query with max"),
        ({**QUEUE, "min": 200.0}, "custom_checks", "min 200 is above max 100"),
        ({**QUEUE, "name": "success_rate"}, "custom_checks", "the name of a built-in check"),
        ({**QUEUE, "name": "Bad-Name"}, "custom_checks.0.name", "should match pattern"),
        ({**QUEUE, "query": "x[{{range}}]"}, "custom_checks.0.query", "{{range}} is not a"),
    ],
)
def test_a_custom_check_that_cannot_be_judged_is_refused_naming_it(check, field, says) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_from_mapping({"custom_checks": [check]})
    assert field in str(refused.value) and says in str(refused.value), refused.value


def test_custom_checks_need_the_sequential_judge_and_distinct_names() -> None:
    with pytest.raises(ConfigError, match="custom_checks: judged by the sequential judge"):
        plan_from_mapping({"judge": "threshold", "custom_checks": [QUEUE]})
    with pytest.raises(ConfigError, match="names must differ"):
        plan_from_mapping({"custom_checks": [QUEUE, {**QUEUE, "max": 5.0}]})


def test_queries_get_the_cohort_the_app_quoted_and_the_window_to_the_millisecond() -> None:
    query = render(
        'sum(increase(x{app="{{app}}", cohort="{{ cohort }}"}[{{window}}]))',
        cohort="canary",
        app='a"b\\c',
        window_s=5.25,
    )
    assert query == 'sum(increase(x{app="a\\"b\\\\c", cohort="canary"}[5250ms]))'


def test_counts_checks_share_alpha_and_advisory_ones_do_not() -> None:
    assert judged_checks(plan()) == 1
    assert judged_checks(plan(CHECKOUT)) == 2
    assert judged_checks(plan({**CHECKOUT, "advisory": True})) == 1
    assert judged_checks(plan(QUEUE)) == 1  # a gate, no evidence: no share of alpha


def test_a_counts_check_fails_a_canary_over_its_rate_and_passes_one_under_it() -> None:
    bad, good = plan(CHECKOUT), plan(CHECKOUT)
    verdict, evidence = judge_sequential(
        window(checkout_errors=counts((60, 500))), None, bad, canary_bp=5000, step_index=0
    )
    assert verdict.outcome is Outcome.FAIL, verdict.summary()
    assert "checkout_errors: canary 12.00% (60 in 500) vs at most 2.00%" in verdict.summary()
    evidence = None
    for _ in range(6):
        verdict, evidence = judge_sequential(
            window(checkout_errors=counts((0, 500))), evidence, good, canary_bp=5000, step_index=0
        )
    assert verdict.outcome is Outcome.PASS, verdict.summary()
    assert evidence is not None and evidence.checks["checkout_errors"].e_for >= 20


def test_an_advisory_check_is_judged_and_shown_but_never_acts() -> None:
    advisory = plan({**CHECKOUT, "advisory": True})
    evidence = None
    for _ in range(6):
        verdict, evidence = judge_sequential(
            window(checkout_errors=counts((60, 500))), evidence, advisory, canary_bp=5000,
            step_index=0,
        )  # fmt: skip
    assert verdict.outcome is Outcome.PASS, verdict.summary()  # the success rate passes it
    shown = next(c for c in verdict.checks if c.name == "checkout_errors")
    assert shown.advisory and shown.outcome is Outcome.FAIL
    assert shown.reason.startswith("checkout_errors (advisory): canary 12.00%")
    assert evidence is not None and evidence.checks["checkout_errors"].e_against > 1e6


def test_a_level_gate_holds_then_fails_after_its_limit_in_a_row() -> None:
    gated = plan({**QUEUE, "failure_limit": 3})
    high = CustomSample(value={"canary": 250.0, "stable": 40.0})
    low = CustomSample(value={"canary": 30.0, "stable": 40.0})
    outcomes, evidence = [], None
    for sample in (high, high, low, high, high, high):
        verdict, evidence = judge_sequential(
            window(queue_depth=sample), evidence, gated, canary_bp=5000, step_index=0
        )
        outcomes.append(verdict.outcome)
    # Two out of bounds hold; a value inside resets the run; the third in a row fails.
    assert outcomes[:2] == [Outcome.INCONCLUSIVE] * 2
    assert outcomes[-1] is Outcome.FAIL
    assert "queue_depth: canary 250 (stable 40), at most 100: out of bounds 3 time(s)" in (
        verdict.summary()
    )
    nothing, _ = judge_sequential(window(), None, gated, canary_bp=5000, step_index=0)
    assert nothing.outcome is Outcome.INCONCLUSIVE
    assert "queue_depth: no value for the canary" in nothing.summary()


def test_an_advisory_level_gate_never_holds() -> None:
    watched = plan({**QUEUE, "advisory": True, "failure_limit": 1})
    evidence, verdict = None, None
    for _ in range(8):
        verdict, evidence = judge_sequential(
            window(queue_depth=CustomSample(value={"canary": 999.0})), evidence, watched,
            canary_bp=5000, step_index=0,
        )  # fmt: skip
    assert verdict is not None and verdict.outcome is Outcome.PASS, verdict.summary()


# ---------------------------------------------------------------------------- in the engine


class FakeReader:
    """Reads every custom check as the canary failing 30% of 200 checkouts."""

    def __init__(self) -> None:
        self.asked: list[tuple[float, float]] = []

    def read(self, checks, start: float, end: float):
        self.asked.append((start, end))
        return {c.name: counts((60, 200)) for c in checks}


def test_the_engine_refuses_custom_checks_without_a_prometheus_server(tmp_path) -> None:
    from tests.unit.engine_world import V42, World, seeded_registry

    world = World(seeded_registry(tmp_path))
    world.replicas_report()
    with pytest.raises(ConfigError, match="custom_checks: read from a Prometheus server"):
        world.engine.start_rollout(V42, plan(CHECKOUT))
    assert world.engine.live is None


def test_the_engine_reads_custom_checks_over_each_window_and_rolls_back_on_them(
    tmp_path,
) -> None:
    from tests.unit.engine_world import V42, World, seeded_registry

    world = World(seeded_registry(tmp_path))
    reader = FakeReader()
    world.engine.custom_checks = reader  # as the settings' Prometheus server would
    world.replicas_report()
    world.engine.start_rollout(
        V42, plan(CHECKOUT, canary_scaling={"min_replicas": 1, "max_replicas": 1})
    )
    summary = world.run(ticks=200)
    assert summary.phase == "rolled_back", summary
    assert "checkout_errors: canary 30.00% (60 in 200)" in (summary.reason or "")
    # Read over exactly the windows the judge was given.
    asked = {(round(a, 3), round(b, 3)) for a, b in world.windows.asked}
    assert reader.asked and {(round(a, 3), round(b, 3)) for a, b in reader.asked} <= asked
