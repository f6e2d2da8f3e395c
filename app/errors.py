"""Typed errors of the domain core.

Every error carries a ``category`` (a short, stable string that scripts and exit codes key
on) and the ids it is about. Foreign errors are translated once, at the boundary that meets
them, with ``raise ... from exc``.

Hierarchy::

    RolloutSystemError                  base of everything the project raises on purpose
    ├── ArtifactRejected                an artifact failed verification, load or dry run
    │                                   (category: manifest_digest, path, limits, missing,
    │                                   extra, size, digest, schema, runtime, signature,
    │                                   load, dry_run, budget)
    ├── FetchFailed                     the artifact store could not be read (connection
    │                                   refused, DNS, timeout, 5xx): nothing was
    │                                   judged about the artifact, retry (category: fetch)
    ├── RegistryError                   the model registry refused an operation
    │   ├── NotFound                    unknown model / artifact / target / rollout
    │   ├── InvalidState                e.g. publishing an artifact that is not ``ready``
    │   ├── DigestMismatch              same artifact id registered with another digest
    │   ├── RevisionConflict            compare-and-set lost; carries the current target
    │   ├── ConsistencyError            same revision observed with a different artifact
    │   ├── RegistryUnavailable         the database cannot be reached or stays locked: retry
    │   └── SchemaVersionError          database schema newer than this code knows
    ├── ServeControlError               Serve's REST API refused or failed a config call
    │   └── ServeUnreachable            the dashboard did not answer, or a 5xx: retry
    └── ConfigError                     invalid configuration or plan (names the field)
"""

from __future__ import annotations

from typing import Any, Final

REJECTION_CATEGORIES: Final = (
    "manifest_digest",
    "path",
    "limits",
    "missing",
    "extra",
    "size",
    "digest",
    "schema",
    "runtime",
    "signature",
    "load",
    "dry_run",
    "budget",
    "backbone",
)


class RolloutSystemError(Exception):
    """Base class; ``category`` names the kind of failure."""

    category: str = "error"

    def __init__(self, message: str, **ids: Any) -> None:
        super().__init__(message)
        self.message = message
        self.ids = ids

    def __str__(self) -> str:
        return self.message


class ArtifactRejected(RolloutSystemError):
    """An artifact is not acceptable; the serving model (if any) is untouched."""

    def __init__(self, category: str, detail: str, *, artifact_id: str | None = None) -> None:
        if category not in REJECTION_CATEGORIES:
            raise ValueError(f"unknown rejection category {category!r}")
        super().__init__(detail, artifact_id=artifact_id)
        self.category = category
        self.detail = detail
        self.artifact_id = artifact_id

    def __str__(self) -> str:
        return f"{self.category}: {self.detail}"


class FetchFailed(RolloutSystemError):
    """The bytes could not be fetched: a transport failure, not a verdict on the artifact.

    Distinct from ``ArtifactRejected`` so that retries, exit codes and alerts can tell "the
    store is down" from "the artifact is bad"."""

    category = "fetch"

    def __init__(self, detail: str, *, uri: str | None = None) -> None:
        super().__init__(detail, uri=uri)
        self.detail = detail

    def __str__(self) -> str:
        return f"fetch: {self.detail}"


class ConfigError(RolloutSystemError):
    category = "config"


class RegistryError(RolloutSystemError):
    category = "registry"


class NotFound(RegistryError):
    category = "registry.not_found"


class InvalidState(RegistryError):
    category = "registry.invalid_state"


class DigestMismatch(RegistryError):
    category = "registry.digest_mismatch"


class RevisionConflict(RegistryError):
    """Compare-and-set lost: ``current`` is the target as it is now (or None if absent)."""

    category = "registry.conflict"

    def __init__(self, message: str, *, current: Any = None, **ids: Any) -> None:
        super().__init__(message, **ids)
        self.current = current


class ConsistencyError(RegistryError):
    category = "registry.consistency"


class RegistryUnavailable(RegistryError):
    """The database cannot be reached (or stays locked): nothing was decided, try again."""

    category = "registry.unavailable"


class SchemaVersionError(RegistryError):
    category = "registry.schema_version"


class ServeControlError(RolloutSystemError):
    """Serve's declarative config (the dashboard's REST API) refused or failed a call."""

    category = "serve.control"


class ServeUnreachable(ServeControlError):
    """The dashboard did not answer, or answered that it cannot now (5xx): try again."""

    category = "serve.unavailable"
