"""The rollout controller actor's class (rollout/actor.py) run as a plain object: its tick loop
on its own thread, with Ray's metrics classes loaded but no cluster."""

from __future__ import annotations

from pathlib import Path

from app.contracts import ControllerSettings
from app.polling import wait_until
from rollout.actor import RolloutController
from rollout.local.cluster import free_port


def test_a_failed_drift_repair_does_not_stop_the_ticks(tmp_path: Path) -> None:
    # The actor's loop, run as a plain object: the dashboard refuses every connection, so
    # the repair fails on every pass, and the ticks (which hold, serving untouched) go on.
    settings = ControllerSettings(
        registry_url=f"sqlite:///{tmp_path / 'registry.db'}",
        dashboard_url=f"http://127.0.0.1:{free_port()}",
        tick_interval_s=0.02,
    )
    controller = RolloutController(settings.model_dump())
    try:
        wait_until(lambda: controller._ticks >= 3, 30, "three ticks", every=0.02)
        assert controller.repaired is None
        assert any(e.startswith("drift repair: ServeUnreachable") for e in controller.engine.errors)
    finally:
        controller.stop()
