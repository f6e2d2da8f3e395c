"""The model registry's interface: records, the ``Registry`` protocol, and the rules that do
not depend on a database.

Two ideas carry the design:

- An *artifact* (model + artifact_id, pinned by its manifest's SHA-256) is immutable content.
  A *target* is a publishing intent per (model, environment, cohort) with a revision that only
  ever grows. A rollback is a publish of an older artifact at a *higher* revision.
- Targets move only by compare-and-set on the revision, with an audit row in the same
  transaction. A lost race is a :class:`~app.errors.RevisionConflict` carrying the target as it
  is now; the caller re-reads and decides, never writes blindly.

All timestamps are timezone-aware UTC datetimes on both backends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, Literal, Protocol, Self, TypeVar

from pydantic import BaseModel, ValidationError

from app.contracts import PublishedTarget, Target
from app.errors import ConsistencyError
from app.manifest import Manifest

ArtifactState = Literal["pending", "ready", "rejected"]

M = TypeVar("M", bound=BaseModel)

ARTIFACT_STATES: Final[tuple[str, ...]] = ("pending", "ready", "rejected")

# How a registry is opened: ``create`` makes the database (SQLite file) if absent and migrates
# it; ``migrate`` migrates an existing one; ``write`` and ``read`` need an existing database
# at this code's schema and change no schema (``read`` also writes no row).
RegistryAccess = Literal["create", "migrate", "write", "read"]
REGISTRY_ACCESS: Final[tuple[str, ...]] = ("create", "migrate", "write", "read")


def utc_now() -> datetime:
    return datetime.now(UTC)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class _Record:
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (datetimes as ISO-8601 strings)."""
        data: dict[str, Any] = _jsonable(dataclasses.asdict(self))  # type: ignore[call-overload]
        return data


@dataclass(frozen=True)
class ArtifactRecord(_Record):
    model: str
    artifact_id: str
    manifest_uri: str
    manifest_sha256: str
    state: str  # ArtifactState
    feature_schema: str
    runtime: str
    metadata: dict[str, Any]  # the manifest's metadata (offline evaluation) plus caller extras
    created_at: datetime
    updated_at: datetime
    state_actor: str | None = None  # who approved / rejected
    state_reason: str | None = None
    kind: str = "model"  # ArtifactKind: model | backbone | head
    # A head's pinned backbone (from its manifest).
    backbone_artifact_id: str | None = None
    backbone_manifest_sha256: str | None = None


@dataclass(frozen=True)
class TargetRecord(_Record):
    """What one cohort should serve: everything a replica needs to fetch and verify it."""

    model: str
    environment: str
    cohort: str  # Cohort
    revision: int
    artifact_id: str
    manifest_uri: str
    manifest_sha256: str
    feature_schema: str
    updated_at: datetime

    def published(self) -> PublishedTarget:
        """The record as the controller shows it (``rollout status``)."""
        return self._as(PublishedTarget, self.to_dict())

    def target(self) -> Target:
        """What a replica of the cohort is given in its user_config."""
        fields = {name: getattr(self, name) for name in Target.model_fields}
        return self._as(Target, fields)

    def _as(self, model: type[M], fields: dict[str, Any]) -> M:
        # A row the contract refuses (say a URI longer than any replica accepts) is the
        # registry's inconsistency, refused as one, not a crash of whoever read it.
        try:
            return model.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ConsistencyError(
                f"{self.cohort} target {self.artifact_id!r} (revision {self.revision}) is not a "
                f"valid target: {where}: {first.get('msg')}"
            ) from None


@dataclass(frozen=True)
class AuditEntry(_Record):
    id: int
    model: str
    environment: str
    cohort: str
    old_artifact_id: str | None  # None when the publish created the cohort's first target
    new_artifact_id: str
    old_revision: int  # 0 when the publish created the cohort's first target
    new_revision: int
    actor: str
    reason: str
    approval: str | None
    at: datetime


@dataclass(frozen=True)
class ArtifactAuditEntry(_Record):
    """One decision about an artifact: its registration, approval or rejection."""

    id: int
    model: str
    artifact_id: str
    action: str  # register | approve | reject
    old_state: str | None  # None for a registration
    new_state: str
    actor: str
    reason: str | None
    at: datetime


@dataclass(frozen=True)
class RolloutRecord(_Record):
    """A rollout as persisted; ``version`` is its compare-and-set counter (starts at 1)."""

    id: str
    model: str
    environment: str
    candidate_artifact_id: str
    baseline_artifact_id: str | None
    plan: dict[str, Any]
    phase: str
    step: int
    weights: dict[str, Any]
    verdicts: list[Any]  # verdict history, oldest first
    state: dict[str, Any]  # the controller's resumable state, opaque to the registry
    reason: str | None
    version: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @property
    def active(self) -> bool:
        return self.finished_at is None


@dataclass(frozen=True)
class ReplicaReportRecord(_Record):
    """What one replica says about itself; upserted by ``replica_id``."""

    replica_id: str
    model: str
    environment: str
    cohort: str
    state: str
    heartbeat_at: datetime
    desired_revision: int | None = None
    desired_artifact_id: str | None = None
    actual_revision: int | None = None
    actual_artifact_id: str | None = None
    last_error: str | None = None
    capacity: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # download/verify/load/dry_run/...


def check_observed(observed: TargetRecord | None, current: TargetRecord) -> None:
    """Refuse a target that contradicts one observed before for the same cohort.

    The same revision with a different artifact, or a revision that went backwards, means
    the control plane is inconsistent (a restored backup, a hand edit): raise
    ConsistencyError rather than guess which side is right. A newer revision is fine.
    """
    if observed is None:
        return
    key = (observed.model, observed.environment, observed.cohort)
    if key != (current.model, current.environment, current.cohort):
        raise ValueError(f"observed target is for {key}, current is for another cohort")
    if current.revision == observed.revision and current.artifact_id != observed.artifact_id:
        raise ConsistencyError(
            f"{'/'.join(key)} revision {current.revision} was {observed.artifact_id!r} and is "
            f"now {current.artifact_id!r}: the same revision must never change its artifact",
            model=current.model,
            revision=current.revision,
        )
    if current.revision < observed.revision:
        raise ConsistencyError(
            f"{'/'.join(key)} revision went back from {observed.revision} to "
            f"{current.revision}: revisions only ever grow",
            model=current.model,
            revision=current.revision,
        )


class Registry(Protocol):
    """The model registry. Implementations: SqliteRegistry, PostgresRegistry.

    Every method is one transaction. Errors are the typed errors of app/errors.py.
    Instances are safe to share between threads; open one per process.
    """

    @property
    def schema_version(self) -> int: ...

    # Artifacts
    def register_artifact(
        self,
        manifest_uri: str,
        manifest_sha256: str,
        *,
        state: ArtifactState = "pending",
        metadata: Mapping[str, Any] | None = None,
        accept: Callable[[Manifest], None] | None = None,
        actor: str = "unknown",
    ) -> ArtifactRecord:
        """Read + verify the manifest, then record it; model and artifact_id come from it.
        ``accept(manifest)``, when given, is called before anything is written and refuses
        (raises) what the caller cannot use, e.g. what the service could never serve.
        A new registration is an audit row by ``actor`` (:meth:`artifact_history`).

        Same id and digest again: returns the existing record unchanged. Same id, another
        digest: DigestMismatch. A manifest that fails verification: ArtifactRejected."""
        ...

    def get_artifact(self, model: str, artifact_id: str) -> ArtifactRecord: ...

    def list_artifacts(self, model: str) -> list[ArtifactRecord]: ...

    def approve_artifact(
        self, model: str, artifact_id: str, *, actor: str, reason: str | None = None
    ) -> ArtifactRecord:
        """pending -> ready (ready stays ready); rejected -> InvalidState. A change is an
        audit row."""
        ...

    def reject_artifact(
        self, model: str, artifact_id: str, *, actor: str, reason: str
    ) -> ArtifactRecord:
        """pending|ready -> rejected; InvalidState while any cohort targets it. A change is an
        audit row."""
        ...

    def artifact_history(
        self, model: str, *, artifact_id: str | None = None, limit: int = 100
    ) -> list[ArtifactAuditEntry]:
        """Registrations, approvals and rejections (each one that changed a state), newest
        first."""
        ...

    # Targets
    def get_target(
        self, model: str, env: str, cohort: str, *, observed: TargetRecord | None = None
    ) -> TargetRecord:
        """The cohort's current target (NotFound if none). With ``observed``, also
        :func:`check_observed` against it."""
        ...

    def list_targets(self, model: str, env: str) -> list[TargetRecord]:
        """Stable first, then canary; cohorts without a target are absent."""
        ...

    def publish(
        self,
        model: str,
        env: str,
        cohort: str,
        artifact_id: str,
        expected_revision: int,
        *,
        actor: str,
        reason: str,
        approval: str | None = None,
    ) -> TargetRecord:
        """Compare-and-set the cohort's target to ``artifact_id`` at expected_revision + 1.

        expected_revision 0 creates the first target (revision 1). The artifact must be
        ``ready`` (else InvalidState; unknown: NotFound). Lost race: RevisionConflict with
        ``current`` = the target now (None if absent). One audit row per successful publish."""
        ...

    def history(
        self, model: str, env: str, *, cohort: str | None = None, limit: int = 100
    ) -> list[AuditEntry]:
        """Audit rows, newest first."""
        ...

    # Rollouts
    def create_rollout(
        self,
        model: str,
        env: str,
        *,
        candidate_artifact_id: str,
        baseline_artifact_id: str | None,
        plan: Mapping[str, Any],
        phase: str = "pending",
        weights: Mapping[str, Any] | None = None,
        rollout_id: str | None = None,
    ) -> RolloutRecord:
        """New active rollout (version 1). InvalidState if one is active for model + env;
        NotFound if an artifact is unknown."""
        ...

    def update_rollout(
        self,
        rollout_id: str,
        *,
        expected_version: int,
        phase: str | None = None,
        step: int | None = None,
        weights: Mapping[str, Any] | None = None,
        verdicts: Sequence[Any] | None = None,
        state: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> RolloutRecord:
        """Compare-and-set on ``version``: fields given replace the stored ones, version + 1.
        Lost update: RevisionConflict(current=<record now>). A terminal phase finishes the
        rollout; a finished rollout refuses updates (InvalidState)."""
        ...

    def get_rollout(self, rollout_id: str) -> RolloutRecord: ...

    def get_active_rollout(self, model: str, env: str) -> RolloutRecord | None: ...

    def list_rollouts(
        self, model: str | None = None, env: str | None = None, *, limit: int = 50
    ) -> list[RolloutRecord]:
        """Newest first."""
        ...

    # Replica reports
    def upsert_replica_report(self, report: ReplicaReportRecord) -> None: ...

    def list_replica_reports(
        self, model: str, env: str, *, cohort: str | None = None
    ) -> list[ReplicaReportRecord]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
