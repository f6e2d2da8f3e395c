"""Every exception the project raises on purpose, in one module.

Every ``RolloutSystemError`` carries a ``category`` (a short, stable string that scripts and
exit codes key on) and the ids it is about. Foreign errors are translated once, at the
boundary that meets them, with ``raise ... from exc``. The modules that raise these errors
re-export them, so an old import path (``app.api.RequestInvalid``) keeps working. A few
private exceptions stay in their modules: they never leave them (``_DuplicateKey``,
``_HitUnreadable``, ``_RedirectRefused``).

The tree (base classes of the standard library in parentheses), each with when it is raised::

    RolloutSystemError                the domain refused or failed, on purpose; has a category
    ├── ArtifactRejected              an artifact failed verification, load or dry run
    ├── FetchFailed                   the artifact store could not be read: retry
    ├── ConfigError                   a configuration or plan the code cannot use (names it)
    │   └── PlanDoesNotFit            a step no healthy canary passes within its deadline
    ├── RegistryError                 the model registry refused an operation
    │   ├── NotFound                  no such model, artifact, target or rollout
    │   │   └── ControllerNotRunning  the cluster has no rollout controller
    │   ├── InvalidState              e.g. publishing an artifact that is not ready
    │   ├── DigestMismatch            an artifact id registered again with another digest
    │   ├── RevisionConflict          a compare-and-set lost; carries the current target
    │   ├── ConsistencyError          a revision seen again with a different artifact
    │   ├── RegistryUnavailable       the database is out of reach or stays locked: retry
    │   └── SchemaVersionError        the database's schema is newer than this code
    ├── TargetConflict                another writer moved a target a rollout wanted
    ├── ServeControlError             Serve's REST API refused or failed a config call
    │   └── ServeUnreachable          the dashboard did not answer, or a 5xx: retry
    ├── ClusterUnreachable            no Ray cluster answered, or not within --timeout: retry
    ├── NotReady                      a replica holds no model yet, or is closed (503)
    └── LoadCancelled                 a load's target was superseded or cleared: not a failure
    RequestInvalid (ValueError)       a client's HTTP request is wrong: 422 naming the field
    ├── BodyTooLarge                  a body over MAX_BODY_BYTES: 413
    ├── BodyReadTimeout               a body not read whole within body_timeout_s: 408
    └── BodyReadsFull                 too many bodies, or bytes, read at once: 503
    RankerClientError (Exception)     the ranking client (app.client) gave up
    ├── RankerHTTPError               a non-retryable answer (e.g. 422)
    └── RetriesExhausted              every retry of a retryable failure was spent
    ReplicaNotReady (RuntimeError)    a ranker replica has no verified model installed
    StartupLoadFailed (RuntimeError)  a replica's first load failed (message cut for Serve)
    BackboneFreed (RuntimeError)      a shared backbone's last user let it go: load it again
    InjectedFault (RuntimeError)      a rank call failed on purpose (fault injection, tests)
    MetricsUnavailable (Exception)    no metrics endpoint could be read: window unknown
    WaitTimeout (TimeoutError, AssertionError)  wait_until's condition did not hold in time

``ArtifactRejected`` carries one of ``REJECTION_CATEGORIES`` as its category.
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


class PlanDoesNotFit(ConfigError):
    pass


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


class TargetConflict(RolloutSystemError):
    """Another writer moved a cohort's target while a rollout wanted it elsewhere."""

    category = "registry.conflict"


class ClusterUnreachable(RolloutSystemError):
    """No Ray cluster answered (nothing at the address, or not within the timeout): retry."""

    category = "cluster.unavailable"


class ControllerNotRunning(NotFound):
    """The cluster has no rollout controller; read and operator commands never create one."""

    category = "controller.not_found"


class NotReady(RolloutSystemError):
    """No generation is installed (startup) or the holder is closed; maps to HTTP 503."""

    category = "serving.not_ready"


class LoadCancelled(RolloutSystemError):
    """The load's target is no longer wanted (a newer one, or none): not a failure."""

    category = "cancelled"


# ------------------------------------------------------------------ HTTP answers to clients


class RequestInvalid(ValueError):
    """A client mistake: answered ``status`` (422) naming ``field``."""

    category = "invalid_request"
    status = 422

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail

    def payload(self) -> dict[str, Any]:
        """The JSON body of the answer."""
        return {"error": self.category, "detail": self.detail, **self.extra()}

    def extra(self) -> dict[str, Any]:
        """The answer's fields besides ``error`` and ``detail``."""
        return {"field": self.field}


class BodyTooLarge(RequestInvalid):
    """A body over ``MAX_BODY_BYTES``, declared or read so far: 413, the rest unread."""

    category = "body_too_large"
    status = 413

    def __init__(self, detail: str, limit: int) -> None:
        super().__init__("body", detail)
        self.limit = limit

    def extra(self) -> dict[str, Any]:
        return {**super().extra(), "limit_bytes": self.limit}


class BodyReadTimeout(RequestInvalid):
    """The body did not arrive whole within ``body_timeout_s``: 408, the rest unread."""

    category = "body_timeout"
    status = 408

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            "body", f"the body did not arrive within {timeout_s:g}s (router body_timeout_s)"
        )
        self.timeout_s = timeout_s

    def extra(self) -> dict[str, Any]:
        return {**super().extra(), "limit_s": self.timeout_s}


class BodyReadsFull(RequestInvalid):
    """Too many bodies, or too many of their bytes, are being read: 503, retry shortly."""

    category = "overloaded"
    status = 503

    def __init__(self, detail: str, limit: str) -> None:
        super().__init__("body", detail)
        self.limit = limit

    def extra(self) -> dict[str, Any]:
        return {**super().extra(), "limit": self.limit}


# ------------------------------------------------------------------- the ranking client


class RankerClientError(Exception):
    category = "client"


class RankerHTTPError(RankerClientError):
    """A non-retryable answer (e.g. 422 for a bad request)."""

    category = "client.http"

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class RetriesExhausted(RankerClientError):
    category = "client.retries_exhausted"

    def __init__(self, attempts: int, last: str) -> None:
        super().__init__(f"gave up after {attempts} attempts; last: {last}")
        self.attempts = attempts
        self.last = last


# --------------------------------------------------------------- replicas and their loads


class ReplicaNotReady(RuntimeError):
    """No verified model is installed (an idle pool, or still starting)."""

    category = "serving.not_ready"


class StartupLoadFailed(RuntimeError):
    """The first target failed to load, and its error had to be redacted or cut to be shown
    (Serve shows a failed reconfigure's message in its status); ``category`` is the
    original error's."""

    def __init__(self, category: str, message: str) -> None:
        super().__init__(message)
        self.category = category


class BackboneFreed(RuntimeError):
    """The backbone's last user released it: load it again."""


class InjectedFault(RuntimeError):
    """A rank call failed on purpose (``faults.error_rate``; tests only)."""

    category = "fault_injection"


# ------------------------------------------------------------------------- observation


class MetricsUnavailable(Exception):
    """No endpoint could be read: the window is unknown (inconclusive), not empty."""


class WaitTimeout(TimeoutError, AssertionError):
    """The condition did not hold in time. Both a TimeoutError (for the product's callers) and
    an AssertionError (so a test that waits reads as a failed expectation, not an error)."""


def error_line(category: str, message: str) -> str:
    """What a command prints for an error: one line (a driver's message may span several),
    whatever the command."""
    return f"error[{category}]: {' '.join(message.split())}"
