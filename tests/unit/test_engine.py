"""The rollout engine against its ports: a real SQLite registry, Serve in memory
(tests/unit/fakes.py, counting GETs and PUTs as the HTTP port makes them), metrics windows on
demand and a fake clock. Replicas are played by the test: after each tick, every RUNNING replica
reports that it serves its cohort's target."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.contracts import CommandAccepted, ControllerSettings, ReplicaPhase
from app.errors import InvalidState, RegistryUnavailable
from app.registry import Registry
from rollout.analysis import CohortStats, WindowStats
from rollout.engine import evidence_interval_s
from rollout.machine import Abort
from rollout.plan import RolloutPlan
from rollout.serve_control import ServeControl, ServeUnreachable
from rollout.serve_port import HttpServePort
from rollout.views import wire
from tests.unit.engine_world import PLAN, V41, V42, World, seeded_registry
from tests.unit.fakes import (
    FakeDashboard,
    FakeServe,
    app_details,
    deployment_details,
    replica_config,
    router_config,
)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """v41 the stable target, v42 approved."""
    registry = seeded_registry(tmp_path)
    yield registry
    registry.close()


def pause_at_the_promotion_gate(world: World) -> None:
    """Start a rollout of v42 whose plan pauses before promotion, and tick until it does."""
    world.replicas_report()
    gated = RolloutPlan.model_validate(
        {**PLAN.model_dump(), "gates": {"pause_before_promotion": True}}
    )
    world.engine.start_rollout(V42, gated)
    for _ in range(30):
        if world.tick().phase == "paused":
            return
    raise AssertionError("not paused at the promotion gate after 30 ticks")


def test_a_full_rollout_to_promotion(registry: Registry) -> None:
    world = World(registry)
    world.replicas_report()
    world.engine.start_rollout(V42, PLAN, actor="test")

    summary = world.run()

    assert (summary.phase, summary.finished) == ("succeeded", True), summary
    assert registry.get_target("ranker", "default", "stable").artifact_id == V42
    serve = world.serve
    assert serve.target("stable")["artifact_id"] == V42
    assert serve.target("canary") is None and serve.canary_bp == 0
    events = [e.event for e in world.engine.live.events]
    assert events[:2] == ["created", "started"] and events[-1] == "finished"
    weights = [e.canary_bp for e in world.engine.live.events if e.event == "weights"]
    assert weights == [5000, 10_000, 0]
    history = registry.history("ranker", "default")
    assert [(h.cohort, h.new_artifact_id) for h in history][:2] == [
        ("stable", V42),
        ("canary", V42),
    ]
    record = registry.list_rollouts("ranker", "default", limit=1)[0]
    assert record.phase == "succeeded" and not record.active
    # Targets (canary, then stable), three weight changes and the canary cleared: one PUT
    # each, whatever the number of ticks.
    assert serve.puts == 6
    assert world.tick() is None  # nothing more to do


def test_the_first_tick_of_a_rollout_is_one_read_and_one_write(registry: Registry) -> None:
    world = World(registry)
    world.replicas_report()
    world.engine.start_rollout(V42, PLAN)
    world.tick()
    # Observe: one GET. Canary target and canary scale: one write, one GET and one PUT.
    assert (world.serve.gets, world.serve.puts) == (2, 1)
    assert world.serve.target("canary")["artifact_id"] == V42


def test_the_first_tick_over_http_is_two_gets_and_one_put(registry: Registry) -> None:
    dashboard = FakeDashboard(
        app_details(
            deployments={
                "stable": deployment_details(
                    "stable",
                    replica_config(
                        "stable", registry.get_target("ranker", "default", "stable").target()
                    ),
                ),
                "canary": deployment_details("canary", replica_config("canary")),
                "router": deployment_details("router", router_config()),
            }
        )
    )
    control = ServeControl("http://dashboard", token="t", transport=dashboard.transport)
    world = World(registry, serve=HttpServePort(control, app="ranker"))
    world.engine.start_rollout(V42, PLAN)
    world.now += 1
    world.engine.tick()
    assert (dashboard.gets, len(dashboard.puts)) == (2, 1)
    [entry] = dashboard.puts[0]["applications"][0]["deployments"]
    assert entry["name"] == "canary" and entry["user_config"]["target"]["artifact_id"] == V42
    assert "num_replicas" not in entry  # the canary already runs the one replica asked for


def test_an_operator_rollback_of_stable_is_one_write(registry: Registry) -> None:
    registry.publish("ranker", "default", "stable", V42, 1, actor="t", reason="v42")
    world = World(registry)
    target = world.engine.rollback_stable(None, actor="op", reason="back")
    assert (target.artifact_id, target.revision) == (V41, 3)
    assert (world.serve.gets, world.serve.puts) == (1, 1)
    assert world.serve.target("stable") == target.target().model_dump(mode="json")


def test_drift_is_repaired_in_one_write(registry: Registry) -> None:
    # A stale deploy: stable on an old config (no target), the router at 5%, canary idle.
    world = World(registry, serve=FakeServe(router=router_config(500)))
    assert world.engine.reconcile_serve() == [
        f"stable target -> {V41} (rev 1)",
        "router canary weight -> 0 bp",
    ]
    assert (world.serve.gets, world.serve.puts) == (1, 1)
    assert world.engine.reconcile_serve() == []
    assert (world.serve.gets, world.serve.puts) == (2, 1)


def test_reports_are_validated_and_a_late_one_dropped(registry: Registry) -> None:
    world = World(registry)
    world.seq = 10
    assert world.report("c0", "canary", phase="backoff") is not None
    world.seq = 5
    assert world.report("c0", "canary", phase="failed") is None  # an older seq: late
    assert world.engine.report_instance({"replica_id": "c0", "phase": "ready"}) is None
    assert world.engine.reports.latest()["c0"].phase is ReplicaPhase.BACKOFF


def test_another_writer_moving_a_target_aborts_without_overwriting_it(
    registry: Registry,
) -> None:
    world = World(registry)
    pause_at_the_promotion_gate(world)
    current = registry.get_target("ranker", "default", "canary")
    theirs = registry.publish(
        "ranker", "default", "canary", V41, current.revision, actor="someone", reason="x"
    )

    summary = world.run()

    assert summary.phase == "aborted" and "registry conflict" in summary.reason
    after = registry.get_target("ranker", "default", "canary")
    assert (after.revision, after.artifact_id) == (theirs.revision, V41), "overwritten"
    assert world.serve.canary_bp == 0
    assert registry.get_target("ranker", "default", "stable").artifact_id == V41


def test_the_views_keep_their_json_keys(registry: Registry) -> None:
    world = World(registry)
    engine = world.engine
    assert wire(engine.rollout_summary()) == {"rollout": None}
    status_keys = {
        "rollout",
        "targets",
        "replicas",
        "last_window",
        "alerts",
        "errors",
        "reports_refused",
    }
    assert set(wire(engine.view())) == status_keys

    world.replicas_report()
    started = wire(engine.start_rollout(V42, PLAN))
    summary_keys = {
        "rollout", "model", "candidate", "baseline", "phase", "finished", "step",
        "step_percent", "steps", "weights", "failed_checks", "reason", "pending_gate", "held",
        "shadow", "verdicts", "events", "estimate", "progress",
    }  # fmt: skip
    assert set(started) == summary_keys
    accepted = engine.command(Abort(reason="test"), actor="dave", reason="test")
    assert isinstance(accepted, CommandAccepted)
    assert set(wire(accepted)) == summary_keys | {"queued"} and accepted.queued == "abort"
    world.run()
    status = wire(engine.view())
    assert set(status) == summary_keys | status_keys
    assert {tuple(sorted(e)) for e in status["events"]} == {
        ("at", "event", "key", "message"),
        ("at", "canary_bp", "event", "key", "message"),
    }
    assert [t["cohort"] for t in status["targets"]] == ["stable"]  # aborted before canary
    assert set(status["replicas"][0]) == {
        "replica", "cohort", "phase", "desired", "desired_revision", "actual", "actual_revision",
        "error", "age_s", "progress", "backbone", "trust_anchors",
    }  # fmt: skip
    # The events persisted with the state are the same dicts.
    record = registry.list_rollouts("ranker", "default", limit=1)[0]
    assert record.state["events"][-len(status["events"]) :] == status["events"]
    # Who gave the command and why is one of them.
    assert {"event": "operator", "message": "abort by dave: test"} in [
        {"event": e["event"], "message": e["message"]} for e in record.state["events"]
    ]


class CanaryReadFailsOnce:
    """The registry, except that the next read of the canary's target fails as an outage."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self.armed = False

    def get_target(self, model: str, environment: str, cohort: str, **kw: Any) -> Any:
        if self.armed and cohort == "canary":
            self.armed = False
            raise RegistryUnavailable("registry down for one read")
        return self._registry.get_target(model, environment, cohort, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


def test_a_conflict_seen_by_a_tick_that_then_fails_is_seen_again(registry: Registry) -> None:
    # Another writer moves stable; the tick that notices it cannot read canary's target. The
    # next tick must still see the conflict and abort: nothing was noted from the half read.
    flaky = CanaryReadFailsOnce(registry)
    world = World(flaky)  # type: ignore[arg-type]
    pause_at_the_promotion_gate(world)
    current = registry.get_target("ranker", "default", "stable")
    registry.publish(
        "ranker", "default", "stable", V42, current.revision, actor="someone", reason="x"
    )
    flaky.armed = True
    held = world.tick()
    assert held.held is not None and held.phase == "paused"

    summary = world.run()

    assert summary.phase == "aborted" and "moved the stable target" in summary.reason


def test_an_audit_record_waits_for_the_writes_before_it(registry: Registry) -> None:
    # The tick that ends a rollout clears the canary (one write) and then records "finished".
    # Every write is refused once: a refused tick records nothing of what it did not do, and
    # "finished" is recorded once, by the tick whose cleanup went through.
    world = World(registry)
    world.replicas_report()
    world.engine.start_rollout(V42, PLAN)
    for _ in range(60):
        if world.tick().phase == "finalising":
            break
    for _ in range(60):
        world.serve.write_errors.append(ServeUnreachable("dashboard down"))
        refused = world.tick()
        if not world.serve.write_errors:  # the tick wrote, and was refused
            assert not refused.finished
            assert "finished" not in [e.event for e in world.engine.live.events]
        world.serve.write_errors.clear()
        if world.tick().finished:
            break
    events = [e.event for e in world.engine.live.events]
    assert events.count("finished") == 1 and events[-1] == "finished"
    assert world.serve.target("canary") is None


def test_windows_wait_out_the_clusters_metrics_export_interval(registry: Registry) -> None:
    """At Ray's default 10 s report interval, a window starting 1 s after the weights went
    live would count requests answered under the previous weights: the router hands its
    counts over within 0.25 s and Ray exports them up to one interval later (x1.2), so the
    first window after a weight change starts 12.25 s after it."""
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "interval_s": 30})
    first_starts = []
    for export_interval_s in (None, 1.0, 10.0):
        world = World(registry, export_interval_s=export_interval_s)
        world.replicas_report()
        world.engine.start_rollout(V42, plan)
        world.windows.asked.clear()  # the traffic measured for the start's estimate
        while not world.windows.asked:
            world.tick()
        first_starts.append(world.windows.asked[0][0])
        world.engine.command(Abort(reason="test over"), actor="t", reason="test over")
        world.run()
    configured, fast, slow = first_starts
    assert fast == pytest.approx(configured + 0.45)  # 0.25 + 1.2 x 1 s beats the configured 1 s
    assert slow == pytest.approx(configured + 11.25)  # 12.25 s instead of 1 s


def thin_windows(start: float, end: float) -> WindowStats:
    """Too few requests to decide: every window is judged inconclusive."""
    few = CohortStats(5, p50_ms=10.0, p99_ms=40.0)
    return WindowStats(start, end, canary=few, stable=few)


def run_to_two_verdicts(world: World, plan: RolloutPlan, *, ticks: int) -> None:
    """Start a rollout on thin windows and tick until it has recorded two verdicts; the
    windows asked for since the start are in ``world.windows.asked``."""
    world.windows.stats = thin_windows
    world.replicas_report()
    world.engine.start_rollout(V42, plan)
    world.windows.asked.clear()  # the traffic measured for the start's estimate
    for _ in range(ticks):
        world.tick()
        if len(world.engine.live.state.verdicts) >= 2:
            return


def test_the_sequential_judge_takes_every_export_and_shows_one_verdict_per_interval(
    registry: Registry,
) -> None:
    """Exports every 2 s: the engine asks for a window per distinct scrape (0.9 x 2 s), the
    judge adds each to its evidence, and the rollout records a verdict once per plan
    interval."""
    world = World(registry, export_interval_s=2.0)
    assert world.engine.evidence_interval_s == pytest.approx(1.8)
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "judge": "sequential"})
    run_to_two_verdicts(world, plan, ticks=400)
    state = world.engine.live.state
    lengths = [end - start for start, end in world.windows.asked]
    assert min(lengths) >= 1.8 and min(lengths) < plan.interval_s
    assert state.evidence is not None and state.evidence.windows > 2 * len(state.verdicts)
    first, second = state.verdicts[:2]
    assert second.window_end - first.window_end >= plan.interval_s


@pytest.mark.parametrize(
    ("configured", "prometheus", "export", "expected"),
    [
        (None, None, 10.0, 9.0),  # every distinct scrape of Ray's endpoints
        (None, None, None, None),  # the export interval unknown: once per plan interval
        (None, "http://prometheus:9090", 10.0, None),  # Prometheus' own cadence is not known
        (30.0, "http://prometheus:9090", 10.0, 30.0),  # ... unless configured
        (4.0, None, 10.0, 4.0),
    ],
)
def test_the_evidence_interval_follows_the_metrics_source(
    configured: float | None, prometheus: str | None, export: float | None, expected
) -> None:
    settings = ControllerSettings(
        registry_url="sqlite:///x",
        dashboard_url="http://h",
        prometheus_url=prometheus,
        evidence_interval_s=configured,
    )
    assert evidence_interval_s(settings, export) == expected


def test_only_the_first_window_after_a_weight_change_waits(registry: Registry) -> None:
    """The next window starts where the judged one ended: the weights did not change in
    between, so nothing of other weights can reach it, and waiting again would only lose
    data."""
    world = World(registry, export_interval_s=10.0)
    run_to_two_verdicts(world, PLAN, ticks=200)
    first, second = world.engine.live.state.verdicts[:2]
    starts = sorted({start for start, _ in world.windows.asked})
    assert starts[1] == first.window_end  # not 13 s after it
    assert second.window_end - first.window_end >= PLAN.interval_s


def resubmit(world: World, configs: dict[str, dict[str, Any]], canary_replicas: int) -> None:
    """What KubeRay does with its cached serveConfigV2 (an operator restart, a new head pod):
    the config the app was deployed with, applied again over what the controller set."""
    world.serve.user_configs = copy.deepcopy(configs)
    canary = world.serve.replicas["canary"]
    del canary[canary_replicas:]
    canary.extend(f"canary-resubmitted-{i}" for i in range(canary_replicas - len(canary)))


def test_a_resubmitted_config_mid_rollout_is_repaired_in_one_tick_and_the_rollout_goes_on(
    registry: Registry,
) -> None:
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "steps": [20, 50]})
    world = World(registry)
    deployed = copy.deepcopy(world.serve.user_configs)  # no canary target, weight 0
    world.replicas_report()
    world.engine.start_rollout(V42, plan)
    for _ in range(20):
        summary = world.tick()
        if summary.weights.canary_bp == 2000 and world.engine.live.state.weights_live_at:
            break
    assert world.serve.canary_bp == 2000 and world.serve.target("canary")["artifact_id"] == V42

    resubmit(world, deployed, canary_replicas=1)
    # The canary replica's last report, sent just before, still says it serves the candidate.
    world.now += 1
    before = (world.serve.gets, world.serve.puts)
    world.engine.tick()
    # One tick: one read, and one repair write (the canary target back at its revision).
    assert (world.serve.gets - before[0], world.serve.puts - before[1]) == (3, 1)
    canary_target = registry.get_target("ranker", "default", "canary")
    assert world.serve.target("canary") == canary_target.target().model_dump(mode="json")
    # Capacity before traffic: the canary weight stays withdrawn while the replica reloads,
    # although its report from before the drift says ready.
    assert world.serve.canary_bp == 0
    state = world.engine.live.state
    assert (state.weights.canary_bp, state.withdrawn_canary_bp) == (0, 2000)
    [drift_event] = [e for e in world.engine.live.events if e.event == "drift"]
    assert f"canary target -> {V42}" in drift_event.message
    assert "withdrawn" in drift_event.message
    assert any("KubeRay" in a for a in world.engine.alerts)
    assert world.engine.drift_repairs == {"canary.target": 1, "router.canary_bp": 1}

    # The replica reports the candidate loaded again: the weight comes back, and the rollout
    # goes on to promotion with no second repair.
    world.replicas_report()
    summary = world.run()
    assert (summary.phase, summary.finished) == ("succeeded", True), summary
    weights = [e.canary_bp for e in world.engine.live.events if e.event == "weights"]
    assert weights == [2000, 2000, 5000, 10_000, 0]  # withdrawn by the drift event, then set
    assert [e.event for e in world.engine.live.events].count("drift") == 1
    assert "drift_restored" in [e.event for e in world.engine.live.events]


def test_without_a_rollout_an_old_stable_target_put_back_is_repaired_on_the_next_tick(
    registry: Registry,
) -> None:
    world = World(registry)
    first = copy.deepcopy(world.serve.user_configs)
    promoted = registry.publish("ranker", "default", "stable", V42, 1, actor="t", reason="v42")
    world.engine.reconcile_serve()
    assert world.serve.target("stable")["artifact_id"] == V42
    assert world.engine.tick() is None
    assert world.serve.puts == 1  # no drift: a tick reads and writes nothing

    resubmit(world, first, canary_replicas=1)  # the manifest as rendered before the promotion
    assert world.engine.tick() is None
    assert world.serve.target("stable") == promoted.target().model_dump(mode="json")
    assert world.engine.drift_repairs == {"stable.target": 2}  # the start-up repair, and this
    assert any("stable target -> ranker-v42 (rev 2)" in a for a in world.engine.alerts)
    assert world.serve.puts == 2


def test_an_autoscaled_canary_pool_goes_from_zero_to_its_floor_and_back_to_zero(
    registry: Registry,
) -> None:
    """A canary pool Serve autoscales with min_replicas 0 holds no replica between rollouts:
    the rollout raises its floor before any traffic, and puts it back to 0 at the end."""
    plan = RolloutPlan.model_validate(
        {**PLAN.model_dump(), "canary_scaling": {"min_replicas": 1, "max_replicas": 1,
                                                 "idle_replicas": 0}}
    )  # fmt: skip
    stable = registry.get_target("ranker", "default", "stable").target()
    serve = FakeServe(
        stable=replica_config("stable", stable),
        autoscaling={"canary": {"min_replicas": 0, "max_replicas": 2}},
    )
    world = World(registry, serve=serve)
    assert world.serve.running("canary") == []
    world.replicas_report()
    world.engine.start_rollout(V42, plan)
    world.tick()
    assert world.serve.autoscaling["canary"]["min_replicas"] == 1
    assert len(world.serve.running("canary")) == 1 and world.serve.canary_bp == 0
    summary = world.run()
    assert (summary.phase, summary.finished) == ("succeeded", True), summary
    assert world.serve.autoscaling["canary"] == {"min_replicas": 0, "max_replicas": 2}
    assert world.serve.running("canary") == [] and world.serve.target("canary") is None
    assert world.engine.drift_repairs == {}  # the floor it set is not taken for drift


def test_an_idle_pool_of_zero_is_refused_for_a_canary_of_fixed_size(registry: Registry) -> None:
    plan = RolloutPlan.model_validate(
        {**PLAN.model_dump(), "canary_scaling": {"min_replicas": 1, "max_replicas": 1,
                                                 "idle_replicas": 0}}
    )  # fmt: skip
    world = World(registry)
    with pytest.raises(InvalidState, match=r"canary_scaling\.idle_replicas: 0 needs"):
        world.engine.start_rollout(V42, plan)
    assert registry.get_active_rollout("ranker", "default") is None


class RegistryDown:
    """The registry during an outage from ``down()`` on: every call fails as unreachable,
    after the wait a real pool would spend on it; the calls are counted."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self.is_down = False
        self.calls: list[str] = []

    def down(self) -> None:
        self.is_down = True

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._registry, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.is_down:
                self.calls.append(name)
                raise RegistryUnavailable(f"registry down: {name}")
            return attribute(*args, **kwargs)

        return call


def test_status_while_held_for_the_registry_does_not_wait_on_it_again(
    registry: Registry,
) -> None:
    # A tick that found the registry unreachable holds the rollout; each call to the registry
    # then costs the pool's connect timeout (10 s). Status is asked for exactly then: it shows
    # the rollout as held and says the targets cannot be read, without another such wait.
    outage = RegistryDown(registry)
    world = World(outage)  # type: ignore[arg-type]
    pause_at_the_promotion_gate(world)
    world.engine.command(Abort("test"))  # a queued command: the next tick persists state
    outage.down()
    held = world.tick()
    assert held.held is not None and "registry" in held.held.reason
    calls_before = len(outage.calls)

    status = wire(world.engine.view())

    assert outage.calls[calls_before:] == []
    assert status["targets"] is None
    assert status["held"]["reason"] == held.held.reason
    assert any("registry" in error for error in status["errors"])
