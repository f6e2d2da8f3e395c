"""A second Serve application in the session cluster, driven by the real rollout controller.

``rollout-e2e`` at ``/rollout`` has its own router, stable and canary replicas, so revisions
start from the registry's (1, 2, ...) and its replicas report to the real controller actor
(``rollout-controller``), while the session's first application keeps serving the data-plane
tests. Used by the controller tests and the acceptance scenarios; tests/e2e/conftest.py
makes ``env`` (module scope) and ``rollout_env`` (per test) available as fixtures.
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
from rollout.traffic import RequestRecord, TrafficRun, TrafficSpec
from tests.e2e.conftest import Cluster, wait_for

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
def env(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[RolloutEnv]:
    # A registry per module: the application (and so its replicas' revision memory) is new
    # for every module, and revisions start again from 1.
    module = request.module.__name__.rsplit(".", 1)[-1]
    registry_url = f"sqlite:///{cluster.work / f'rollout-registry-{module}.db'}"
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
    # Every test finds the controller running, whichever test of the module runs first.
    ensure_controller(settings)
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
        wait_for(
            lambda: APP not in (control.details().get("applications") or {}),
            120,
            f"{APP} deleted",
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
