"""Opening a registry from a URL."""

from __future__ import annotations

import os
from typing import Final

from app.errors import ConfigError
from app.registry.base import REGISTRY_ACCESS, Registry, RegistryAccess
from app.safe_text import redact_uri, terminal_safe

# The embedded registry the demo and the CLI use when nothing else is configured.
DEFAULT_REGISTRY_URL: Final = "sqlite:///./var/registry.db"
REGISTRY_URL_ENV: Final = "ROLLOUT_DB"

_SQLITE_PREFIX: Final = "sqlite:///"
_POSTGRES_PREFIXES: Final = ("postgresql://", "postgres://")


def default_registry_url() -> str:
    """``$ROLLOUT_DB`` if set, else the embedded SQLite file ./var/registry.db."""
    return os.environ.get(REGISTRY_URL_ENV) or DEFAULT_REGISTRY_URL


def open_registry(url: str, *, access: RegistryAccess = "create") -> Registry:
    """Open the registry at ``url``.

    ``postgresql://user@host:port/db`` (or ``postgres://``): PostgreSQL.
    ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``: an SQLite file.
    In-memory SQLite is refused: the registry is shared between threads and processes.

    ``access``: ``create`` (the controller, ``rollout registry init``) creates an SQLite file
    and its directory if missing and migrates the schema; ``migrate`` migrates an existing
    database; ``write`` and ``read`` (every other command) need an existing database at this
    code's schema (NotFound, SchemaVersionError otherwise) and change no schema; ``read``
    writes nothing at all.
    """
    if access not in REGISTRY_ACCESS:
        raise ValueError(f"access must be one of {REGISTRY_ACCESS}, got {access!r}")
    if url.startswith(_POSTGRES_PREFIXES):
        from app.registry.postgres import PostgresRegistry

        return PostgresRegistry(url, access=access)
    if url.startswith(_SQLITE_PREFIX):
        path = url[len(_SQLITE_PREFIX) :]
        if not path or path == ":memory:" or path.startswith("file:"):
            raise ConfigError(
                f"registry URL {terminal_safe(redact_uri(url))!r}: give an SQLite file path "
                "(sqlite:///path)"
            )
        from app.registry.sqlite import SqliteRegistry

        return SqliteRegistry(path, access=access)
    scheme = url.split(":", 1)[0] if ":" in url else "(none)"
    raise ConfigError(
        f"registry URL scheme {terminal_safe(scheme[:32])!r} is not supported: use "
        "postgresql://... or sqlite:///path"
    )
