"""The cohorts' targets as the controller reads and moves them in the registry.

Targets only move by compare-and-set (revision + 1, with an audit row). A lost compare-and-set
is re-read: if the target already is what the caller wants, nothing is written; if another
writer moved it elsewhere, the controller does not overwrite it (``TargetConflict``) and leaves
that cohort's target to whoever moved it for the rest of the rollout (``conflicted``).

Every target read is checked against the one last seen for its cohort (``check_observed``): a
revision that went back, or one that changed its artifact, is an inconsistent registry.
"""

from __future__ import annotations

from app.contracts import COHORTS, Cohort
from app.errors import InvalidState, NotFound, RevisionConflict, TargetConflict
from app.registry import Registry, TargetRecord


class TargetBook:
    def __init__(self, registry: Registry, *, model: str, environment: str) -> None:
        self.registry = registry
        self.model = model
        self.environment = environment
        self._observed: dict[str, TargetRecord] = {}
        # Cohorts another writer took over during the current rollout: left as they set them.
        self.conflicted: set[str] = set()

    def current(self, cohort: Cohort) -> TargetRecord | None:
        try:
            target = self.registry.get_target(
                self.model, self.environment, cohort, observed=self._observed.get(cohort)
            )
        except NotFound:
            return None
        self._observed[cohort] = target
        return target

    def list_targets(self) -> list[TargetRecord]:
        return self.registry.list_targets(self.model, self.environment)

    def publish(
        self,
        cohort: Cohort,
        artifact_id: str,
        *,
        actor: str,
        reason: str,
        expected_revision: int | None = None,
    ) -> TargetRecord:
        """Compare-and-set the cohort's target to ``artifact_id`` unless it already is.

        ``expected_revision``: the revision the caller last knew (a rollout's own record);
        None: whatever the registry holds now (an operator's explicit command)."""
        current = self.current(cohort)
        if current is not None and current.artifact_id == artifact_id:
            return current  # a replayed action, or someone already did it: nothing to write
        if expected_revision is None:
            expected_revision = current.revision if current else 0
        try:
            target = self.registry.publish(
                self.model,
                self.environment,
                cohort,
                artifact_id,
                expected_revision,
                actor=actor,
                reason=reason,
            )
        except RevisionConflict as exc:
            now_target = self.current(cohort)
            if now_target is not None and now_target.artifact_id == artifact_id:
                return now_target
            self.conflicted.add(cohort)
            where = (
                f"{now_target.artifact_id} at revision {now_target.revision}"
                if now_target
                else "nothing"
            )
            raise TargetConflict(
                f"registry conflict: another writer moved the {cohort} target to {where} "
                f"while this rollout wanted {artifact_id}; not overwriting it"
            ) from exc
        self._observed[cohort] = target
        return target

    def moved_since(self, known: dict[str, int], ours: dict[str, str | None]) -> list[str]:
        """The cohorts whose target another writer moved since the revisions in ``known``
        (updated here to what the registry holds now), as conflict reasons; ``ours`` is what
        the rollout itself last set per cohort (its own write just before a restart is no
        conflict). A cohort not in ``known`` yet is only recorded."""
        # Both cohorts are read before anything is noted: a read that fails part-way leaves
        # ``known`` as it was, so the next tick finds the same conflict again.
        currents = {cohort: self.current(cohort) for cohort in COHORTS}
        reasons = []
        for cohort, current in currents.items():
            revision = current.revision if current else 0
            last = known.get(cohort)
            known[cohort] = revision
            if last is None or revision == last:
                continue
            if current is not None and current.artifact_id == ours.get(cohort):
                continue
            self.conflicted.add(cohort)
            where = f"{current.artifact_id} at revision {revision}" if current else "nothing"
            reasons.append(
                f"registry conflict: another writer moved the {cohort} target to {where}; "
                "the rollout stops and does not overwrite it"
            )
        return reasons

    def previous_stable(self, current: TargetRecord) -> str:
        """The artifact stable served before ``current``, from the audit log."""
        for entry in self.registry.history(self.model, self.environment, cohort="stable"):
            if entry.new_revision == current.revision and entry.old_artifact_id:
                return entry.old_artifact_id
        raise InvalidState(
            f"stable has no earlier artifact than {current.artifact_id}; name one with --to"
        )
