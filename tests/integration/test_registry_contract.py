"""The registry contract, run against both backends (SQLite and a real PostgreSQL server)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import app.registry
from app.artifact_store import manifest_uri_for
from app.demo_artifacts import SplitArtifacts, pack_split_artifacts
from app.errors import (
    ArtifactRejected,
    ConsistencyError,
    DigestMismatch,
    InvalidState,
    NotFound,
    RevisionConflict,
)
from app.manifest import Architecture
from app.packing import PackResult
from app.registry import Registry, ReplicaReportRecord, TargetRecord
from tests.integration.backends import Backend
from tests.integration.manifests import MakeManifest

MODEL, ENV = "ranker", "default"
ReadyArtifacts = Callable[..., None]


def publish(
    registry: Registry, cohort: str, artifact_id: str, expected: int, **kw: Any
) -> TargetRecord:
    return registry.publish(
        MODEL, ENV, cohort, artifact_id, expected, actor="alice", reason="test", **kw
    )


def test_public_surface_is_pinned() -> None:
    assert set(app.registry.__all__) == {
        "ARTIFACT_STATES",
        "DEFAULT_REGISTRY_URL",
        "ArtifactRecord",
        "AuditEntry",
        "Registry",
        "ReplicaReportRecord",
        "RolloutRecord",
        "TargetRecord",
        "check_observed",
        "default_registry_url",
        "open_registry",
    }
    assert all(hasattr(app.registry, name) for name in app.registry.__all__)


def test_timestamps_and_documents_use_each_backends_own_types(
    backend: Backend, registry: Registry, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("v1")
    registry.register_artifact(ref.uri, ref.sha256)
    if backend.name == "sqlite":
        # UTC ISO-8601 text of fixed width (a "timestamptz" column would get numeric affinity).
        [(kind, text)] = backend.query("SELECT typeof(created_at), created_at FROM model_artifact")
        assert (
            kind == "text"
            and text.endswith("Z")
            and len(text) == len("2030-01-01T00:00:00.000000Z")
        )
    else:
        types = dict(
            backend.query(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = 'model_artifact'"
            )
        )
        assert types["created_at"] == "timestamp with time zone"
        assert types["metadata"] == "jsonb"


# ---- artifacts --------------------------------------------------------------------------


def test_register_takes_identity_and_metadata_from_the_manifest(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("ranker-v41", metadata={"offline_eval": {"ndcg@10": 0.43}})

    record = registry.register_artifact(ref.uri, ref.sha256.upper(), metadata={"owner": "ml"})

    assert (record.model, record.artifact_id, record.state) == ("ranker", "ranker-v41", "pending")
    assert record.manifest_sha256 == ref.sha256
    assert record.manifest_uri == ref.uri
    assert record.feature_schema == "ranker-features-v3"
    assert record.metadata == {"offline_eval": {"ndcg@10": 0.43}, "owner": "ml"}
    assert record.created_at.tzinfo is not None
    assert record.created_at.utcoffset() == timedelta(0)
    assert registry.get_artifact("ranker", "ranker-v41") == record


def test_register_again_with_the_same_digest_changes_nothing(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("ranker-v41")
    first = registry.register_artifact(ref.uri, ref.sha256)
    approved = registry.approve_artifact("ranker", "ranker-v41", actor="bob")

    again = registry.register_artifact(ref.uri, ref.sha256)

    assert again == approved
    assert again.created_at == first.created_at
    assert [a.artifact_id for a in registry.list_artifacts("ranker")] == ["ranker-v41"]


def test_register_same_id_with_other_content_is_a_digest_mismatch(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    original = make_manifest("ranker-v41")
    registry.register_artifact(original.uri, original.sha256)
    other = make_manifest("ranker-v41", weights_digest="cd" * 32)

    with pytest.raises(DigestMismatch, match="ranker-v41") as info:
        registry.register_artifact(other.uri, other.sha256)

    assert info.value.category == "registry.digest_mismatch"
    assert registry.get_artifact("ranker", "ranker-v41").manifest_sha256 == original.sha256


def test_register_refuses_a_manifest_that_differs_from_its_pinned_digest(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("ranker-v41")

    with pytest.raises(ArtifactRejected) as info:
        registry.register_artifact(ref.uri, "0" * 64)

    assert info.value.category == "manifest_digest"
    assert registry.list_artifacts("ranker") == []


def test_register_refuses_a_missing_manifest(registry: Registry, tmp_path) -> None:
    with pytest.raises(ArtifactRejected) as info:
        registry.register_artifact((tmp_path / "nowhere" / "manifest.json").as_uri(), "0" * 64)
    assert info.value.category == "missing"


def test_artifact_states_move_pending_ready_rejected_only(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    for artifact_id in ("a1", "a2"):
        ref = make_manifest(artifact_id)
        registry.register_artifact(ref.uri, ref.sha256)

    ready = registry.approve_artifact(MODEL, "a1", actor="bob", reason="offline eval ok")
    assert (ready.state, ready.state_actor, ready.state_reason) == (
        "ready",
        "bob",
        "offline eval ok",
    )
    assert registry.approve_artifact(MODEL, "a1", actor="carol").state_actor == "bob"

    rejected = registry.reject_artifact(MODEL, "a2", actor="bob", reason="ndcg regression")
    assert (rejected.state, rejected.state_reason) == ("rejected", "ndcg regression")
    with pytest.raises(InvalidState, match="ndcg regression"):
        registry.approve_artifact(MODEL, "a2", actor="bob")
    with pytest.raises(NotFound):
        registry.approve_artifact(MODEL, "nope", actor="bob")
    with pytest.raises(NotFound):
        registry.get_artifact(MODEL, "nope")


def test_an_artifact_that_a_cohort_targets_cannot_be_rejected(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v1")
    publish(registry, "stable", "v1", 0)

    with pytest.raises(InvalidState, match="default/stable@1"):
        registry.reject_artifact(MODEL, "v1", actor="bob", reason="late finding")
    assert registry.get_artifact(MODEL, "v1").state == "ready"


# ---- targets ----------------------------------------------------------------------------


def test_first_publish_creates_revision_1_with_what_a_replica_needs(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("v1")
    registry.register_artifact(ref.uri, ref.sha256, state="ready")

    target = publish(registry, "stable", "v1", 0)

    assert (target.cohort, target.revision, target.artifact_id) == ("stable", 1, "v1")
    assert (target.manifest_uri, target.manifest_sha256) == (ref.uri, ref.sha256)
    assert target.feature_schema == "ranker-features-v3"
    assert registry.get_target(MODEL, ENV, "stable") == target
    assert registry.list_targets(MODEL, ENV) == [target]
    # The same target in the contracts' terms: as the controller shows it, and as a replica
    # of the cohort is given it.
    shown = target.published()
    assert shown.model_dump(mode="json") == target.to_dict()
    assert shown.target() == target.target()
    assert target.target().model_dump() == {
        "revision": 1,
        "artifact_id": "v1",
        "manifest_uri": ref.uri,
        "manifest_sha256": ref.sha256,
        "feature_schema": "ranker-features-v3",
    }


def test_publish_is_compare_and_set_with_one_audit_row_each(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v1", "v2")
    publish(registry, "stable", "v1", 0)

    target = registry.publish(
        MODEL, ENV, "stable", "v2", 1, actor="carol", reason="weekly", approval="CHG-7"
    )

    assert (target.revision, target.artifact_id) == (2, "v2")
    newest, oldest = registry.history(MODEL, ENV)
    assert (oldest.old_artifact_id, oldest.new_artifact_id) == (None, "v1")
    assert (oldest.old_revision, oldest.new_revision) == (0, 1)
    assert (newest.old_artifact_id, newest.new_artifact_id) == ("v1", "v2")
    assert (newest.old_revision, newest.new_revision) == (1, 2)
    assert (newest.actor, newest.reason, newest.approval) == ("carol", "weekly", "CHG-7")
    assert newest.at.utcoffset() == timedelta(0)


def test_a_stale_expected_revision_conflicts_and_carries_the_current_target(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v1", "v2")
    publish(registry, "stable", "v1", 0)
    current = publish(registry, "stable", "v2", 1)

    for expected in (1, 3, 0):
        with pytest.raises(RevisionConflict) as info:
            publish(registry, "stable", "v1", expected)
        assert info.value.current == current
        assert info.value.category == "registry.conflict"

    with pytest.raises(RevisionConflict) as info:
        publish(registry, "canary", "v1", 4)  # no canary target yet
    assert info.value.current is None
    assert registry.get_target(MODEL, ENV, "stable") == current
    assert len(registry.history(MODEL, ENV)) == 2


def test_only_ready_artifacts_are_published(
    registry: Registry, make_manifest: MakeManifest
) -> None:
    for artifact_id in ("pending-1", "rejected-1"):
        ref = make_manifest(artifact_id)
        registry.register_artifact(ref.uri, ref.sha256)
    registry.reject_artifact(MODEL, "rejected-1", actor="bob", reason="bad")

    with pytest.raises(InvalidState, match="pending"):
        publish(registry, "canary", "pending-1", 0)
    with pytest.raises(InvalidState, match="rejected"):
        publish(registry, "canary", "rejected-1", 0)
    with pytest.raises(NotFound):
        publish(registry, "canary", "never-registered", 0)

    assert registry.list_targets(MODEL, ENV) == []
    assert registry.history(MODEL, ENV) == []


def test_rollback_publishes_the_older_artifact_at_a_higher_revision(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("ranker-v41", "ranker-v42")
    publish(registry, "stable", "ranker-v41", 0)
    publish(registry, "stable", "ranker-v42", 1)

    rolled_back = publish(registry, "stable", "ranker-v41", 2)

    assert (rolled_back.revision, rolled_back.artifact_id) == (3, "ranker-v41")
    assert [(e.new_revision, e.new_artifact_id) for e in registry.history(MODEL, ENV)] == [
        (3, "ranker-v41"),
        (2, "ranker-v42"),
        (1, "ranker-v41"),
    ]


def test_cohorts_and_environments_have_their_own_revisions(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v1", "v2")
    publish(registry, "stable", "v1", 0)
    publish(registry, "canary", "v2", 0)
    publish(registry, "canary", "v1", 1)
    registry.publish(MODEL, "staging", "stable", "v2", 0, actor="a", reason="r")

    assert [(t.cohort, t.revision, t.artifact_id) for t in registry.list_targets(MODEL, ENV)] == [
        ("stable", 1, "v1"),
        ("canary", 2, "v1"),
    ]
    assert registry.get_target(MODEL, "staging", "stable").revision == 1
    assert [e.new_revision for e in registry.history(MODEL, ENV, cohort="canary")] == [2, 1]
    assert len(registry.history(MODEL, ENV, limit=2)) == 2
    with pytest.raises(NotFound):
        registry.get_target(MODEL, "staging", "canary")


def test_a_reader_refuses_a_target_that_contradicts_what_it_observed(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v1", "v2")
    seen = publish(registry, "stable", "v1", 0)

    # Unchanged, or moved forward: fine.
    assert registry.get_target(MODEL, ENV, "stable", observed=seen) == seen
    newer = publish(registry, "stable", "v2", 1)
    assert registry.get_target(MODEL, ENV, "stable", observed=seen) == newer

    # Revision 2 was v2 when we read it; a reader that remembers it as v1 is told.
    with pytest.raises(ConsistencyError, match="same revision"):
        registry.get_target(
            MODEL, ENV, "stable", observed=dataclasses.replace(newer, artifact_id="v1")
        )
    # A revision that goes backwards (a restored backup) is refused too.
    with pytest.raises(ConsistencyError, match="went back"):
        registry.get_target(MODEL, ENV, "stable", observed=dataclasses.replace(newer, revision=9))


# ---- rollouts ---------------------------------------------------------------------------


def test_rollout_lifecycle_with_versioned_updates(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v41", "v42")
    plan = {"steps": [5, 25, 50, 100], "interval_s": 60}

    created = registry.create_rollout(
        MODEL, ENV, candidate_artifact_id="v42", baseline_artifact_id="v41", plan=plan
    )
    assert (created.phase, created.step, created.version, created.active) == (
        "pending",
        0,
        1,
        True,
    )
    assert created.plan == plan and created.verdicts == [] and created.weights == {}
    assert registry.get_active_rollout(MODEL, ENV) == created

    with pytest.raises(InvalidState, match=created.id):
        registry.create_rollout(
            MODEL, ENV, candidate_artifact_id="v41", baseline_artifact_id=None, plan=plan
        )

    step1 = registry.update_rollout(
        created.id,
        expected_version=1,
        phase="progressing",
        step=1,
        weights={"stable": 9500, "canary": 500},
        verdicts=[{"window": 1, "verdict": "pass"}],
        state={"failed_checks": 0},
    )
    assert (step1.phase, step1.step, step1.version) == ("progressing", 1, 2)
    assert step1.weights == {"stable": 9500, "canary": 500}
    assert step1.verdicts == [{"window": 1, "verdict": "pass"}]
    assert step1.plan == plan  # untouched fields keep their values

    with pytest.raises(RevisionConflict) as info:
        registry.update_rollout(created.id, expected_version=1, step=2)
    assert info.value.current == step1

    done = registry.update_rollout(
        created.id, expected_version=2, phase="rolled_back", reason="canary p99 regression"
    )
    assert done.finished_at is not None and not done.active
    assert registry.get_active_rollout(MODEL, ENV) is None
    with pytest.raises(InvalidState, match="finished"):
        registry.update_rollout(created.id, expected_version=3, phase="progressing")

    second = registry.create_rollout(
        MODEL, ENV, candidate_artifact_id="v42", baseline_artifact_id="v41", plan=plan
    )
    assert [r.id for r in registry.list_rollouts(MODEL, ENV)] == [second.id, created.id]
    assert registry.get_rollout(created.id) == done
    assert registry.list_rollouts(MODEL, "elsewhere") == []


def test_rollout_of_unknown_artifacts_or_ids_is_not_found(
    registry: Registry, ready_artifacts: ReadyArtifacts
) -> None:
    ready_artifacts("v41")
    with pytest.raises(NotFound):
        registry.create_rollout(
            MODEL, ENV, candidate_artifact_id="v99", baseline_artifact_id="v41", plan={}
        )
    with pytest.raises(NotFound):
        registry.create_rollout(
            MODEL, ENV, candidate_artifact_id="v41", baseline_artifact_id="v98", plan={}
        )
    with pytest.raises(NotFound):
        registry.get_rollout("ro-missing")
    with pytest.raises(NotFound):
        registry.update_rollout("ro-missing", expected_version=1, step=1)


# ---- replica reports --------------------------------------------------------------------


def _report(replica_id: str, heartbeat_at: datetime, **kw: Any) -> ReplicaReportRecord:
    fields: dict[str, Any] = {"model": MODEL, "environment": ENV, "cohort": "canary"}
    fields.update(kw)
    return ReplicaReportRecord(
        replica_id=replica_id, heartbeat_at=heartbeat_at, state="serving", **fields
    )


def test_replica_reports_upsert_and_list(registry: Registry) -> None:
    now = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    fresh = _report(
        "canary#1",
        now - timedelta(seconds=5),
        desired_revision=3,
        desired_artifact_id="v42",
        actual_revision=2,
        actual_artifact_id="v41",
        capacity={"max_ongoing_requests": 16},
        timings={"download": 0.5, "verify": 0.1, "load": 1.25, "dry_run": 0.05},
    )
    registry.upsert_replica_report(fresh)
    # Another clock's offset is the same instant in UTC.
    tz_plus_2 = (now - timedelta(seconds=120)).astimezone(timezone(timedelta(hours=2)))
    registry.upsert_replica_report(_report("stable#1", tz_plus_2, cohort="stable"))
    assert tz_plus_2.utcoffset() == timedelta(hours=2)

    stable = _report("stable#1", tz_plus_2, cohort="stable")
    assert registry.list_replica_reports(MODEL, ENV) == [fresh, stable]
    assert [r.replica_id for r in registry.list_replica_reports(MODEL, ENV, cohort="canary")] == [
        "canary#1"
    ]

    updated = dataclasses.replace(
        fresh, actual_revision=3, actual_artifact_id="v42", state="serving", last_error=None
    )
    registry.upsert_replica_report(updated)
    assert registry.list_replica_reports(MODEL, ENV, cohort="canary") == [updated]

    with pytest.raises(ValueError, match="timezone-aware"):
        registry.upsert_replica_report(_report("stable#2", datetime(2030, 1, 1)))


# ---- backbones and heads ----------------------------------------------------------------


def split_artifacts(root: Path) -> tuple[SplitArtifacts, SplitArtifacts]:
    arch = Architecture(
        name="ranker-mlp", version=1, params={"hidden_dim": 8, "num_layers": 1, "context_dim": 2}
    )
    one = pack_split_artifacts(root, arch, backbone_id="b1", backbone_seed=1, heads=[("h1", 1)])
    other = pack_split_artifacts(
        root / "elsewhere", arch, backbone_id="b2", backbone_seed=2, heads=[("h2", 2)]
    )
    return one, other


def register(registry: Registry, packed: PackResult, *, approve: bool = True) -> None:
    registry.register_artifact(packed.manifest_uri, packed.manifest_sha256)
    if approve:
        registry.approve_artifact(MODEL, packed.artifact_id, actor="bob")


def test_the_registry_records_a_heads_backbone_and_publishes_it_only_on_a_ready_one(
    registry: Registry, tmp_path: Path
) -> None:
    one, _ = split_artifacts(tmp_path)
    head = one.heads[0]
    register(registry, head)
    record = registry.get_artifact(MODEL, "h1")
    assert (record.kind, record.backbone_artifact_id, record.backbone_manifest_sha256) == (
        "head",
        "b1",
        one.backbone.manifest_sha256,
    )
    with pytest.raises(InvalidState, match="backbone ranker/b1, which is not registered"):
        publish(registry, "stable", "h1", 0)
    register(registry, one.backbone, approve=False)
    assert registry.get_artifact(MODEL, "b1").kind == "backbone"
    with pytest.raises(InvalidState, match="pending, not ready"):
        publish(registry, "stable", "h1", 0)
    registry.approve_artifact(MODEL, "b1", actor="bob")
    target = publish(registry, "stable", "h1", 0)
    assert (target.artifact_id, target.revision) == ("h1", 1)
    # The backbone is never a target itself, and is not rejected under a targeted head.
    with pytest.raises(InvalidState, match="never served alone"):
        publish(registry, "canary", "b1", 0)
    with pytest.raises(InvalidState, match=r"runs the heads targeted by default/stable \(h1\)"):
        registry.reject_artifact(MODEL, "b1", actor="bob", reason="late finding")
    assert registry.get_artifact(MODEL, "b1").state == "ready"


def test_a_head_is_not_published_on_a_backbone_its_replicas_would_not_find(
    registry: Registry, tmp_path: Path
) -> None:
    _, other = split_artifacts(tmp_path)
    # h2's backbone registered from a copy in another directory than beside h2.
    moved = tmp_path / "moved" / "b2"
    shutil.copytree(other.backbone.out_dir, moved)
    registry.register_artifact(manifest_uri_for(moved), other.backbone.manifest_sha256)
    registry.approve_artifact(MODEL, "b2", actor="bob")
    register(registry, other.heads[0])
    with pytest.raises(InvalidState, match="replicas look for it beside the head"):
        publish(registry, "stable", "h2", 0)
