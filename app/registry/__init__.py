"""The model registry: artifacts, per-cohort targets moved by compare-and-set, rollouts,
replica reports and an audit log, on PostgreSQL (production) or SQLite (embedded).

Open one with :func:`open_registry`; the operations are those of :class:`Registry`.
"""

from app.registry.base import (
    ARTIFACT_STATES,
    ArtifactRecord,
    AuditEntry,
    Registry,
    ReplicaReportRecord,
    RolloutRecord,
    TargetRecord,
    check_observed,
)
from app.registry.factory import DEFAULT_REGISTRY_URL, default_registry_url, open_registry

__all__ = [
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
]
