"""The controller's Serve port over the dashboard's REST API (httpx's MockTransport standing in
for the dashboard): what one read sees, one GET and at most one PUT per write, nothing sent for
a change of nothing, and the errors told apart. The in-memory port of the engine's tests must
agree with it."""

from __future__ import annotations

import pytest

from app.contracts import ReplicaConfig, RouterConfig, Target
from app.errors import ConfigError
from rollout.local.cluster import free_port
from rollout.serve_control import ServeControl, ServeControlError, ServeUnreachable
from rollout.serve_port import (
    CANARY_REPLICAS,
    CANARY_TARGET,
    ROUTER_WEIGHT,
    STABLE_TARGET,
    HttpServePort,
    ServeChange,
    drift,
)
from rollout.state import Weights
from tests.unit.fakes import (
    FakeDashboard,
    FakeServe,
    app_details,
    deployment_details,
    replica_config,
    router_config,
)

V41 = Target(
    revision=1, artifact_id="ranker-v41", manifest_uri="file:///a/41", manifest_sha256="a" * 64
)
V42 = Target(
    revision=1, artifact_id="ranker-v42", manifest_uri="file:///a/42", manifest_sha256="b" * 64
)


def port_for(dashboard: FakeDashboard, app: str = "ranker") -> HttpServePort:
    control = ServeControl("http://dashboard", token="t", transport=dashboard.transport)
    return HttpServePort(control, app=app)


@pytest.fixture
def dashboard() -> FakeDashboard:
    stable = replica_config("stable", V41, report_interval_s=1.0)
    return FakeDashboard(
        app_details(
            deployments={
                "stable": deployment_details("stable", stable, replicas=2),
                "canary": deployment_details("canary", replica_config("canary")),
                "router": deployment_details("router", router_config(canary_bp=0)),
            }
        )
    )


def test_one_get_reads_every_cohort(dashboard: FakeDashboard) -> None:
    # The declarative config overrides the canary's user_config: that is its effective one,
    # while Serve still reports the builder's as applied (the replica is being reconfigured).
    app = dashboard.details["applications"]["ranker"]
    override = replica_config("canary", V42)
    app["deployed_app_config"]["deployments"] = [{"name": "canary", "user_config": override}]
    app["deployments"]["canary"]["replicas"][0]["state"] = "UPDATING"
    app["deployments"]["canary"]["status"] = "UPDATING"
    app["deployments"]["router"]["deployment_config"]["user_config"] = router_config(2500)

    state = port_for(dashboard).read()

    assert (dashboard.gets, dashboard.puts) == (1, [])
    assert state.stable is not None and state.canary is not None
    assert state.stable.running == {"stable-0", "stable-1"}
    assert state.stable.expected_replicas == 2 and state.stable.settled
    assert state.stable.user_config == replica_config("stable", V41, report_interval_s=1.0)
    assert state.canary.running == frozenset() and not state.canary.settled
    assert state.canary.user_config == override
    assert state.canary.applied_user_config == replica_config("canary")
    assert state.router_weights == Weights.with_canary(2500)


def test_router_weights_are_unknown_until_every_router_replica_runs_them(
    dashboard: FakeDashboard,
) -> None:
    router = dashboard.live("ranker", "router")
    router["replicas"].append({"replica_id": "router-1", "state": "STARTING"})
    assert port_for(dashboard).read().router_weights is None
    router["replicas"].pop()
    router["status"] = "UPDATING"
    assert port_for(dashboard).read().router_weights is None
    # An application without a router deployment: no weights at all.
    assert port_for(FakeDashboard(app_details(deployments={}))).read().router is None


def test_a_write_is_one_get_and_one_put_of_the_whole_user_config(dashboard: FakeDashboard) -> None:
    port = port_for(dashboard)

    changed = port.write(ServeChange(targets={"canary": V42}))

    assert changed == {CANARY_TARGET}
    assert dashboard.gets == 1 and len(dashboard.puts) == 1
    [put] = dashboard.puts
    assert put["http_options"] == {"host": "127.0.0.1", "port": 8000, "root_path": ""}
    [app] = put["applications"]
    assert app["import_path"] == "deployments.app:build_app" and app["args"]
    [entry] = app["deployments"]
    assert entry["name"] == "canary"
    # The builder's user_config with the target, every other field kept.
    assert entry["user_config"] == ReplicaConfig(cohort="canary", target=V42).model_dump(
        mode="json"
    )
    assert dashboard.live("ranker", "canary")["deployment_config"]["user_config"]["target"] == (
        V42.model_dump(mode="json")
    )


def test_a_write_keeps_a_hand_written_user_config_as_written(dashboard: FakeDashboard) -> None:
    # An operator's override names two fields; the controller's write adds the target and
    # the weight, and spells out none of the defaults the author left out.
    app = dashboard.details["applications"]["ranker"]
    app["deployed_app_config"]["deployments"] = [
        {"name": "canary", "user_config": {"cohort": "canary", "faults": {"error_rate": 0.5}}},
        {"name": "router", "user_config": {"salt": "s1"}},
    ]

    port_for(dashboard).write(ServeChange(targets={"canary": V42}, canary_bp=500))

    [put] = dashboard.puts
    entries = {e["name"]: e["user_config"] for e in put["applications"][0]["deployments"]}
    assert entries["canary"] == {
        "cohort": "canary",
        "faults": {"error_rate": 0.5},
        "target": V42.model_dump(mode="json"),
    }
    assert entries["router"] == {"salt": "s1", "canary_bp": 500}


def test_a_change_of_nothing_sends_no_put(dashboard: FakeDashboard) -> None:
    port = port_for(dashboard)
    assert port.write(ServeChange()) == frozenset() and dashboard.gets == 0
    # Each of these is what Serve already runs.
    unchanged = ServeChange(targets={"stable": V41, "canary": None}, canary_bp=0, canary_replicas=1)
    assert port.write(unchanged) == frozenset()
    assert dashboard.gets == 1 and dashboard.puts == []
    # Done once, the same write again changes nothing.
    assert port.write(ServeChange(canary_bp=500, canary_replicas=2)) == {
        ROUTER_WEIGHT,
        CANARY_REPLICAS,
    }
    assert port.write(ServeChange(canary_bp=500, canary_replicas=2)) == frozenset()
    assert dashboard.gets == 3 and len(dashboard.puts) == 1


def test_every_part_of_a_change_goes_in_one_put(dashboard: FakeDashboard) -> None:
    port = port_for(dashboard)
    change = ServeChange(targets={"stable": V42, "canary": None}, canary_bp=10_000)
    change = change.then(ServeChange(canary_replicas=3))
    changed = port.write(change)

    assert changed == {STABLE_TARGET, ROUTER_WEIGHT, CANARY_REPLICAS}
    assert dashboard.gets == 1 and len(dashboard.puts) == 1
    entries = {e["name"]: e for e in dashboard.puts[0]["applications"][0]["deployments"]}
    assert set(entries) == {"stable", "router", "canary"}
    assert entries["stable"]["user_config"]["target"]["artifact_id"] == "ranker-v42"
    assert entries["stable"]["user_config"]["report_interval_s"] == 1.0
    assert entries["router"]["user_config"] == RouterConfig(canary_bp=10_000).model_dump(
        mode="json"
    )
    assert entries["canary"] == {"name": "canary", "num_replicas": 3}
    state = port.read()
    assert state.canary is not None and state.canary.expected_replicas == 3
    assert state.router_weights == Weights.canary_only()


def autoscaled_canary(floor: int, *, declared: bool = True) -> FakeDashboard:
    """A canary pool Serve autoscales, its autoscaling_config in the config's deployments
    list (``declared``), or only in the code's options."""
    scaling = {"min_replicas": floor, "max_replicas": 2, "downscale_delay_s": 30}
    app = app_details(
        deployments={
            "stable": deployment_details("stable", replica_config("stable", V41)),
            "canary": deployment_details(
                "canary", replica_config("canary"), replicas=floor, autoscaling=scaling
            ),
            "router": deployment_details("router", router_config()),
        }
    )
    if declared:
        app["deployed_app_config"]["deployments"] = [
            {"name": "canary", "autoscaling_config": scaling}
        ]
    return FakeDashboard(app)


def test_an_autoscaled_pool_is_sized_by_its_floor_and_nothing_else_changes() -> None:
    dashboard = autoscaled_canary(0)
    port = port_for(dashboard)
    before = port.read().canary
    assert before is not None and before.pool_size == 0 and before.expected_replicas == 0

    # A step needs 3 replicas: the floor goes to 3, the ceiling up to it. Nothing else is
    # added: Serve hashes the autoscaling policy into the app's code version (a change there
    # restarts every replica of the app).
    assert port.write(ServeChange(canary_replicas=3)) == {CANARY_REPLICAS}
    [entry] = dashboard.puts[-1]["applications"][0]["deployments"]
    assert entry == {
        "name": "canary",
        "autoscaling_config": {"min_replicas": 3, "max_replicas": 3, "downscale_delay_s": 30},
    }
    assert port.read().canary.pool_size == 3
    assert port.write(ServeChange(canary_replicas=3)) == frozenset()  # already there: no PUT
    assert len(dashboard.puts) == 1

    # After the rollout, back to an idle floor of 0: the raised ceiling stays.
    assert port.write(ServeChange(canary_replicas=0)) == {CANARY_REPLICAS}
    scaling = dashboard.puts[-1]["applications"][0]["deployments"][0]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (0, 3)


def test_a_pool_autoscaled_by_its_code_options_is_not_given_a_config_that_restarts_the_app() -> (
    None
):
    dashboard = autoscaled_canary(0, declared=False)
    with pytest.raises(ServeControlError, match="deployments list"):
        port_for(dashboard).write(ServeChange(canary_replicas=1))
    assert dashboard.puts == []


def test_later_parts_of_a_change_win() -> None:
    first = ServeChange(targets={"canary": V42}, canary_bp=500, canary_replicas=2)
    merged = first.then(ServeChange(targets={"canary": None}, canary_replicas=1))
    assert merged == ServeChange(targets={"canary": None}, canary_bp=500, canary_replicas=1)
    assert not ServeChange() and merged


def test_other_applications_are_written_back_as_they_are_and_deleting_ones_dropped(
    dashboard: FakeDashboard,
) -> None:
    other = app_details("other")
    leaving = {**app_details("leaving"), "status": "DELETING", "deployed_app_config": None}
    dashboard.details["applications"].update(other=other, leaving=leaving)

    port_for(dashboard).write(ServeChange(canary_bp=100))

    apps = {a["name"]: a for a in dashboard.puts[0]["applications"]}
    assert set(apps) == {"ranker", "other"}
    assert apps["other"] == app_details("other")["deployed_app_config"]


def test_an_imperatively_deployed_application_is_refused_on_write_not_on_read(
    dashboard: FakeDashboard,
) -> None:
    dashboard.details["applications"]["run"] = {
        **app_details("run"),
        "deployed_app_config": None,
    }
    port = port_for(dashboard)
    assert port.read().stable is not None
    with pytest.raises(ServeControlError, match="imperatively") as info:
        port.write(ServeChange(canary_bp=100))
    assert not isinstance(info.value, ServeUnreachable)
    assert dashboard.puts == []


def test_a_missing_application_is_refused_on_write(dashboard: FakeDashboard) -> None:
    port = port_for(dashboard, app="nope")
    assert port.read().stable is None
    with pytest.raises(ServeControlError, match="no application 'nope'"):
        port.write(ServeChange(canary_bp=100))


def test_a_user_config_the_replicas_would_refuse_is_not_written_over(
    dashboard: FakeDashboard,
) -> None:
    dashboard.live("ranker", "canary")["deployment_config"]["user_config"] = {"cohort": "x"}
    with pytest.raises(ConfigError, match=r"user_config\.cohort"):
        port_for(dashboard).write(ServeChange(targets={"canary": V42}))
    assert dashboard.puts == []


def test_a_target_no_replica_accepts_is_repaired_and_the_rest_kept(
    dashboard: FakeDashboard,
) -> None:
    # A late or hand-made notification put a revision 0 (refused by every replica) in the
    # canary's user_config, and a weight over 100% in the router's: the controller owns both
    # fields, so its repair replaces them instead of stopping at them.
    live = dashboard.live("ranker", "canary")["deployment_config"]["user_config"]
    live["target"] = {**V41.model_dump(mode="json"), "revision": 0}
    live["report_interval_s"] = 0.4
    dashboard.live("ranker", "router")["deployment_config"]["user_config"]["canary_bp"] = 20_000
    port = port_for(dashboard)
    wanted = ServeChange(targets={"canary": V42}, canary_bp=500)

    assert drift(port.read(), wanted) == {CANARY_TARGET, ROUTER_WEIGHT}
    assert port.write(wanted) == {CANARY_TARGET, ROUTER_WEIGHT}

    entries = {
        e["name"]: e["user_config"] for e in dashboard.puts[0]["applications"][0]["deployments"]
    }
    assert entries["canary"]["target"] == V42.model_dump(mode="json")
    assert entries["canary"]["report_interval_s"] == 0.4
    assert entries["router"]["canary_bp"] == 500
    assert drift(port.read(), wanted) == set()


def test_an_invalid_field_the_controller_does_not_own_still_stops_the_repair(
    dashboard: FakeDashboard,
) -> None:
    live = dashboard.live("ranker", "canary")["deployment_config"]["user_config"]
    live["target"] = {**V41.model_dump(mode="json"), "revision": 0}
    live["report_interval_s"] = -1
    with pytest.raises(ConfigError, match=r"user_config\.report_interval_s"):
        port_for(dashboard).write(ServeChange(targets={"canary": V42}))
    router = dashboard.live("ranker", "router")["deployment_config"]["user_config"]
    router["canary_bp"] = 20_000
    router["probe_interval_s"] = -1
    with pytest.raises(ConfigError, match=r"user_config\.probe_interval_s"):
        port_for(dashboard).write(ServeChange(canary_bp=500))
    assert dashboard.puts == []


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_server_error_is_unreachable_on_read_and_on_write(
    dashboard: FakeDashboard, status: int
) -> None:
    port = port_for(dashboard)
    dashboard.answers.append(status)
    with pytest.raises(ServeUnreachable, match=f"could not read the Serve config \\({status}"):
        port.read()
    dashboard.answers.append(status)
    with pytest.raises(ServeUnreachable):
        port.write(ServeChange(canary_bp=100))
    dashboard.put_answers.append(status)  # the GET answers, the PUT does not
    with pytest.raises(ServeUnreachable, match=f"could not apply the Serve config \\({status}"):
        port.write(ServeChange(canary_bp=100))


@pytest.mark.parametrize("status", [400, 401, 422])
def test_a_refused_put_is_not_an_outage(dashboard: FakeDashboard, status: int) -> None:
    port = port_for(dashboard)
    dashboard.put_answers.append(status)  # the GET answers; the PUT is refused
    with pytest.raises(ServeControlError) as info:
        port.write(ServeChange(canary_bp=100))
    assert not isinstance(info.value, ServeUnreachable)
    assert info.value.category == "serve.control" and f"({status})" in str(info.value)
    assert (dashboard.gets, len(dashboard.puts)) == (1, 1)


def test_nothing_listening_is_unreachable() -> None:
    control = ServeControl(f"http://127.0.0.1:{free_port()}", token="t", timeout_s=2)
    port = HttpServePort(control, app="ranker")
    try:
        with pytest.raises(ServeUnreachable, match="unreachable"):
            port.read()
        with pytest.raises(ServeUnreachable, match="unreachable"):
            port.write(ServeChange(canary_bp=100))
    finally:
        port.close()


def test_the_in_memory_port_counts_as_the_http_port_does() -> None:
    fake = FakeServe(stable=replica_config("stable", V41))
    fake.read()
    assert fake.write(ServeChange(targets={"stable": V41}, canary_bp=0)) == frozenset()
    assert fake.write(ServeChange(targets={"canary": V42}, canary_replicas=2)) == {
        CANARY_TARGET,
        CANARY_REPLICAS,
    }
    assert fake.write(ServeChange()) == frozenset()
    assert (fake.gets, fake.puts) == (3, 1)
    state = fake.read()
    assert state.canary is not None and len(state.canary.running) == 2
    assert fake.target("canary") == V42.model_dump(mode="json")
    assert state.router_weights == Weights.stable_only()


def test_while_serve_rebuilds_the_app_no_user_config_is_made_from_nothing() -> None:
    """During a rebuild (a new code version) Serve shows a deployment with no user_config:
    drift is not judged on it, and a write is refused as a transient outage (the tick holds
    and tries again) instead of writing a config of defaults, which would drop the
    controller the replicas report to, their cache and the rest."""
    stable = deployment_details("stable", None)
    dashboard = FakeDashboard(
        app_details(
            deployments={
                "stable": stable,
                "canary": deployment_details("canary", replica_config("canary")),
                "router": deployment_details("router", router_config()),
            }
        )
    )
    port = port_for(dashboard)
    state = port.read()
    assert state.stable is not None and state.stable.user_config is None
    assert drift(state, ServeChange(targets={"stable": V42})) == frozenset()
    with pytest.raises(ServeUnreachable, match="shows no user_config"):
        port.write(ServeChange(targets={"stable": V42}))
    assert dashboard.puts == []
