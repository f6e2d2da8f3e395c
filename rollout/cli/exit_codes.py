"""The exit codes of every ``rollout`` command, in one table.

Scripts and pipelines key on them: a lost compare-and-set (4) is re-read and decided again, an
unavailable registry, Serve or artifact store (7) is retried, a rejected artifact (3) is not.
docs/operating.md lists the same table; tests run the installed binary against it.
"""

from __future__ import annotations

from typing import Final

from app.errors import (
    ArtifactRejected,
    ClusterUnreachable,
    ConfigError,
    FetchFailed,
    InvalidState,
    NotFound,
    RegistryError,
    RegistryUnavailable,
    RevisionConflict,
    RolloutSystemError,
    ServeUnreachable,
    error_line,
)

__all__ = [
    "EXIT_CONFIG",
    "EXIT_CONFLICT",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_ROLLOUT_ABORTED",
    "EXIT_ROLLOUT_FAILED",
    "EXIT_ROLLOUT_ROLLED_BACK",
    "EXIT_UNAVAILABLE",
    "EXIT_UNEXPECTED",
    "EXIT_USAGE",
    "error_line",  # the one line an error prints, beside the code it exits with
    "exit_code_for",
    "exit_code_for_phase",
]

EXIT_OK: Final = 0
EXIT_UNEXPECTED: Final = 1  # anything else
EXIT_USAGE: Final = 2  # the command line is wrong (click's own code)
EXIT_REJECTED: Final = 3  # the artifact was refused by verification
EXIT_CONFLICT: Final = 4  # a compare-and-set lost: nothing changed, re-read and decide
EXIT_NOT_FOUND: Final = 5  # not found, or not in a state that allows it
EXIT_CONFIG: Final = 6  # a configuration the command cannot use
EXIT_UNAVAILABLE: Final = 7  # the registry, the cluster, Serve or the artifact store is out of
# reach, or did not answer within --timeout: retry
# `rollout status --watch` ends with the outcome of the rollout it watched (CI gates on it):
# 0 succeeded (or no rollout), and one code per unsuccessful end.
EXIT_ROLLOUT_FAILED: Final = 8
EXIT_ROLLOUT_ROLLED_BACK: Final = 9
EXIT_ROLLOUT_ABORTED: Final = 10

_EXIT_FOR_PHASE: Final = {
    "failed": EXIT_ROLLOUT_FAILED,
    "rolled_back": EXIT_ROLLOUT_ROLLED_BACK,
    "aborted": EXIT_ROLLOUT_ABORTED,
}


def exit_code_for(error: RolloutSystemError) -> int:
    if isinstance(error, ArtifactRejected):
        return EXIT_REJECTED
    if isinstance(error, RevisionConflict):
        return EXIT_CONFLICT
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    if isinstance(error, RegistryUnavailable | ServeUnreachable | FetchFailed | ClusterUnreachable):
        return EXIT_UNAVAILABLE
    if isinstance(error, NotFound | InvalidState | RegistryError):
        return EXIT_NOT_FOUND
    return EXIT_UNEXPECTED


def exit_code_for_phase(phase: object) -> int:
    """The exit code of `rollout status --watch` for the phase the rollout ended in (a
    ``RolloutPhase`` or its value; None: no rollout)."""
    value = getattr(phase, "value", phase)
    return _EXIT_FOR_PHASE.get(str(value), EXIT_OK)
