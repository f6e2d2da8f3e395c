"""The controller's engine fed malformed instance reports: each is refused and counted, no tick
fails, and the rollout goes on exactly as the good reports say (the engine and replicas of
``tests.unit.engine_world``: fake Serve and windows, a real registry)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.contracts import MAX_REVISION, InstanceReport
from app.registry import Registry
from tests.unit.engine_world import PLAN, V42, World, seeded_registry


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    registry = seeded_registry(tmp_path)
    yield registry
    registry.close()


MALFORMED: tuple[dict[str, Any], ...] = (
    {"heartbeat": 1e20},
    {"heartbeat": float("nan")},
    {"seq": 2**60},
    {"seq": float("nan")},
    {"phase": "dancing"},
)


class MisreportingWorld(World):
    """Before each tick, one canary replica also sends every malformed report above."""

    def malformed(self, replica_id: str) -> None:
        good = InstanceReport.model_validate(
            {
                "replica_id": replica_id,
                "cohort": "canary",
                "pid": 7,
                "phase": "ready",
                "heartbeat": self.now,
                "seq": self.seq,
            }
        ).model_dump(mode="json")
        for bad in MALFORMED:
            assert self.engine.report_instance({**good, **bad}) is None

    def tick(self, seconds: float = 1.0) -> Any:
        for replica_id in self.serve.running("canary"):
            self.malformed(replica_id)
        return super().tick(seconds)


def test_malformed_reports_neither_fail_a_tick_nor_hold_the_rollout(registry: Registry) -> None:
    world = MisreportingWorld(registry)
    world.replicas_report()
    world.engine.start_rollout(V42, PLAN, actor="test")

    summary = world.run()

    assert (summary.phase, summary.finished) == ("succeeded", True), summary
    assert world.engine.reports.refused >= len(MALFORMED)
    assert world.engine.reports.refused % len(MALFORMED) == 0
    # What `rollout status` shows: the count, and the refusals among the controller's errors.
    status = world.engine.view()
    assert status.reports_refused == world.engine.reports.refused
    assert any(e.startswith("report refused: ") for e in status.errors), status.errors


def test_a_bogus_huge_seq_does_not_hide_a_replica_from_the_rollout(registry: Registry) -> None:
    world = World(registry)
    world.replicas_report()
    world.engine.start_rollout(V42, PLAN, actor="test")
    world.tick()  # the canary is given the candidate
    [canary] = world.serve.running("canary")
    # Valid by the contract, so kept: a replica stuck loading, counting from the top.
    assert world.report(canary, "canary", phase="loading", seq=MAX_REVISION) is not None

    summary = world.run()  # the replica's true reports count from where they were

    assert (summary.phase, summary.finished) == ("succeeded", True), summary
