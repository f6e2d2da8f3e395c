"""The registry's operations, written once over a small transaction interface.

Both backends run the very same statements, so their behaviour cannot drift. What differs is
supplied by each backend and nowhere else: connections and transactions (SQLite
``BEGIN IMMEDIATE`` on a per-thread connection; PostgreSQL READ COMMITTED from a pool),
placeholders (statements here use ``?``; the PostgreSQL transaction rewrites them), how
timestamps and JSON travel, row locks (``FOR SHARE``/``FOR UPDATE`` exist only in
PostgreSQL; SQLite's write transaction already holds the database lock), the migration lock,
and the translation of driver errors.

Timestamps come from the registry's ``clock`` rather than the database's ``now()``: one
source of time for both backends, and tests can pass their own.
"""

from __future__ import annotations

import uuid
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from types import TracebackType
from typing import Any, Self

from app.contracts import TERMINAL_ROLLOUT_PHASES
from app.errors import (
    ArtifactRejected,
    DigestMismatch,
    InvalidState,
    NotFound,
    RevisionConflict,
    SchemaVersionError,
)
from app.manifest import BackboneRef, Manifest, backbone_manifest_uri, is_sha256_hex
from app.registry._rows import (
    ROLLOUT_ID_PREFIX,
    TARGET_SELECT,
    Clock,
    RecordReader,
    Row,
    Tx,
    migrations,
    require_aware,
    require_cohort,
    target_key,
)
from app.registry.base import (
    ArtifactAuditEntry,
    ArtifactRecord,
    ArtifactState,
    AuditEntry,
    RegistryAccess,
    ReplicaReportRecord,
    RolloutRecord,
    TargetRecord,
    check_observed,
    utc_now,
)


class SqlRegistry(RecordReader):
    """Registry operations over :class:`Tx`; subclasses provide the dialect."""

    dialect: str
    # Appended to a SELECT of an artifact row that a write transaction relies on.
    share_lock: str = ""
    update_lock: str = ""

    def __init__(self, *, clock: Clock = utc_now) -> None:
        self._clock = clock
        self._schema_version = 0

    # ---- dialect -------------------------------------------------------------------------

    @abstractmethod
    def _transaction(self, *, write: bool) -> AbstractContextManager[Tx]:
        """A transaction that commits on normal exit, rolls back on an exception and
        translates driver errors (the backend's ``_map_db_errors``). ``write`` transactions
        serialise against each other where the backend needs it."""

    @abstractmethod
    def _lock_migrations(self, tx: Tx) -> None: ...

    @abstractmethod
    def _schema_version_ddl(self) -> str: ...

    @abstractmethod
    def _ts_param(self, value: datetime) -> Any: ...

    @abstractmethod
    def _json_param(self, value: Any) -> Any: ...

    @abstractmethod
    def close(self) -> None: ...

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        return self._schema_version

    @abstractmethod
    def _has_schema_table(self, tx: Tx) -> bool:
        """Whether the database has the ``schema_version`` table (read only)."""

    def _open_schema(self, access: RegistryAccess) -> None:
        """Migrate (``create``, ``migrate``) or only check that the schema is this code's."""
        if access in ("create", "migrate"):
            self._migrate()
        else:
            self._check_schema()

    def _check_schema(self) -> None:
        """Refuse a database whose schema is not the one this code knows; change nothing."""
        known = migrations(self.dialect)
        latest = known[-1][0] if known else 0
        with self._transaction(write=False) as tx:
            current = 0
            if self._has_schema_table(tx):
                row = tx.one("SELECT MAX(version) AS version FROM schema_version")
                current = int(row["version"]) if row and row["version"] is not None else 0
        if current == 0:
            raise SchemaVersionError(
                f"{self!r} holds no registry schema; create it with `rollout registry init`",
                database_version=current,
                known_version=latest,
            )
        if current < latest:
            raise SchemaVersionError(
                f"the registry database has schema version {current}, this code needs "
                f"{latest}; run `rollout registry migrate` first",
                database_version=current,
                known_version=latest,
            )
        if current > latest:
            raise self._too_new(current, latest)
        self._schema_version = current

    @staticmethod
    def _too_new(current: int, latest: int) -> SchemaVersionError:
        return SchemaVersionError(
            f"the registry database has schema version {current}, newer than this code "
            f"knows (up to {latest}); upgrade the code before using this database",
            database_version=current,
            known_version=latest,
        )

    def _migrate(self) -> None:
        """Apply pending migrations under the migration lock; refuse a newer schema."""
        known = migrations(self.dialect)
        latest = known[-1][0] if known else 0
        with self._transaction(write=True) as tx:
            self._lock_migrations(tx)
            tx.script(self._schema_version_ddl())
            row = tx.one("SELECT MAX(version) AS version FROM schema_version")
            current = int(row["version"]) if row and row["version"] is not None else 0
            if current > latest:
                raise self._too_new(current, latest)
            for version, name, sql in known:
                if version > current:
                    tx.script(sql)
                    tx.run(
                        "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
                        (version, name, self._ts_param(self._clock())),
                    )
        self._schema_version = latest

    # ---- artifacts -----------------------------------------------------------------------

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
        if state not in ("pending", "ready"):
            raise ValueError(f"an artifact is registered as pending or ready, not {state!r}")
        digest = manifest_sha256.strip().lower()
        if not is_sha256_hex(digest):
            raise ValueError(f"manifest sha256 must be 64 hex characters, got {manifest_sha256!r}")
        # Imported here: the object-store clients (aiohttp, fsspec) cost every reader of the
        # registry (each `rollout registry ...` call) a fifth of a second otherwise.
        from app.artifact_store import fetch_manifest

        # Outside the transaction: reading the manifest may be a network round trip.
        manifest = fetch_manifest(manifest_uri, digest)
        if accept is not None:
            accept(manifest)  # raises (ArtifactRejected) for what the caller cannot use
        merged = {**manifest.metadata, **(metadata or {})}
        now = self._ts_param(self._clock())
        with self._transaction(write=True) as tx:
            row = tx.one(
                """
                INSERT INTO model_artifact (model, artifact_id, manifest_uri, manifest_sha256,
                    state, feature_schema, runtime, metadata, created_at, updated_at, kind,
                    backbone_artifact_id, backbone_manifest_sha256)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (model, artifact_id) DO NOTHING
                RETURNING *
                """,
                (
                    manifest.model,
                    manifest.artifact_id,
                    manifest_uri,
                    digest,
                    state,
                    manifest.feature_schema,
                    manifest.runtime,
                    self._json_param(merged),
                    now,
                    now,
                    manifest.kind,
                    manifest.backbone.artifact_id if manifest.backbone else None,
                    manifest.backbone.manifest_sha256 if manifest.backbone else None,
                ),
            )
            if row is not None:
                self._audit_artifact(tx, row, "register", None, actor, None, now)
            else:
                row = self._artifact_row(tx, manifest.model, manifest.artifact_id)
                if row["manifest_sha256"] != digest:
                    raise DigestMismatch(
                        f"artifact {manifest.model}/{manifest.artifact_id} is registered with "
                        f"manifest sha256 {row['manifest_sha256']}, not {digest}; artifacts are "
                        "immutable: pack the new content under a new artifact id",
                        model=manifest.model,
                        artifact_id=manifest.artifact_id,
                    )
        return self._artifact(row)

    def _artifact_row(self, tx: Tx, model: str, artifact_id: str, lock: str = "") -> Row:
        row = tx.one(
            f"SELECT * FROM model_artifact WHERE model = ? AND artifact_id = ?{lock}",
            (model, artifact_id),
        )
        if row is None:
            raise NotFound(
                f"artifact {model}/{artifact_id} is not registered",
                model=model,
                artifact_id=artifact_id,
            )
        return row

    def get_artifact(self, model: str, artifact_id: str) -> ArtifactRecord:
        with self._transaction(write=False) as tx:
            return self._artifact(self._artifact_row(tx, model, artifact_id))

    def list_artifacts(self, model: str) -> list[ArtifactRecord]:
        with self._transaction(write=False) as tx:
            rows = tx.all(
                "SELECT * FROM model_artifact WHERE model = ? ORDER BY created_at, artifact_id",
                (model,),
            )
        return [self._artifact(r) for r in rows]

    def _audit_artifact(
        self,
        tx: Tx,
        row: Row,
        action: str,
        old_state: str | None,
        actor: str,
        reason: str | None,
        at: Any,
    ) -> None:
        tx.run(
            """
            INSERT INTO artifact_audit (model, artifact_id, action, old_state, new_state,
                actor, reason, at)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?)
            """,
            (row["model"], row["artifact_id"], action, old_state, row["state"], actor, reason, at),
        )

    def _set_artifact_state(
        self,
        tx: Tx,
        current: Row,
        state: str,
        action: str,
        actor: str,
        reason: str | None,
    ) -> Row:
        now = self._ts_param(self._clock())
        row = tx.one(
            """
            UPDATE model_artifact SET state = ?, state_actor = ?, state_reason = ?, updated_at = ?
            WHERE model = ? AND artifact_id = ?
            RETURNING *
            """,
            (state, actor, reason, now, current["model"], current["artifact_id"]),
        )
        assert row is not None, "the row was locked by this transaction"
        self._audit_artifact(tx, row, action, current["state"], actor, reason, now)
        return row

    def artifact_history(
        self, model: str, *, artifact_id: str | None = None, limit: int = 100
    ) -> list[ArtifactAuditEntry]:
        sql = "SELECT * FROM artifact_audit WHERE model = ?"
        params: list[Any] = [model]
        if artifact_id is not None:
            sql += " AND artifact_id = ?"
            params.append(artifact_id)
        sql += " ORDER BY id DESC LIMIT ?"
        params.append(limit)
        with self._transaction(write=False) as tx:
            rows = tx.all(sql, params)
        return [
            ArtifactAuditEntry(
                id=int(r["id"]),
                model=r["model"],
                artifact_id=r["artifact_id"],
                action=r["action"],
                old_state=r["old_state"],
                new_state=r["new_state"],
                actor=r["actor"],
                reason=r["reason"],
                at=self._ts_value(r["at"]),
            )
            for r in rows
        ]

    def approve_artifact(
        self, model: str, artifact_id: str, *, actor: str, reason: str | None = None
    ) -> ArtifactRecord:
        with self._transaction(write=True) as tx:
            row = self._artifact_row(tx, model, artifact_id, self.update_lock)
            if row["state"] == "rejected":
                raise InvalidState(
                    f"artifact {model}/{artifact_id} was rejected"
                    + (f" ({row['state_reason']})" if row["state_reason"] else "")
                    + "; a rejected artifact is never approved again",
                    model=model,
                    artifact_id=artifact_id,
                )
            if row["state"] != "ready":
                row = self._set_artifact_state(tx, row, "ready", "approve", actor, reason)
        return self._artifact(row)

    def reject_artifact(
        self, model: str, artifact_id: str, *, actor: str, reason: str
    ) -> ArtifactRecord:
        with self._transaction(write=True) as tx:
            row = self._artifact_row(tx, model, artifact_id, self.update_lock)
            if row["state"] != "rejected":
                targeted = tx.all(
                    "SELECT environment, cohort, revision FROM deployment_target "
                    "WHERE model = ? AND artifact_id = ? ORDER BY environment, cohort",
                    (model, artifact_id),
                )
                if targeted:
                    where = ", ".join(
                        f"{t['environment']}/{t['cohort']}@{t['revision']}" for t in targeted
                    )
                    raise InvalidState(
                        f"artifact {model}/{artifact_id} is the current target of {where}; "
                        "publish another artifact there before rejecting it",
                        model=model,
                        artifact_id=artifact_id,
                    )
                heads = tx.all(
                    "SELECT t.environment, t.cohort, t.artifact_id FROM deployment_target t "
                    "JOIN model_artifact a ON a.model = t.model AND a.artifact_id = "
                    "t.artifact_id WHERE t.model = ? AND a.backbone_artifact_id = ? "
                    "ORDER BY t.environment, t.cohort",
                    (model, artifact_id),
                )
                if heads:
                    where = ", ".join(
                        f"{h['environment']}/{h['cohort']} ({h['artifact_id']})" for h in heads
                    )
                    raise InvalidState(
                        f"backbone {model}/{artifact_id} runs the heads targeted by {where}; "
                        "publish other artifacts there before rejecting it",
                        model=model,
                        artifact_id=artifact_id,
                    )
                row = self._set_artifact_state(tx, row, "rejected", "reject", actor, reason)
        return self._artifact(row)

    # ---- targets -------------------------------------------------------------------------

    def _target_in(self, tx: Tx, model: str, env: str, cohort: str) -> TargetRecord | None:
        row = tx.one(
            TARGET_SELECT + " WHERE t.model = ? AND t.environment = ? AND t.cohort = ?",
            (model, env, cohort),
        )
        return None if row is None else self._target(row)

    def get_target(
        self, model: str, env: str, cohort: str, *, observed: TargetRecord | None = None
    ) -> TargetRecord:
        require_cohort(cohort)
        with self._transaction(write=False) as tx:
            target = self._target_in(tx, model, env, cohort)
        if target is None:
            raise NotFound(
                f"{target_key(model, env, cohort)} has no target yet", model=model, cohort=cohort
            )
        check_observed(observed, target)
        return target

    def list_targets(self, model: str, env: str) -> list[TargetRecord]:
        with self._transaction(write=False) as tx:
            rows = tx.all(
                TARGET_SELECT + " WHERE t.model = ? AND t.environment = ?"
                " ORDER BY CASE t.cohort WHEN 'stable' THEN 0 ELSE 1 END",
                (model, env),
            )
        return [self._target(r) for r in rows]

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
        require_cohort(cohort)
        if expected_revision < 0:
            raise ValueError(f"expected_revision must be >= 0, got {expected_revision}")
        if not actor or not reason:
            raise ValueError("a publish needs an actor and a reason (they go to the audit log)")
        key = target_key(model, env, cohort)
        now = self._ts_param(self._clock())

        def conflict(current: TargetRecord | None) -> RevisionConflict:
            now_at = "none" if current is None else str(current.revision)
            return RevisionConflict(
                f"{key}: expected revision {expected_revision}, current revision is {now_at}",
                current=current,
                model=model,
                cohort=cohort,
            )

        with self._transaction(write=True) as tx:
            # FOR SHARE (PostgreSQL): a concurrent reject waits until this publish is done.
            artifact = self._artifact_row(tx, model, artifact_id, self.share_lock)
            if artifact["state"] != "ready":
                raise InvalidState(
                    f"artifact {model}/{artifact_id} is {artifact['state']}, not ready; "
                    "approve it before publishing",
                    model=model,
                    artifact_id=artifact_id,
                )
            self._check_servable(tx, artifact)
            current = self._target_in(tx, model, env, cohort)
            if expected_revision == 0:
                if current is not None:
                    raise conflict(current)
                # A concurrent creator that commits first makes this insert do nothing (on
                # PostgreSQL it waits for that commit): a lost race, never a unique violation.
                row = tx.one(
                    """
                    INSERT INTO deployment_target
                        (model, environment, cohort, revision, artifact_id, updated_at)
                    VALUES (?, ?, ?, 1, ?, ?)
                    ON CONFLICT (model, environment, cohort) DO NOTHING
                    RETURNING revision, updated_at
                    """,
                    (model, env, cohort, artifact_id, now),
                )
                old_artifact = None
            else:
                if current is None or current.revision != expected_revision:
                    raise conflict(current)
                row = tx.one(
                    """
                    UPDATE deployment_target
                    SET artifact_id = ?, revision = revision + 1, updated_at = ?
                    WHERE model = ? AND environment = ? AND cohort = ? AND revision = ?
                    RETURNING revision, updated_at
                    """,
                    (artifact_id, now, model, env, cohort, expected_revision),
                )
                # The row still had expected_revision, so nothing changed it since the read
                # above: that read's artifact is the one replaced.
                old_artifact = current.artifact_id
            if row is None:
                raise conflict(self._target_in(tx, model, env, cohort))
            new_revision = int(row["revision"])
            tx.run(
                """
                INSERT INTO target_audit (model, environment, cohort, old_artifact_id,
                    new_artifact_id, old_revision, new_revision, actor, reason, approval, at)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (
                    model,
                    env,
                    cohort,
                    old_artifact,
                    artifact_id,
                    expected_revision,
                    new_revision,
                    actor,
                    reason,
                    approval,
                    now,
                ),
            )
            return TargetRecord(
                model=model,
                environment=env,
                cohort=cohort,
                revision=new_revision,
                artifact_id=artifact_id,
                manifest_uri=artifact["manifest_uri"],
                manifest_sha256=artifact["manifest_sha256"],
                feature_schema=artifact["feature_schema"],
                updated_at=self._ts_value(row["updated_at"]),
            )

    def _check_servable(self, tx: Tx, artifact: Row) -> None:
        """A backbone is never a target; a head is one only on a ready backbone registered
        with the digest it pins, where replicas look for it (beside the head)."""
        model, aid = artifact["model"], artifact["artifact_id"]
        if artifact["kind"] == "backbone":
            raise InvalidState(
                f"artifact {model}/{aid} is a backbone, never served alone; publish one of "
                "its heads",
                model=model,
                artifact_id=aid,
            )
        if artifact["kind"] != "head":
            return
        ref = BackboneRef(
            artifact_id=artifact["backbone_artifact_id"],
            manifest_sha256=artifact["backbone_manifest_sha256"],
        )
        pinned = f"backbone {model}/{ref.artifact_id}"
        try:
            # FOR SHARE as well: a concurrent reject of the backbone waits for this publish.
            backbone = self._artifact_row(tx, model, ref.artifact_id, self.share_lock)
        except NotFound:
            raise InvalidState(
                f"head {model}/{aid} runs on {pinned}, which is not registered; register and "
                "approve it first",
                model=model,
                artifact_id=aid,
            ) from None
        problem = None
        try:
            beside = backbone_manifest_uri(artifact["manifest_uri"], ref)
        except ArtifactRejected as exc:
            raise InvalidState(
                f"head {model}/{aid}: {exc.detail}", model=model, artifact_id=aid
            ) from None
        if backbone["kind"] != "backbone":
            problem = f"is a {backbone['kind']} artifact, not a backbone"
        elif backbone["manifest_sha256"] != ref.manifest_sha256:
            problem = (
                f"is registered with manifest sha256 {backbone['manifest_sha256']}, the head "
                f"pins {ref.manifest_sha256}"
            )
        elif backbone["state"] != "ready":
            problem = f"is {backbone['state']}, not ready; approve it first"
        elif backbone["manifest_uri"] != beside:
            problem = (
                f"is registered at {backbone['manifest_uri']}; replicas look for it beside the "
                f"head, at {beside}"
            )
        if problem is not None:
            raise InvalidState(
                f"head {model}/{aid} runs on {pinned}, which {problem}",
                model=model,
                artifact_id=aid,
            )

    def history(
        self, model: str, env: str, *, cohort: str | None = None, limit: int = 100
    ) -> list[AuditEntry]:
        sql = "SELECT * FROM target_audit WHERE model = ? AND environment = ?"
        params: list[Any] = [model, env]
        if cohort is not None:
            require_cohort(cohort)
            sql += " AND cohort = ?"
            params.append(cohort)
        sql += " ORDER BY id DESC LIMIT ?"
        params.append(limit)
        with self._transaction(write=False) as tx:
            rows = tx.all(sql, params)
        return [self._audit(r) for r in rows]

    # ---- rollouts ------------------------------------------------------------------------

    def _active_rollout_in(self, tx: Tx, model: str, env: str) -> RolloutRecord | None:
        row = tx.one(
            "SELECT * FROM rollout WHERE model = ? AND environment = ? AND finished_at IS NULL",
            (model, env),
        )
        return None if row is None else self._rollout(row)

    def _rollout_row(self, tx: Tx, rollout_id: str) -> Row:
        row = tx.one("SELECT * FROM rollout WHERE id = ?", (rollout_id,))
        if row is None:
            raise NotFound(f"rollout {rollout_id} does not exist", rollout_id=rollout_id)
        return row

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
        if phase in TERMINAL_ROLLOUT_PHASES:
            raise ValueError(f"a rollout cannot start in the terminal phase {phase!r}")
        rollout_id = rollout_id or f"{ROLLOUT_ID_PREFIX}{uuid.uuid4().hex[:12]}"
        now = self._ts_param(self._clock())

        def already_active(active: RolloutRecord) -> InvalidState:
            return InvalidState(
                f"rollout {active.id} of {model}/{env} is still active (phase {active.phase}); "
                "finish or abort it first",
                model=model,
                rollout_id=active.id,
            )

        with self._transaction(write=True) as tx:
            self._artifact_row(tx, model, candidate_artifact_id)
            if baseline_artifact_id is not None:
                self._artifact_row(tx, model, baseline_artifact_id)
            active = self._active_rollout_in(tx, model, env)
            if active is not None:
                raise already_active(active)
            row = tx.one(
                """
                INSERT INTO rollout (id, model, environment, candidate_artifact_id,
                    baseline_artifact_id, plan, phase, step, weights, verdicts, state, reason,
                    version, created_at, updated_at, finished_at)
                VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, NULL, 1, ?, ?, NULL)
                ON CONFLICT DO NOTHING
                RETURNING *
                """,
                (
                    rollout_id,
                    model,
                    env,
                    candidate_artifact_id,
                    baseline_artifact_id,
                    self._json_param(dict(plan)),
                    phase,
                    self._json_param(dict(weights or {})),
                    self._json_param([]),
                    self._json_param({}),
                    now,
                    now,
                ),
            )
            if row is None:
                # Lost to a concurrent creator (the one-active index) or a reused id.
                active = self._active_rollout_in(tx, model, env)
                if active is not None:
                    raise already_active(active)
                raise InvalidState(f"rollout id {rollout_id} is taken", rollout_id=rollout_id)
        return self._rollout(row)

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
        with self._transaction(write=True) as tx:
            current = self._rollout(self._rollout_row(tx, rollout_id))
            if current.finished_at is not None:
                raise InvalidState(
                    f"rollout {rollout_id} is finished (phase {current.phase}) and cannot change",
                    rollout_id=rollout_id,
                )
            if current.version != expected_version:
                raise RevisionConflict(
                    f"rollout {rollout_id}: expected version {expected_version}, "
                    f"current version is {current.version}",
                    current=current,
                    rollout_id=rollout_id,
                )
            new_phase = current.phase if phase is None else phase
            now = self._clock()
            finished = self._ts_param(now) if new_phase in TERMINAL_ROLLOUT_PHASES else None
            row = tx.one(
                """
                UPDATE rollout
                SET phase = ?, step = ?, weights = ?, verdicts = ?, state = ?, reason = ?,
                    version = version + 1, updated_at = ?, finished_at = ?
                WHERE id = ? AND version = ?
                RETURNING *
                """,
                (
                    new_phase,
                    current.step if step is None else step,
                    self._json_param(current.weights if weights is None else dict(weights)),
                    self._json_param(current.verdicts if verdicts is None else list(verdicts)),
                    self._json_param(current.state if state is None else dict(state)),
                    current.reason if reason is None else reason,
                    self._ts_param(now),
                    finished,
                    rollout_id,
                    expected_version,
                ),
            )
            if row is None:
                latest = self._rollout(self._rollout_row(tx, rollout_id))
                raise RevisionConflict(
                    f"rollout {rollout_id}: expected version {expected_version}, "
                    f"current version is {latest.version}",
                    current=latest,
                    rollout_id=rollout_id,
                )
        return self._rollout(row)

    def get_rollout(self, rollout_id: str) -> RolloutRecord:
        with self._transaction(write=False) as tx:
            return self._rollout(self._rollout_row(tx, rollout_id))

    def get_active_rollout(self, model: str, env: str) -> RolloutRecord | None:
        with self._transaction(write=False) as tx:
            return self._active_rollout_in(tx, model, env)

    def list_rollouts(
        self, model: str | None = None, env: str | None = None, *, limit: int = 50
    ) -> list[RolloutRecord]:
        clauses, params = [], []
        if model is not None:
            clauses.append("model = ?")
            params.append(model)
        if env is not None:
            clauses.append("environment = ?")
            params.append(env)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._transaction(write=False) as tx:
            rows = tx.all(
                f"SELECT * FROM rollout{where} ORDER BY created_at DESC, id DESC LIMIT ?",
                [*params, limit],
            )
        return [self._rollout(r) for r in rows]

    # ---- replica reports -----------------------------------------------------------------

    def upsert_replica_report(self, report: ReplicaReportRecord) -> None:
        require_cohort(report.cohort)
        heartbeat = require_aware(report.heartbeat_at, "heartbeat_at")
        with self._transaction(write=True) as tx:
            tx.run(
                """
                INSERT INTO replica_report (replica_id, model, environment, cohort, state,
                    desired_revision, desired_artifact_id, actual_revision, actual_artifact_id,
                    last_error, heartbeat_at, capacity, timings)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (replica_id) DO UPDATE SET
                    model = excluded.model, environment = excluded.environment,
                    cohort = excluded.cohort, state = excluded.state,
                    desired_revision = excluded.desired_revision,
                    desired_artifact_id = excluded.desired_artifact_id,
                    actual_revision = excluded.actual_revision,
                    actual_artifact_id = excluded.actual_artifact_id,
                    last_error = excluded.last_error, heartbeat_at = excluded.heartbeat_at,
                    capacity = excluded.capacity, timings = excluded.timings
                """,
                (
                    report.replica_id,
                    report.model,
                    report.environment,
                    report.cohort,
                    report.state,
                    report.desired_revision,
                    report.desired_artifact_id,
                    report.actual_revision,
                    report.actual_artifact_id,
                    report.last_error,
                    self._ts_param(heartbeat),
                    self._json_param(dict(report.capacity)),
                    self._json_param(dict(report.timings)),
                ),
            )

    def list_replica_reports(
        self, model: str, env: str, *, cohort: str | None = None
    ) -> list[ReplicaReportRecord]:
        sql = "SELECT * FROM replica_report WHERE model = ? AND environment = ?"
        params: list[Any] = [model, env]
        if cohort is not None:
            require_cohort(cohort)
            sql += " AND cohort = ?"
            params.append(cohort)
        with self._transaction(write=False) as tx:
            rows = tx.all(sql + " ORDER BY replica_id", params)
        return [self._replica(r) for r in rows]
