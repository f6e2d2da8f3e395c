"""What a cohort serves (``Target``, as the registry publishes it) and what a candidate's
manifest records about it for a rollout (``ExpectedDivergence``, the shadow phase's band)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final

from pydantic import Field, StringConstraints

from app.contracts.vocabulary import (
    DEFAULT_FEATURE_SCHEMA,
    Cohort,
    Contract,
    Name,
    Probability,
    Revision,
    Sha256,
    Text,
    Uri,
)
from app.errors import ConfigError


class Target(Contract):
    """What a cohort should serve: everything a replica needs to fetch and verify it.

    ``revision`` grows with every change of the cohort's target (the registry's
    compare-and-set), so it orders targets: replicas ignore a lower one."""

    revision: Revision
    artifact_id: Name
    manifest_uri: Uri
    manifest_sha256: Sha256
    feature_schema: Name = DEFAULT_FEATURE_SCHEMA

    def same_artifact(self, other: Target) -> bool:
        return (
            self.artifact_id == other.artifact_id and self.manifest_sha256 == other.manifest_sha256
        )


class PublishedTarget(Target):
    """A target as the registry holds it for one (model, environment, cohort)."""

    model: Name
    environment: Name
    cohort: Cohort
    updated_at: Annotated[str, StringConstraints(max_length=64)]  # ISO-8601, UTC

    def target(self) -> Target:
        return Target.model_validate(self.model_dump(include=set(Target.model_fields)))


EXPECTED_DIVERGENCE_KEY: Final = "expected_divergence"


class ExpectedDivergence(Contract):
    """How far a candidate's rankings were measured to be from a named baseline's, offline
    (``rollout replay`` over a held-out set; kept in the manifest's
    ``metadata.expected_divergence``). The shadow phase's gate holds the live divergence to
    this band (with the plan's tolerance) when the rollout's baseline is this one, and
    compared with the same ``top_k`` and ``rbo_p``."""

    baseline_artifact_id: Name
    baseline_manifest_sha256: Sha256
    requests: Annotated[int, Field(ge=1, le=1 << 40)]
    top_k: Annotated[int, Field(ge=1, le=2048)]
    rbo_p: Annotated[float, Field(gt=0, lt=1)]
    rbo_mean: Probability
    overlap_mean: Probability
    top1_change_rate: Probability
    max_score_diff_p99: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
    source: Text = ""

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ExpectedDivergence | None:
        """The block of a manifest's metadata, None without one; ConfigError names the
        field."""
        raw = metadata.get(EXPECTED_DIVERGENCE_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"metadata.{EXPECTED_DIVERGENCE_KEY}: a mapping, got {type(raw).__name__}",
                field=f"metadata.{EXPECTED_DIVERGENCE_KEY}",
            )
        return cls.parse(raw, where=f"metadata.{EXPECTED_DIVERGENCE_KEY}")
