"""Serve's autoscaling under a rollout, on the session cluster's ``rollout-e2e`` application
switched to ``autoscaling_config`` for the scenario (and back to fixed sizes before the next
test on the app, if any):

- the idle canary pool holds no replica; the rollout raises the autoscaler's floor before any
  traffic and lowers it back to 0 at the end, and the pool goes back to no replica;
- under rising load during a step, Serve's autoscaler adds a stable replica, which loads
  stable's target before it answers; no request fails.

Counts, not timings: failed requests, replicas RUNNING, which replica answered with what.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rollout.serve_control import deployment_entry
from tests.e2e.dsl import Scenario, plan
from tests.e2e.harness import BASELINE, CANDIDATE, ROLLOUT_APP, RolloutEnv, failed

pytestmark = [pytest.mark.e2e, pytest.mark.autoscaling]

# The sizes go back to fixed ones only when a later test uses the app (tests/e2e/conftest.py
# runs this module last on it): switching back restarts every replica, and at the end of the
# modules on the shared app it would be paid for nothing.
CHANGES_THE_SHARED_APP = True

# The autoscaler's decisions at test speed (Serve's defaults wait 30 s to scale up and 10
# minutes to scale down).
QUICK = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0, "upscale_delay_s": 1.0}


def sized(env: RolloutEnv, sizes: dict[str, dict[str, Any]]) -> None:
    """Each deployment's size in Serve's declarative config, in one PUT: ``{"num_replicas":
    n}`` or ``{"autoscaling_config": {...}}`` (the other one removed), the rest as it is."""

    def mutate(config: dict[str, Any]) -> None:
        for deployment, sizing in sizes.items():
            entry = deployment_entry(config, ROLLOUT_APP, deployment)
            assert entry is not None
            for key in ("num_replicas", "autoscaling_config"):
                entry.pop(key, None)
            entry.update(sizing)

    env.control.update(mutate)


def running(env: RolloutEnv, deployment: str) -> set[str]:
    return env.replica_ids(deployment)


def waits_for(env: RolloutEnv, deployment: str, count: int) -> Callable[[], bool]:
    return lambda: len(running(env, deployment)) == count


def running_again(s: Scenario, why: str) -> None:
    """After a change of the app's code version (an autoscaling_config added or removed in
    the config's deployments list): Serve rebuilds the app and restarts every replica."""
    env = s.env
    s.wait(f"the app RUNNING again ({why})", lambda: env.control.app_status(ROLLOUT_APP)
           == "RUNNING" and len(running(env, "stable")) == 1, 180)  # fmt: skip


def test_autoscaled_pools_scale_with_the_rollout_and_the_load(scenario: Scenario) -> None:
    s = scenario
    env = s.env

    def router_probes_idle_canary(probe: bool) -> None:
        env.control.update_user_configs(
            ROLLOUT_APP, {"router": lambda config: {**config, "probe_idle_canary": probe}}
        )

    def fixed_sizes() -> None:
        router_probes_idle_canary(True)
        sized(env, {"stable": {"num_replicas": 1}, "canary": {"num_replicas": 1}})
        running_again(s, "fixed sizes")

    # Both switched in one PUT before any traffic: adding an autoscaling_config to the
    # config's deployments list changes the app's code version, and Serve restarts every
    # replica (docs/deploying.md, "Autoscaling": set it when deploying, then only its values
    # change).
    canary = {"min_replicas": 0, "max_replicas": 1, "target_ongoing_requests": 1,
              "downscale_delay_s": 1, **QUICK}  # fmt: skip
    # Stable scales down after 10 s, not Serve's 10 minutes: the replicas' first answers
    # after the restart are slow (cold torch, the canary pool starting and stopping beside
    # them on two cores), and a burst of them may ask for a second stable replica before
    # the low-load baseline below is taken.
    stable = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.5,
              "downscale_delay_s": 10, **QUICK}  # fmt: skip
    sized(env, {"canary": {"autoscaling_config": canary},
                "stable": {"autoscaling_config": stable}})  # fmt: skip
    env.restore_before_next_use("fixed sizes again", fixed_sizes)
    running_again(s, "autoscaled")
    # As configs/serve.yaml says for a canary that idles at zero: a probe would start one.
    router_probes_idle_canary(False)
    s.given.stable_on(BASELINE).steady_traffic(rate=5)
    # Idle between rollouts: no target, and the router does not probe it (probe_idle_canary
    # off), so nothing asks the autoscaler for a replica.
    s.wait("the idle canary pool down to no replica", waits_for(env, "canary", 0), 120)
    s.wait("one stable replica at low load", waits_for(env, "stable", 1), 60)
    stable_before = running(env, "stable")
    s.check(len(stable_before) == 1, f"stable replicas at low load: {stable_before}")

    scaling = {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 0}
    # Two steps: the surge comes while the rollout is held at 20%; one step after it is all
    # that promotion needs here (no share is counted).
    held = plan(steps=[20, 100], canary_scaling=scaling, gates={"pause_before_steps": [100]})
    s.when.start_rollout(CANDIDATE, held).wait_for_phase("paused", timeout=180)
    s.check(len(running(env, "canary")) == 1, "the rollout raised the canary pool's floor")

    # Rising load during the step: Serve adds a stable replica, which loads stable's target
    # (its user_config) before it is sent a request.
    surge = env.traffic(rate=40)
    try:
        s.wait("a second stable replica", waits_for(env, "stable", 2), 120)
        (new,) = running(env, "stable") - stable_before
        s.when.wait_for_answers(
            f"answers from the new stable replica {new}",
            lambda r: r.replica == new,
            count=10,
            after="phase paused",
            timeout=90,
        )
    finally:
        surge_records = surge.stop()
    stable_target = env.registry.get_target("ranker", "default", "stable")
    from_new = [r for r in [*s.current_records(), *surge_records] if r.replica == new]
    s.check(
        {(r.cohort, r.artifact_id, r.revision) for r in from_new}
        == {("stable", BASELINE, stable_target.revision)},
        f"the new stable replica answered with something else: "
        f"{ {(r.cohort, r.artifact_id, r.revision) for r in from_new} }",
    )
    s.check(
        not failed(surge_records), f"failed requests under the surge: {failed(surge_records)[:5]}"
    )

    s.when.command("resume").wait_for_finish(timeout=180)
    s.then.expect_phase("succeeded").expect_stable_target(CANDIDATE)
    s.wait("the canary pool back to no replica", waits_for(env, "canary", 0), 120)
    s.when.stop_traffic()
    s.then.expect_failed_requests(at_most=0)
