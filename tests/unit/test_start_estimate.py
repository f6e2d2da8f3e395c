"""A start under the sequential judge: the traffic of the last minutes, the estimate made from
it, the deadline it sets, and the refusal of a plan that cannot fit (rollout/start_estimate.py
through the engine, with the engine's test world: tests/unit/engine_world.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from app.errors import PlanDoesNotFit
from app.registry import Registry
from rollout.analysis import CohortStats, WindowStats
from rollout.cli.render import render_status
from rollout.plan import RolloutPlan
from rollout.start_estimate import TRAFFIC_LOOKBACK_S
from tests.unit.engine_world import V42, World, seeded_registry
from tests.unit.test_estimate import histogram


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return seeded_registry(tmp_path)


def traffic_of(rate: float, error_rate: float = 0.002):
    """Stable's answers at ``rate`` req/s over any window (latencies ~40 ms)."""
    rng = np.random.default_rng(3)

    def stats(start: float, end: float) -> WindowStats:
        n = int(rate * (end - start))
        latencies = rng.lognormal(math.log(40.0), 0.4, n)
        errors = round(n * error_rate)
        stable = CohortStats(
            n, {"error": errors} if errors else {}, latency_buckets=histogram(latencies)
        )
        return WindowStats(start, end, canary=None, stable=stable)

    return stats


def world_at(registry: Registry, rate: float | None, error_rate: float = 0.002) -> World:
    """The engine's test world with stable's traffic at ``rate`` (None: none measured yet)
    and its replicas reported."""
    world = World(registry)
    world.windows.stats = None if rate is None else traffic_of(rate, error_rate)
    world.replicas_report()
    return world


def plan(**changes) -> RolloutPlan:
    return RolloutPlan.model_validate(
        {
            "steps": [1, 50, 100],
            "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
            **changes,
        }
    )


def test_a_step_that_cannot_pass_within_the_plans_deadline_is_refused_naming_what_fits(
    registry: Registry,
) -> None:
    world = world_at(registry, 40.0)
    with pytest.raises(PlanDoesNotFit) as refused:
        world.engine.start_rollout(V42, plan(progress_deadline_s=300))
    message = str(refused.value)
    assert message.startswith("plan: step 1/3 (1%): a healthy canary passes in about")
    assert "at the 40.0 req/s measured over the last 300 s" in message
    assert "the progress deadline is 300 s. Changes that fit: a step of" in message
    assert "progress_deadline_s: " in message and "--force starts it anyway" in message
    assert world.engine.live is None  # nothing started, nothing written
    assert registry.list_rollouts("ranker", "default", limit=5) == []
    # The traffic was measured over the lookback, from the start's moment.
    assert (world.now - TRAFFIC_LOOKBACK_S, world.now) in world.windows.asked


def test_the_deadline_the_refusal_names_is_one_that_fits(registry: Registry) -> None:
    world = world_at(registry, 40.0)
    with pytest.raises(PlanDoesNotFit) as refused:
        world.engine.start_rollout(V42, plan(progress_deadline_s=300))
    named = float(str(refused.value).split("progress_deadline_s: ")[1].split()[0])
    summary = world.engine.start_rollout(V42, plan(progress_deadline_s=named))
    assert summary.estimate is not None and all(s.fits for s in summary.estimate.steps)


def test_force_starts_it_anyway_and_says_so(registry: Registry) -> None:
    world = world_at(registry, 40.0)
    summary = world.engine.start_rollout(V42, plan(progress_deadline_s=300), force=True)
    found = summary.estimate
    assert found is not None and found.forced and found.deadline_source == "plan"
    assert not found.steps[0].fits and found.deadline_s == 300
    created = world.engine.live.events[0]
    assert "started with --force against the estimate" in created.message
    assert "DOES NOT FIT" in render_status(summary)


def test_a_plan_that_leaves_its_deadline_to_the_estimate_gets_one_that_fits(
    registry: Registry,
) -> None:
    world = world_at(registry, 40.0)
    summary = world.engine.start_rollout(V42, plan())
    found = summary.estimate
    assert found is not None and found.deadline_source == "estimate" and not found.forced
    assert found.deadline_s >= 600 and found.deadline_s % 60 == 0
    assert all(s.fits for s in found.steps)
    late = found.steps[0].pass_late_s
    assert late is not None and found.deadline_s >= late
    # The rollout runs with that deadline: it is in the plan persisted with it.
    assert world.engine.live.state.plan.progress_deadline_s == found.deadline_s
    record = registry.list_rollouts("ranker", "default", limit=1)[0]
    assert record.plan["progress_deadline_s"] == found.deadline_s
    text = render_status(summary)
    assert "estimate at 40 req/s" in text and "(from the estimate)" in text


def test_without_traffic_measured_the_plan_starts_on_the_default_deadline(
    registry: Registry,
) -> None:
    world = world_at(registry, None)  # no two snapshots yet
    summary = world.engine.start_rollout(V42, plan())
    assert summary.estimate is None
    assert world.engine.live.state.plan.deadline_s == 600
    created = world.engine.live.events[0]
    assert "no estimate (not enough traffic measured before the start)" in created.message


def test_a_canary_like_a_stable_outside_its_bound_is_refused_even_with_an_estimated_deadline(
    registry: Registry,
) -> None:
    # Stable fails 5% of requests: a canary like it misses the 98% success rate, however long
    # the deadline.
    world = world_at(registry, 100.0, error_rate=0.05)
    with pytest.raises(PlanDoesNotFit, match="cannot promote a healthy canary here"):
        world.engine.start_rollout(V42, plan())


def test_between_rollouts_the_controller_measures_traffic_every_15_s(registry: Registry) -> None:
    world = World(registry)
    for _ in range(60):
        world.tick()  # one second each, no rollout
    assert world.windows.observed == 4  # at 0, 15, 30 and 45 s
