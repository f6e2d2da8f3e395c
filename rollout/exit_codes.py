"""The exit codes of every ``rollout`` command, in one table.

Scripts and pipelines key on them: a lost compare-and-set (4) is re-read and decided again, an
unavailable registry, Serve or artifact store (7) is retried, a rejected artifact (3) is not.
The README lists the same table; tests run the installed binary against it.
"""

from __future__ import annotations

from typing import Final

from app.errors import (
    ArtifactRejected,
    ConfigError,
    FetchFailed,
    InvalidState,
    NotFound,
    RegistryError,
    RegistryUnavailable,
    RevisionConflict,
    RolloutSystemError,
)
from rollout.serve_control import ServeUnreachable

EXIT_OK: Final = 0
EXIT_UNEXPECTED: Final = 1  # anything else
EXIT_USAGE: Final = 2  # the command line is wrong (click's own code)
EXIT_REJECTED: Final = 3  # the artifact was refused by verification
EXIT_CONFLICT: Final = 4  # a compare-and-set lost: nothing changed, re-read and decide
EXIT_NOT_FOUND: Final = 5  # not found, or not in a state that allows it
EXIT_CONFIG: Final = 6  # a configuration the command cannot use
EXIT_UNAVAILABLE: Final = 7  # the registry, Serve or the artifact store is out of reach: retry


def exit_code_for(error: RolloutSystemError) -> int:
    if isinstance(error, ArtifactRejected):
        return EXIT_REJECTED
    if isinstance(error, RevisionConflict):
        return EXIT_CONFLICT
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    if isinstance(error, RegistryUnavailable | ServeUnreachable | FetchFailed):
        return EXIT_UNAVAILABLE
    if isinstance(error, NotFound | InvalidState | RegistryError):
        return EXIT_NOT_FOUND
    return EXIT_UNEXPECTED


def error_line(category: str, message: str) -> str:
    """What a command prints for an error: one line (a driver's message may span several),
    whatever the command."""
    return f"error[{category}]: {' '.join(message.split())}"
