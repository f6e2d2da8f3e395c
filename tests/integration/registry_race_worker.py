"""Entry point of the publisher processes in the multi-process race test (importable by a
``spawn``-ed child, which is why it is not inside the test module)."""

from __future__ import annotations

from typing import Any

from app.errors import RevisionConflict
from app.registry import open_registry


def publish_after_barrier(
    url: str, barrier: Any, artifact_id: str, expected_revision: int, results: Any
) -> None:
    """Open the registry, wait for every publisher, then try one compare-and-set.

    Puts ("won", revision), ("conflict", current revision) or ("error", repr) on ``results``.
    """
    try:
        with open_registry(url) as registry:
            barrier.wait(timeout=60)
            try:
                target = registry.publish(
                    "ranker",
                    "default",
                    "stable",
                    artifact_id,
                    expected_revision,
                    actor=f"proc-{artifact_id}",
                    reason="race",
                )
                results.put(("won", target.revision))
            except RevisionConflict as exc:
                results.put(("conflict", exc.current.revision if exc.current else None))
    except Exception as exc:  # reported to the parent, which fails the test with it
        results.put(("error", repr(exc)))
