"""The rollout engine's test world, shared by tests/unit/test_engine.py and
tests/unit/test_engine_reports.py: a real SQLite registry, Serve in memory (tests/unit/fakes.py),
metrics windows on demand, a fake clock, and replicas played by the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.contracts import ControllerSettings, InstanceReport
from app.registry import Registry, open_registry
from rollout.analysis import CohortStats, WindowStats
from rollout.engine import RolloutEngine
from rollout.plan import RolloutPlan
from tests.integration.manifests import write_manifest
from tests.unit.fakes import FakeServe, FakeWindows, replica_config

V41, V42 = "ranker-v41", "ranker-v42"

PLAN = RolloutPlan.model_validate(
    {
        "judge": "threshold",  # one window decides: the engine, not the judge, is under test
        "steps": [50],
        "interval_s": 10,
        "min_requests": 10,
        "threshold": 1,
        "progress_deadline_s": 300,
        "promotion": "shift",
        "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
    }
)


def seeded_registry(root: Path) -> Registry:
    """A SQLite registry under ``root``: v41 the stable target, v42 approved."""
    registry = open_registry(f"sqlite:///{root / 'registry.db'}")
    for artifact_id in (V41, V42):
        ref = write_manifest(root / artifact_id, artifact_id)
        registry.register_artifact(ref.uri, ref.sha256)
        registry.approve_artifact("ranker", artifact_id, actor="t")
    registry.publish("ranker", "default", "stable", V41, 0, actor="t", reason="init")
    return registry


def passing(start: float, end: float) -> WindowStats:
    healthy = CohortStats(500, p50_ms=10.0, p99_ms=40.0)
    return WindowStats(start, end, canary=healthy, stable=healthy)


class World:
    """An engine, its Serve, its windows and its clock, and replicas that do as they are told."""

    def __init__(
        self, registry: Registry, serve: Any = None, export_interval_s: float | None = None
    ) -> None:
        self.now = 1000.0
        self.seq = 0
        self.registry = registry
        stable = registry.get_target("ranker", "default", "stable").target()
        self.serve = serve or FakeServe(stable=replica_config("stable", stable))
        self.windows = FakeWindows(passing)
        settings = ControllerSettings(
            registry_url="sqlite:///unused", dashboard_url="http://unused", metrics_delay_s=1.0
        )
        self.engine = RolloutEngine(
            settings,
            registry=registry,
            serve=self.serve,
            windows=self.windows,
            clock=lambda: self.now,
            metrics_export_interval_s=export_interval_s,
        )

    def report(self, replica_id: str, cohort: str, **fields: Any) -> InstanceReport | None:
        self.seq += 1
        values = {
            "replica_id": replica_id,
            "cohort": cohort,
            "pid": 7,
            "phase": "ready",
            "heartbeat": self.now,
            "seq": self.seq,
            **fields,
        }
        return self.engine.report_instance(
            InstanceReport.model_validate(values).model_dump(mode="json")
        )

    def replicas_report(self) -> None:
        """Every RUNNING replica serves its cohort's target."""
        for cohort in ("stable", "canary"):
            target = self.serve.target(cohort)
            artifact = target["artifact_id"] if target else None
            revision = target["revision"] if target else None
            for replica_id in self.serve.running(cohort):
                self.report(
                    replica_id,
                    cohort,
                    phase="ready" if target else "idle",
                    desired_artifact=artifact,
                    desired_revision=revision,
                    actual_artifact=artifact,
                    actual_revision=revision,
                )

    def tick(self, seconds: float = 1.0) -> Any:
        self.now += seconds
        summary = self.engine.tick()
        self.replicas_report()
        return summary

    def run(self, ticks: int = 60) -> Any:
        for _ in range(ticks):
            summary = self.tick()
            if summary is None or summary.finished:
                return summary
        raise AssertionError(f"not finished after {ticks} ticks: {summary}")
