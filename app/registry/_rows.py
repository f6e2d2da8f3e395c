"""What the registry's operations (app.registry._sql) are written over: rows, the transaction
interface each backend provides, the packaged migrations, and rows turned into records with
the backend's own conversions of timestamps and JSON (``RecordReader``)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from importlib import resources
from typing import Any, Final, Protocol

from app.contracts import COHORTS
from app.registry.base import (
    ArtifactRecord,
    AuditEntry,
    ReplicaReportRecord,
    RolloutRecord,
    TargetRecord,
)

Row = Mapping[str, Any]
Clock = Callable[[], datetime]

MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
ROLLOUT_ID_PREFIX: Final = "ro-"

TARGET_SELECT: Final = """
    SELECT t.model, t.environment, t.cohort, t.revision, t.artifact_id, t.updated_at,
           a.manifest_uri, a.manifest_sha256, a.feature_schema
    FROM deployment_target t
    JOIN model_artifact a ON a.model = t.model AND a.artifact_id = t.artifact_id
"""


class Tx(Protocol):
    """One open transaction. Statements use ``?`` placeholders."""

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute; return the number of rows affected."""
        ...

    def script(self, sql: str) -> None:
        """Execute a migration file (several statements, no parameters)."""
        ...


def migrations(dialect: str) -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of the packaged migrations for ``dialect``, in order."""
    found = []
    for entry in (resources.files("app.registry") / "migrations" / dialect).iterdir():
        match = MIGRATION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"{dialect} migrations are not numbered 1..n: {versions}")
    return found


def require_aware(value: datetime, what: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, got {value!r}")
    return value


def require_cohort(cohort: str) -> None:
    if cohort not in COHORTS:
        raise ValueError(f"cohort must be one of {', '.join(COHORTS)}, got {cohort!r}")


def target_key(model: str, env: str, cohort: str) -> str:
    return f"{model}/{env}/{cohort}"


class RecordReader(ABC):
    """Rows -> records, with the backend's conversions of what comes back from the driver."""

    @abstractmethod
    def _ts_value(self, raw: Any) -> datetime: ...

    @abstractmethod
    def _json_value(self, raw: Any) -> Any: ...

    def _optional_ts(self, raw: Any) -> datetime | None:
        return None if raw is None else self._ts_value(raw)

    def _artifact(self, row: Row) -> ArtifactRecord:
        return ArtifactRecord(
            model=row["model"],
            artifact_id=row["artifact_id"],
            manifest_uri=row["manifest_uri"],
            manifest_sha256=row["manifest_sha256"],
            state=row["state"],
            feature_schema=row["feature_schema"],
            runtime=row["runtime"],
            metadata=self._json_value(row["metadata"]),
            created_at=self._ts_value(row["created_at"]),
            updated_at=self._ts_value(row["updated_at"]),
            state_actor=row["state_actor"],
            state_reason=row["state_reason"],
            kind=row["kind"],
            backbone_artifact_id=row["backbone_artifact_id"],
            backbone_manifest_sha256=row["backbone_manifest_sha256"],
        )

    def _target(self, row: Row) -> TargetRecord:
        return TargetRecord(
            model=row["model"],
            environment=row["environment"],
            cohort=row["cohort"],
            revision=int(row["revision"]),
            artifact_id=row["artifact_id"],
            manifest_uri=row["manifest_uri"],
            manifest_sha256=row["manifest_sha256"],
            feature_schema=row["feature_schema"],
            updated_at=self._ts_value(row["updated_at"]),
        )

    def _audit(self, row: Row) -> AuditEntry:
        return AuditEntry(
            id=int(row["id"]),
            model=row["model"],
            environment=row["environment"],
            cohort=row["cohort"],
            old_artifact_id=row["old_artifact_id"],
            new_artifact_id=row["new_artifact_id"],
            old_revision=int(row["old_revision"]),
            new_revision=int(row["new_revision"]),
            actor=row["actor"],
            reason=row["reason"],
            approval=row["approval"],
            at=self._ts_value(row["at"]),
        )

    def _rollout(self, row: Row) -> RolloutRecord:
        return RolloutRecord(
            id=row["id"],
            model=row["model"],
            environment=row["environment"],
            candidate_artifact_id=row["candidate_artifact_id"],
            baseline_artifact_id=row["baseline_artifact_id"],
            plan=self._json_value(row["plan"]),
            phase=row["phase"],
            step=int(row["step"]),
            weights=self._json_value(row["weights"]),
            verdicts=self._json_value(row["verdicts"]),
            state=self._json_value(row["state"]),
            reason=row["reason"],
            version=int(row["version"]),
            created_at=self._ts_value(row["created_at"]),
            updated_at=self._ts_value(row["updated_at"]),
            finished_at=self._optional_ts(row["finished_at"]),
        )

    def _replica(self, row: Row) -> ReplicaReportRecord:
        def opt_int(value: Any) -> int | None:
            return None if value is None else int(value)

        return ReplicaReportRecord(
            replica_id=row["replica_id"],
            model=row["model"],
            environment=row["environment"],
            cohort=row["cohort"],
            state=row["state"],
            heartbeat_at=self._ts_value(row["heartbeat_at"]),
            desired_revision=opt_int(row["desired_revision"]),
            desired_artifact_id=row["desired_artifact_id"],
            actual_revision=opt_int(row["actual_revision"]),
            actual_artifact_id=row["actual_artifact_id"],
            last_error=row["last_error"],
            capacity=self._json_value(row["capacity"]),
            timings=self._json_value(row["timings"]),
        )
