"""The rollout controller on a real Ray Serve cluster, under load.

A second Serve application (``rollout-e2e`` at ``/rollout``) runs in the session's cluster
with its own replicas, so revisions start from the registry's (1, 2, ...) and the replicas
report to the real controller actor. Every test starts with stable on ranker-v41, no rollout
active, and ends the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray

from app.registry import Registry, open_registry
from rollout.controller import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    ControllerSettings,
    ensure_controller,
    get_controller,
)
from rollout.serve_control import ServeControl
from rollout.traffic import RequestRecord, TrafficRun, TrafficSpec, cohort_share
from tests import artifacts
from tests.e2e.conftest import Cluster, wait_for

pytestmark = pytest.mark.e2e

APP = "rollout-e2e"
PREFIX = "/rollout"
BASELINE, CANDIDATE = "ranker-v41", "ranker-v42"

FAST_PLAN: dict[str, Any] = {
    "steps": [20, 50, 100],
    "interval_s": 3,
    "min_requests": 5,
    "threshold": 2,
    "progress_deadline_s": 60,
    "promotion": "shift",
    "checks": {
        "success_rate_min": 0.99,
        "p99_max_ms": 3000,
        "error_rate_max_ratio": 3.0,
        "error_rate_floor": 0.02,
        "p99_max_ratio": 4.0,
        "p99_slack_ms": 150,
    },
    "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
}


@dataclass
class RolloutEnv:
    cluster: Cluster
    registry: Registry
    control: ServeControl
    settings: ControllerSettings
    url: str

    @property
    def controller(self) -> Any:
        return ensure_controller(self.settings)

    def status(self) -> dict[str, Any]:
        return ray.get(self.controller.status.remote(), timeout=60)

    def start(self, candidate: str, plan: dict[str, Any] | None = None) -> dict[str, Any]:
        return ray.get(
            self.controller.start_rollout.remote(candidate, plan or FAST_PLAN, "e2e"), timeout=60
        )

    def command(self, name: str, reason: str = "") -> dict[str, Any]:
        return ray.get(self.controller.command.remote(name, reason), timeout=60)

    def wait_for_phase(self, *phases: str, timeout: float = 90, finished: bool = False) -> dict:
        def reached() -> dict[str, Any] | None:
            view = self.status()
            if view.get("phase") in phases and (view.get("finished") or not finished):
                return view
            return None

        desc = f"rollout phase {'/'.join(phases)}{' (finished)' if finished else ''}"
        return wait_for(reached, timeout, desc, every=0.3)

    def stable_target(self) -> str:
        return self.registry.get_target("ranker", "default", "stable").artifact_id

    def traffic(self, rate: float = 30) -> TrafficRun:
        return TrafficRun(
            TrafficSpec(url=self.url, rate=rate, max_requests=50_000, max_seconds=600, users=500)
        ).start()

    def replica_ids(self, deployment: str) -> set[str]:
        status = self.control.deployment_status(APP, deployment)
        return {r["replica_id"] for r in status["replicas"] if r["state"] == "RUNNING"}


def failed(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not 200 <= r.status < 300]


def register(registry: Registry, packed: Any) -> None:
    registry.register_artifact(packed.manifest_uri, packed.manifest_sha256)
    registry.approve_artifact("ranker", packed.artifact_id, actor="e2e")


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[RolloutEnv]:
    registry_url = f"sqlite:///{cluster.work / 'rollout-registry.db'}"
    registry = open_registry(registry_url)
    for name in (BASELINE, CANDIDATE):
        register(registry, cluster.demo[name])
    stable = registry.publish(
        "ranker", "default", "stable", BASELINE, 0, actor="e2e", reason="init"
    )
    control = ServeControl(cluster.dashboard_url)
    app = {
        "name": APP,
        "route_prefix": PREFIX,
        "import_path": "app.main:build_app",
        "args": {
            "stable": {
                "num_replicas": 1,
                "num_cpus": 0.1,
                "target": {
                    "revision": stable.revision,
                    "artifact_id": stable.artifact_id,
                    "manifest_uri": stable.manifest_uri,
                    "manifest_sha256": stable.manifest_sha256,
                },
            },
            "canary": {"num_replicas": 1, "num_cpus": 0.1},
            "router": {"probe_interval_s": 0.5, "request_timeout_s": 10.0},
            "router_num_cpus": 0.1,
            "cache_dir": str(cluster.work / "rollout-cache"),
            "retry": {"initial_s": 0.05, "cap_s": 0.2, "max_attempts": 2},
            "controller": {"name": CONTROLLER_NAME, "namespace": CONTROLLER_NAMESPACE},
            "report_interval_s": 0.5,
        },
    }
    control.update(lambda config: config["applications"].append(app))
    wait_for(
        lambda: (control.details()["applications"].get(APP) or {}).get("status") == "RUNNING",
        180,
        f"{APP} RUNNING",
    )
    settings = ControllerSettings(
        registry_url=registry_url,
        dashboard_url=cluster.dashboard_url,
        app_name=APP,
        metrics_endpoints=(cluster.metrics_url,),
        tick_interval_s=0.3,
        metrics_delay_s=1.2,
        report_stale_s=10,
    )
    environment = RolloutEnv(cluster, registry, control, settings, cluster.http_url + PREFIX)
    try:
        yield environment
    finally:
        handle = get_controller()
        if handle is not None:
            ray.kill(handle, no_restart=True)
        control.update(
            lambda config: config.update(
                applications=[a for a in config["applications"] if a["name"] != APP]
            )
        )
        control.close()
        registry.close()


@pytest.fixture
def rollout_env(env: RolloutEnv) -> Iterator[RolloutEnv]:
    """Each test starts and ends with stable on the baseline and no rollout running."""
    assert env.stable_target() == BASELINE
    yield env
    view = env.status()
    if view.get("rollout") and not view.get("finished"):
        env.command("abort", "test teardown")
        env.wait_for_phase("aborted", "rolled_back", "failed", "succeeded", finished=True)
    if env.stable_target() != BASELINE:
        ray.get(env.controller.rollback_stable.remote(BASELINE, "e2e", "reset"), timeout=60)


def test_full_rollout_and_promotion_under_load(rollout_env: RolloutEnv) -> None:
    env = rollout_env
    stable_ids = env.replica_ids("stable")
    run = env.traffic()
    wait_for(lambda: len(run.records) >= 20, 60, "traffic flowing")
    started = run.now_s()
    env.start(CANDIDATE)
    view = env.wait_for_phase("succeeded", "rolled_back", "failed", finished=True, timeout=150)
    records = run.stop()

    assert view["phase"] == "succeeded", (view["reason"], view["verdicts"], view["events"])
    assert not failed(records), failed(records)[:5]
    assert env.stable_target() == CANDIDATE
    # Promotion moved stable by hot swap: the same replicas, now answering from v42.
    assert env.replica_ids("stable") == stable_ids
    assert {r.artifact_id for r in records if r.start_s > run.now_s() - 1} <= {CANDIDATE}
    canary_answers = [r for r in records if r.start_s > started and r.cohort == "canary"]
    assert canary_answers and {r.artifact_id for r in canary_answers} == {CANDIDATE}
    # Every target change went through the registry with an audit row.
    history = env.registry.history("ranker", "default")
    assert any(h.cohort == "canary" and h.new_artifact_id == CANDIDATE for h in history)
    assert any(h.cohort == "stable" and h.new_artifact_id == CANDIDATE for h in history)
    events = [e["event"] for e in view["events"]]
    assert "finished" in events
    record = env.registry.list_rollouts("ranker", "default", limit=1)[0]
    assert record.phase == "succeeded" and not record.active


def test_controller_killed_mid_rollout_resumes_at_the_same_step(rollout_env: RolloutEnv) -> None:
    env = rollout_env
    plan = {**FAST_PLAN, "gates": {"pause_before_steps": [50]}}
    run = env.traffic()
    env.start(CANDIDATE, plan)
    held = env.wait_for_phase("paused", timeout=90)
    assert held["weights"]["canary_bp"] == 2000 and held["pending_gate"]

    ray.kill(get_controller(), no_restart=True)  # a crash; nothing runs the rollout now
    wait_for(lambda: get_controller() is None, 30, "controller gone")
    assert len(run.records) > 0
    resumed = env.status()  # ensure_controller starts a new one: it resumes from the registry
    assert resumed["rollout"] == held["rollout"]
    assert (resumed["phase"], resumed["step"], resumed["weights"]) == (
        "paused",
        held["step"],
        held["weights"],
    )
    # Ray restarts a controller that dies on its own (max_restarts): same story.
    ray.kill(get_controller(), no_restart=False)
    wait_for(lambda: env.status()["phase"] == "paused", 60, "restarted controller paused")

    env.command("resume")
    view = env.wait_for_phase("succeeded", "rolled_back", "failed", finished=True, timeout=150)
    records = run.stop()
    assert view["phase"] == "succeeded", (view["reason"], view["verdicts"], view["events"])
    assert not failed(records), failed(records)[:5]


def test_registry_conflict_stops_the_rollout_without_overwriting(rollout_env: RolloutEnv) -> None:
    env = rollout_env
    plan = {**FAST_PLAN, "gates": {"pause_before_steps": [50]}}
    run = env.traffic()
    env.start(CANDIDATE, plan)
    env.wait_for_phase("paused", timeout=90)

    # Another writer (an operator's script) points canary elsewhere behind the rollout's back.
    current = env.registry.get_target("ranker", "default", "canary")
    theirs = env.registry.publish(
        "ranker", "default", "canary", BASELINE, current.revision, actor="someone", reason="x"
    )
    view = env.wait_for_phase("aborted", finished=True, timeout=60)
    records = run.stop()

    assert "registry conflict" in (view["reason"] or ""), view
    assert view["weights"] == {"stable_bp": 10_000, "canary_bp": 0}
    after = env.registry.get_target("ranker", "default", "canary")
    assert (after.revision, after.artifact_id) == (theirs.revision, BASELINE), "overwritten"
    assert env.stable_target() == BASELINE
    assert not failed(records), failed(records)[:5]


def test_candidate_that_fails_its_dry_run_fails_the_rollout(
    rollout_env: RolloutEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = rollout_env
    bad = artifacts.nan_weights_artifact(tmp_path_factory.mktemp("nan") / "art")
    register(env.registry, bad)
    run = env.traffic()
    env.start(bad.artifact_id)
    view = env.wait_for_phase("failed", "rolled_back", finished=True, timeout=90)
    records = run.stop()

    assert view["phase"] == "failed", view
    assert "dry_run" in (view["reason"] or ""), view["reason"]
    assert not failed(records)
    assert not [r for r in records if r.artifact_id == bad.artifact_id], "bad model answered"
    assert env.stable_target() == BASELINE


def test_operator_rollback_is_weights_first(rollout_env: RolloutEnv) -> None:
    env = rollout_env
    plan = {**FAST_PLAN, "gates": {"pause_before_steps": [50]}}
    run = env.traffic(rate=40)
    env.start(CANDIDATE, plan)
    env.wait_for_phase("paused", timeout=90)
    asked = run.now_s()
    env.command("rollback", "operator saw something")
    view = env.wait_for_phase("rolled_back", finished=True, timeout=60)

    def all_stable_since() -> float | None:
        recent = [r for r in run.records if r.start_s > asked and r.cohort]
        for i, record in enumerate(recent):
            if all(r.cohort == "stable" for r in recent[i:]) and len(recent) - i >= 20:
                return record.start_s
        return None

    switched_at = wait_for(all_stable_since, 30, "clients answered by stable only")
    records = run.stop()
    assert view["reason"] == "operator saw something"
    assert not failed(records)
    assert switched_at - asked < 10, f"{switched_at - asked:.1f}s to stable 100%"
    share = cohort_share(records, switched_at, float("inf"))
    assert share == {"stable": 1.0}
