"""What the controller refuses before it touches Serve: a rollout that cannot be right; and how
it holds a rollout while Serve is out of reach.

Real SQLite registry; Serve is the in-memory port of tests/unit/fakes.py, so no cluster is
needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.contracts import ControllerSettings
from app.errors import InvalidState, NotFound
from app.registry import open_registry
from rollout.engine import RolloutEngine
from rollout.plan import RolloutPlan
from rollout.serve_control import ServeControlError, ServeUnreachable
from tests.integration.manifests import write_manifest
from tests.unit.fakes import FakeServe, FakeWindows


@pytest.fixture
def engine(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = open_registry(url)
    for artifact_id in ("ranker-v41", "ranker-v42", "ranker-v43"):
        ref = write_manifest(tmp_path / artifact_id, artifact_id)
        registry.register_artifact(ref.uri, ref.sha256)
    registry.approve_artifact("ranker", "ranker-v41", actor="t")
    registry.approve_artifact("ranker", "ranker-v42", actor="t")
    # Nothing listens there: anything that reached Serve would fail loudly.
    settings = ControllerSettings(registry_url=url, dashboard_url="http://127.0.0.1:9")
    yield RolloutEngine(settings, registry=registry), registry
    registry.close()


def test_no_stable_target_yet(engine):
    eng, _ = engine
    with pytest.raises(InvalidState, match="no stable target"):
        eng.start_rollout("ranker-v42", RolloutPlan())


def test_refusals(engine):
    eng, registry = engine
    registry.publish("ranker", "default", "stable", "ranker-v41", 0, actor="t", reason="init")
    with pytest.raises(NotFound):
        eng.start_rollout("ranker-v99", RolloutPlan())
    with pytest.raises(InvalidState, match="pending, not ready"):
        eng.start_rollout("ranker-v43", RolloutPlan())
    with pytest.raises(InvalidState, match="already the stable target"):
        eng.start_rollout("ranker-v41", RolloutPlan())
    assert registry.get_active_rollout("ranker", "default") is None


def test_one_rollout_at_a_time(engine):
    eng, registry = engine
    registry.publish("ranker", "default", "stable", "ranker-v41", 0, actor="t", reason="init")
    summary = eng.start_rollout("ranker-v42", RolloutPlan())
    assert summary.phase == "pending" and summary.rollout.startswith("ranker-v42-")
    record = registry.get_active_rollout("ranker", "default")
    assert record is not None and record.id == summary.rollout
    with pytest.raises(InvalidState, match="still pending"):
        eng.start_rollout("ranker-v42", RolloutPlan())
    # A second controller process (e.g. after a restart) is refused by the registry itself.
    other = RolloutEngine(eng.settings, registry=registry)
    with pytest.raises(InvalidState):
        other.start_rollout("ranker-v42", RolloutPlan())
    # And it resumes the rollout the first one created.
    assert other.resume() == summary.rollout


@pytest.fixture
def published(tmp_path: Path):
    """(URL, registry) with v41 the stable target and v42 approved."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = open_registry(url)
    for artifact_id in ("ranker-v41", "ranker-v42"):
        ref = write_manifest(tmp_path / artifact_id, artifact_id)
        registry.register_artifact(ref.uri, ref.sha256)
        registry.approve_artifact("ranker", artifact_id, actor="t")
    registry.publish("ranker", "default", "stable", "ranker-v41", 0, actor="t", reason="init")
    yield url, registry
    registry.close()


def unreachable() -> ServeUnreachable:
    return ServeUnreachable("dashboard could not read the Serve config (503): stand-in")


def test_an_outage_holds_the_rollout_and_its_deadlines(published):
    """Serve out of reach (5xx) holds the rollout; the first tick that gets through moves its
    deadlines on by the time held."""
    url, registry = published
    clock = [1000.0]
    serve = FakeServe()
    settings = ControllerSettings(registry_url=url, dashboard_url="http://127.0.0.1:9")
    engine = RolloutEngine(
        settings, registry=registry, serve=serve, windows=FakeWindows(), clock=lambda: clock[0]
    )
    engine.start_rollout("ranker-v42", RolloutPlan())
    assert engine.live is not None
    entered = engine.live.state.phase_entered_at

    serve.read_errors.append(unreachable())
    summary = engine.tick()
    assert summary.held.since == 1000.0
    assert "Serve" in summary.held.reason and "503" in summary.held.reason
    assert any(a.startswith("warning: rollout ") and "held" in a for a in engine.alerts)

    clock[0] = 1100.0
    serve.read_errors.append(unreachable())
    assert engine.tick().held.since == 1000.0  # the hold began at the first tick
    assert engine.live.state.phase_entered_at == entered

    # Serve answers again, but its first write finds it gone again.
    clock[0] = 1250.0
    serve.write_errors.append(unreachable())
    engine.tick()
    assert engine.live.state.phase_entered_at == entered + 250.0
    events = [e.event for e in engine.live.events]
    assert events[:3] == ["created", "held", "resumed"], events
    # Its first action found Serve gone again: a new hold, from this tick.
    serve.read_errors.append(unreachable())
    assert events[-1] == "held" and engine.tick().held.since == 1250.0


def test_a_refusal_alone_does_not_hold(published):
    url, registry = published
    serve = FakeServe()
    settings = ControllerSettings(registry_url=url, dashboard_url="http://127.0.0.1:9")
    engine = RolloutEngine(settings, registry=registry, serve=serve, windows=FakeWindows())
    engine.start_rollout("ranker-v42", RolloutPlan())
    serve.read_errors.append(ServeControlError("dashboard refused to read the config (401): x"))
    summary = engine.tick()
    assert summary.held is None
    assert any("(401)" in e for e in engine.errors)
