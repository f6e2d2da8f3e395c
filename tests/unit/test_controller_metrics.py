"""What the controller exports of the sequential judge: every check's evidence and bound while
a rollout is judged, and the evidence set back to 1 (none) once it has ended. Ray's gauges
are replaced by a recorder (this is the pure part: which series get which value); the running
controller's export is checked end to end in tests/e2e/test_acceptance.py."""

from __future__ import annotations

import pytest

from rollout import controller_metrics
from rollout.analysis import CohortStats, WindowStats
from rollout.plan import RolloutPlan
from rollout.sequential import enabled_checks, judge_sequential
from rollout.state import Phase, RolloutState


class RecordingGauge:
    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]) -> None:
        self.name, self.tag_keys = name, tag_keys
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys)
        self.values[tuple(tags[k] for k in self.tag_keys)] = value


class RecordingCounter:
    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]) -> None:
        self.name, self.tag_keys = name, tag_keys
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys) and value > 0
        key = tuple(tags[k] for k in self.tag_keys)
        self.values[key] = self.values.get(key, 0.0) + value


@pytest.fixture
def exported() -> controller_metrics.ControllerMetrics:
    return controller_metrics.ControllerMetrics(gauge=RecordingGauge, counter=RecordingCounter)


def test_drift_repairs_are_counted_once_each_by_what_drifted(exported) -> None:
    exported.publish_drift("ranker", {})
    exported.publish_drift("ranker", {"canary.target": 1, "router.canary_bp": 1})
    exported.publish_drift("ranker", {"canary.target": 1, "router.canary_bp": 1})  # no new one
    exported.publish_drift("ranker", {"canary.target": 3, "router.canary_bp": 1})
    assert exported.drift_repairs.values == {
        ("ranker", "canary.target"): 3.0,
        ("ranker", "router.canary_bp"): 1.0,
    }


def judged_state(model: str = "ranker") -> RolloutState:
    plan = RolloutPlan()
    state = RolloutState.new(
        plan,
        rollout_id="r1",
        model=model,
        candidate_artifact_id="b",
        baseline_artifact_id="a",
        now=0.0,
    )
    canary = CohortStats(500, latency_buckets={50.0: 500.0, float("inf"): 500.0})
    stable = CohortStats(9500, latency_buckets={50.0: 9500.0, float("inf"): 9500.0})
    _, state.evidence = judge_sequential(
        WindowStats(0, 60, canary, stable), None, plan, canary_bp=500, step_index=0
    )
    state.phase = Phase.PROGRESSING
    return state


def test_every_check_and_side_is_exported_with_its_bound(exported) -> None:
    state = judged_state()
    exported.publish(state)
    checks = enabled_checks(state.plan.checks)
    keys = set(exported.evidence.values)
    assert ("ranker", "sample_ratio", "against") in keys
    assert {k for k in keys if k[1] != "sample_ratio"} == {
        ("ranker", c, side) for c in state.evidence.checks for side in ("against", "for")
    }
    assert len(state.evidence.checks) == checks
    assert keys == set(exported.bound.values)
    assert exported.bound.values[("ranker", "success_rate", "against")] == checks / state.plan.alpha
    assert exported.bound.values[("ranker", "success_rate", "for")] == 1 / state.plan.beta
    assert exported.evidence.values[("ranker", "success_rate", "for")] > 1  # 500 good requests


def test_the_evidence_is_set_back_to_one_once_the_rollout_ends(exported) -> None:
    state = judged_state()
    exported.publish(state)
    assert any(v != 1.0 for v in exported.evidence.values.values())
    state.phase = Phase.ROLLED_BACK
    exported.publish(state)
    assert set(exported.evidence.values.values()) == {1.0}
    # And with no rollout at all (the controller's next ticks), nothing is set again.
    exported.evidence.values.clear()
    exported.publish(None)
    assert exported.evidence.values == {}


def test_a_new_rollout_of_another_model_resets_the_last_ones_series(exported) -> None:
    exported.publish(judged_state("ranker"))
    exported.publish(judged_state("ranker-lite"))
    stale = {k: v for k, v in exported.evidence.values.items() if k[0] == "ranker"}
    assert stale and set(stale.values()) == {1.0}
    live = {k: v for k, v in exported.evidence.values.items() if k[0] == "ranker-lite"}
    assert any(v != 1.0 for v in live.values())
