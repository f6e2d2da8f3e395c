"""What a failed load reports (its category, its message with the target's secrets masked,
cut to a report's bounds) and whether another attempt can cure it. The reconciler
(app.reconciler) retries what ``is_retryable`` says and reports ``error_info``."""

from __future__ import annotations

from typing import Final

from app.contracts import MAX_FIELD_PATH, ErrorInfo, Target, clip_text
from app.errors import ArtifactRejected, FetchFailed, RolloutSystemError
from app.safe_text import redact_in, redact_uri

# Rejections that another attempt can cure: bytes that came out short or different (a flaky
# download) and a memory budget that frees up. Everything else about an artifact is final.
RETRYABLE_CATEGORIES: Final = frozenset({"size", "digest", "budget", "missing"})


def error_info(exc: BaseException, target: Target | None) -> ErrorInfo:
    """What a failed load reports: the error's category (else the exception's type) and
    its message, with the target it was about. The message may quote the manifest URI (a
    transport error names the URL it failed on): its secrets are masked before the text is
    cut, so a cut can never leave half a secret behind."""
    category = exc.category if isinstance(exc, RolloutSystemError) else type(exc).__name__
    return clipped_error(
        category,
        safe_message(str(exc), target),
        artifact_id=target.artifact_id if target else None,
        revision=target.revision if target else None,
    )


def safe_message(text: str, target: Target | None) -> str:
    """``text`` with every secret of ``target``'s manifest URI masked."""
    return redact_in(text, target.manifest_uri) if target is not None else text


def describe_target(target: Target) -> str:
    """A target as log lines and messages name it: its manifest URI redacted."""
    return (
        f"revision {target.revision} ({target.artifact_id}, "
        f"{clip_text(redact_uri(target.manifest_uri), 300)})"
    )


def clipped_error(
    category: str,
    message: str,
    *,
    artifact_id: str | None = None,
    revision: int | None = None,
    field: str | None = None,
) -> ErrorInfo:
    """An ErrorInfo whose message and field may come from text of any length (an exception's
    message, a field path a config chose), cut to the report's bounds: a state-dict mismatch
    lists every key, and reporting a failure must not fail itself."""
    return ErrorInfo(
        category=category,
        message=clip_text(message),
        artifact_id=artifact_id,
        revision=revision,
        field=clip_text(field, MAX_FIELD_PATH),
    )


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ArtifactRejected):
        return exc.category in RETRYABLE_CATEGORIES
    return isinstance(exc, FetchFailed | OSError | TimeoutError | ConnectionError)
