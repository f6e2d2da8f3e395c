"""The whole system on one machine: Ray + Serve on free ports, an SQLite registry holding the
demo artifacts, the app deployed declaratively with v41 stable, and the controller actor.

Shared by ``rollout demo`` and the benchmarks, so both measure the thing a user runs.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.contracts import ControllerSettings
from app.errors import NotFound
from app.packing import PackResult
from app.registry import Registry

BASELINE = "ranker-v41"
CANDIDATE = "ranker-v42"
APP = "ranker"


@dataclass
class LocalStack:
    workdir: Path
    cluster: Any  # rollout.local.cluster.LocalCluster
    registry: Registry
    registry_url: str
    packed: dict[str, PackResult]
    controller: Any  # ActorHandle of rollout.actor.RolloutController

    @classmethod
    def up(
        cls,
        workdir: Path,
        *,
        fresh: bool = True,
        args: dict[str, Any] | None = None,
        echo: Callable[[str], None] = lambda _line: None,
    ) -> LocalStack:
        """Start everything; ``args`` are merged into the app builder's args."""
        from app.demo_artifacts import make_demo_artifacts
        from app.registry import open_registry
        from rollout.actor import CONTROLLER_NAME, CONTROLLER_NAMESPACE, ensure_controller
        from rollout.local.cluster import LocalCluster

        workdir = workdir.resolve()
        if fresh:
            shutil.rmtree(workdir / "cache", ignore_errors=True)
            for suffix in ("", "-wal", "-shm"):
                (workdir / f"registry.db{suffix}").unlink(missing_ok=True)
        workdir.mkdir(parents=True, exist_ok=True)

        echo("== packing the demo artifacts")
        packed = {p.artifact_id: p for p in make_demo_artifacts(workdir / "artifacts")}
        registry_url = f"sqlite:///{workdir / 'registry.db'}"
        registry = open_registry(registry_url)
        for artifact_id in (BASELINE, CANDIDATE):
            p = packed[artifact_id]
            registry.register_artifact(p.manifest_uri, p.manifest_sha256)
            registry.approve_artifact(APP, artifact_id, actor="demo", reason="offline eval ok")
            echo(f"   registered + approved {artifact_id} ({p.manifest_sha256[:12]}...)")
        try:
            stable = registry.get_target(APP, "default", "stable")
        except NotFound:  # a fresh registry
            stable = registry.publish(
                APP, "default", "stable", BASELINE, 0, actor="demo", reason="initial deploy"
            )

        echo("== starting local Ray + Serve")
        cluster = LocalCluster.start()
        try:
            echo(f"   dashboard {cluster.dashboard_url}   HTTP {cluster.http_url}")
            app_args: dict[str, Any] = {
                "stable": {"num_replicas": 1, "target": stable.target().model_dump(mode="json")},
                "canary": {"num_replicas": 1},
                # A local cluster answers only its own clients: the demo shows which cohort
                # answered each request (production answers leave it out, RouterConfig).
                "router": {"reveal_cohort": True},
                "cache_dir": str(workdir / "cache"),
                "controller": {"name": CONTROLLER_NAME, "namespace": CONTROLLER_NAMESPACE},
                "report_interval_s": 1.0,
            }
            for key, value in (args or {}).items():
                if isinstance(value, dict) and isinstance(app_args.get(key), dict):
                    app_args[key] = {**app_args[key], **value}
                else:
                    app_args[key] = value
            cluster.deploy(
                [
                    {
                        "name": APP,
                        "route_prefix": "/",
                        "import_path": "deployments.app:build_app",
                        "args": app_args,
                    }
                ]
            )
            echo(f"   deployed: stable {stable.artifact_id} (revision {stable.revision})")
            controller = ensure_controller(
                ControllerSettings(
                    registry_url=registry_url,
                    dashboard_url=cluster.dashboard_url,
                    metrics_endpoints=(cluster.metrics_url,),
                    tick_interval_s=0.5,
                    metrics_delay_s=1.5,
                    report_stale_s=10,
                )
            )
        except BaseException:
            LocalCluster.stop()
            registry.close()
            raise
        return cls(workdir, cluster, registry, registry_url, packed, controller)

    def register(self, packed: PackResult) -> None:
        """Register and approve one more artifact (the demo's shadow-phase candidates)."""
        self.registry.register_artifact(packed.manifest_uri, packed.manifest_sha256)
        self.registry.approve_artifact(
            APP, packed.artifact_id, actor="demo", reason="offline eval ok"
        )
        self.packed[packed.artifact_id] = packed

    def call(self, method: str, *args: Any, timeout: float = 60) -> Any:
        import ray

        return ray.get(getattr(self.controller, method).remote(*args), timeout=timeout)

    def down(self) -> None:
        import ray

        from rollout.actor import CONTROLLER_NAME, CONTROLLER_NAMESPACE
        from rollout.local.cluster import LocalCluster

        with contextlib.suppress(ValueError):  # never created, or already gone
            ray.kill(
                ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE), no_restart=True
            )
        LocalCluster.stop()
        self.registry.close()
