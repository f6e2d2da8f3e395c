"""The cross-process models refuse what no process should act on, naming the field."""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from app import contracts
from app.contracts import (
    AppArgs,
    ControllerSettings,
    ControllerStatus,
    InstanceReport,
    ReplicaConfig,
    ReplicaPhase,
    RolloutPhase,
    RouterConfig,
    Target,
)
from app.errors import ConfigError
from rollout.serve_port import router_user_config

SHA = "AB" * 32


def target(**changes: Any) -> dict[str, Any]:
    return {
        "revision": 3,
        "artifact_id": "ranker-v42",
        "manifest_uri": "s3://bucket/ranker-v42/manifest.json",
        "manifest_sha256": SHA,
        **changes,
    }


def report(**changes: Any) -> dict[str, Any]:
    return {
        "replica_id": "r1",
        "cohort": "canary",
        "pid": 123,
        "phase": "ready",
        "actual_revision": 3,
        "actual_artifact": "ranker-v42",
        "heartbeat": 1_790_000_000.0,
        "seq": 7,
        **changes,
    }


def every_contract() -> list[type[BaseModel]]:
    return [
        value
        for value in vars(contracts).values()
        if isinstance(value, type)
        and issubclass(value, contracts.Contract)
        and value is not contracts.Contract
    ]


def test_every_contract_refuses_unknown_fields_and_is_frozen() -> None:
    models = every_contract()
    # The walk finds the contracts at all (an empty list would pass the loop below), the ones
    # every process shares among them.
    names = {model.__name__ for model in models}
    assert {"AppArgs", "ReplicaConfig", "RouterConfig", "Target", "InstanceReport"} <= names, names
    assert len(models) >= 20, names
    for model in models:
        assert model.model_config.get("extra") == "forbid", model.__name__
        assert model.model_config.get("frozen") is True, model.__name__


def test_unknown_user_config_field_is_named() -> None:
    with pytest.raises(ConfigError) as caught:
        ReplicaConfig.from_user_config({"cohort": "stable", "target": target(extra_field=1)})
    assert caught.value.ids["field"] == "user_config.target.extra_field"
    assert "user_config.target.extra_field" in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"cohort": "blue"}, "user_config.cohort"),
        ({"cohort": "stable", "report_interval_s": 1e12}, "user_config.report_interval_s"),
        ({"cohort": "stable", "retry": {"cap_s": 1e9}}, "user_config.retry.cap_s"),
        ({"cohort": "stable", "retry": {"cap_s": 1e12}}, "user_config.retry.cap_s"),
        ({"cohort": "stable", "retry": {"initial_s": 1e12}}, "user_config.retry.initial_s"),
        ({"cohort": "stable", "report_interval_s": float("inf")}, "user_config.report_interval_s"),
        ({"cohort": "stable", "report_interval_s": 0}, "user_config.report_interval_s"),
        ({"cohort": "stable", "cache_byte_budget": 1 << 60}, "user_config.cache_byte_budget"),
        ({"cohort": "stable", "cache_dir": "x" * 5000}, "user_config.cache_dir"),
        ({"cohort": "stable", "batching": {"max_batch_size": 4096}}, "user_config.batching"),
        ({"cohort": "stable", "target": target(revision=0)}, "user_config.target.revision"),
        ({"cohort": "stable", "target": target(manifest_sha256="xyz")}, "user_config.target"),
    ],
)
def test_out_of_bounds_user_config_is_refused_naming_the_field(
    raw: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        ReplicaConfig.from_user_config(raw)
    assert caught.value.ids["field"].startswith(field)


def test_manifest_digest_is_normalised_to_lower_case() -> None:
    assert Target.model_validate(target()).manifest_sha256 == SHA.lower()


def test_user_config_round_trips_through_json_as_serve_stores_it() -> None:
    config = ReplicaConfig.from_user_config(
        {"cohort": "canary", "target": target(), "faults": {"error_rate": 0.5}}
    )
    wire = json.loads(json.dumps(config.model_dump(mode="json")))
    assert ReplicaConfig.from_user_config(wire) == config
    assert config.with_target(None).target is None and config.target is not None


def test_router_weight_change_keeps_the_rest_and_is_bounded() -> None:
    config = {"salt": "s", "max_in_flight": 9}
    moved = RouterConfig.model_validate(router_user_config(config, 2500))
    assert (moved.canary_bp, moved.salt, moved.max_in_flight) == (2500, "s", 9)
    assert router_user_config({**config, "canary_bp": 2500}, 2500) is None  # nothing to change
    with pytest.raises(ConfigError, match="canary_bp"):
        router_user_config(config, 10_001)


@pytest.mark.parametrize(
    "changes",
    [
        {"heartbeat": 1e20},
        {"seq": -1},
        {"phase": "dancing"},
        {"cohort": "blue"},
        {"replica_id": "r" * 500},
        {"last_error": {"category": "x", "message": "m" * 10_000}},
        {"capacity": {"memory": {"resident_bytes": -5}}},
        {"timings": {"load": 1e12}},
        {"surprise": True},
        {"heartbeat": float("nan")},
        {"seq": 2**60},
        {"incarnation": "i" * 500},
        {"thread_restarts": -1},
        {"thread_crash": {"category": "internal", "message": "m" * 10_000}},
    ],
)
def test_a_report_no_replica_could_send_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        InstanceReport.model_validate(report(**changes))


def test_report_reads_typed() -> None:
    parsed = InstanceReport.model_validate(
        report(capacity={"memory": {"resident_bytes": 10, "capacity_bytes": 100}})
    )
    assert parsed.phase is ReplicaPhase.READY and parsed.serving
    assert parsed.capacity.memory.capacity_bytes == 100
    assert parsed.capacity.memory.load_peak_bytes is None
    assert InstanceReport.model_validate(parsed.model_dump(mode="json")) == parsed


def test_app_args_bounds_and_names() -> None:
    with pytest.raises(ConfigError) as caught:
        AppArgs.parse({"stable": {"num_replicas": 10**9}}, where="args")
    assert caught.value.ids["field"] == "args.stable.num_replicas"


def test_controller_settings_bound_the_tick() -> None:
    with pytest.raises(ValidationError):
        ControllerSettings(registry_url="sqlite:///x", dashboard_url="http://h", tick_interval_s=0)


def test_terminal_phases_are_the_enum_s_terminal_members() -> None:
    terminal = {p.value for p in RolloutPhase if p.is_terminal}
    assert terminal == contracts.TERMINAL_ROLLOUT_PHASES
    assert terminal == {"succeeded", "rolled_back", "failed", "aborted"}


def test_a_registry_row_the_contract_refuses_is_a_consistency_error() -> None:
    from datetime import UTC, datetime

    from app.errors import ConsistencyError
    from app.registry import TargetRecord

    row = TargetRecord(
        model="ranker",
        environment="default",
        cohort="canary",
        revision=4,
        artifact_id="ranker-v42",
        manifest_uri="s3://b/" + "x" * 5000,
        manifest_sha256=SHA,
        feature_schema="ranker-features-v3",
        updated_at=datetime(2030, 1, 1, tzinfo=UTC),
    )
    for read in (row.target, row.published):
        with pytest.raises(ConsistencyError, match=r"canary target 'ranker-v42' .*manifest_uri"):
            read()
    fine = TargetRecord(**{**row.__dict__, "manifest_uri": "s3://b/m.json"})
    assert fine.target().manifest_sha256 == SHA.lower()
    assert fine.published().updated_at.startswith("2030-01-01")


def test_text_is_clipped_to_fit_its_field() -> None:
    assert contracts.clip_text("abc") == "abc" and contracts.clip_text(None) is None
    long = contracts.clip_text("y" * 10_000)
    assert len(long) == contracts.MAX_TEXT and long.endswith("...")
    assert contracts.ErrorInfo(category="c", message=long).message == long


def test_the_controller_status_counts_refused_reports() -> None:
    assert ControllerStatus().reports_refused == 0
    assert ControllerStatus(reports_refused=3).reports_refused == 3
    with pytest.raises(ValidationError):
        ControllerStatus(reports_refused=-1)


def test_the_data_path_types_pickle_by_the_name_every_release_resolves() -> None:
    # Router and replicas of two releases exchange them while an upgrade rolls through: a
    # pickle must name app.contracts, where every release finds them, not the module that
    # defines them now.
    request = contracts.WireRequest(("a",), np.zeros((1, 2), np.float32), {}, 1)
    meta = contracts.ModelMeta("ranker-v42", 3, "stable", "build", "r1")
    answer = contracts.WireAnswer(meta, [[("a", 0.5, "high")]])
    for value in (request, meta, answer):
        data = pickle.dumps(value)
        assert b"app.contracts.wire" not in data and b"app.contracts" in data
        assert type(pickle.loads(data)) is type(value)
