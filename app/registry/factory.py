"""Opening a registry from a URL."""

from __future__ import annotations

import os
from typing import Final

from app.errors import ConfigError
from app.registry.base import Registry

# The embedded registry the demo and the CLI use when nothing else is configured.
DEFAULT_REGISTRY_URL: Final = "sqlite:///./var/registry.db"
REGISTRY_URL_ENV: Final = "ROLLOUT_DB"

_SQLITE_PREFIX: Final = "sqlite:///"
_POSTGRES_PREFIXES: Final = ("postgresql://", "postgres://")


def default_registry_url() -> str:
    """``$ROLLOUT_DB`` if set, else the embedded SQLite file ./var/registry.db."""
    return os.environ.get(REGISTRY_URL_ENV) or DEFAULT_REGISTRY_URL


def open_registry(url: str) -> Registry:
    """Open (and migrate) the registry at ``url``.

    ``postgresql://user@host:port/db`` (or ``postgres://``): PostgreSQL.
    ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``: an SQLite file; its
    directory is created if missing. In-memory SQLite is refused: the registry is shared
    between threads and processes.
    """
    if url.startswith(_POSTGRES_PREFIXES):
        from app.registry.postgres import PostgresRegistry

        return PostgresRegistry(url)
    if url.startswith(_SQLITE_PREFIX):
        path = url[len(_SQLITE_PREFIX) :]
        if not path or path == ":memory:" or path.startswith("file:"):
            raise ConfigError(f"registry URL {url!r}: give an SQLite file path (sqlite:///path)")
        from app.registry.sqlite import SqliteRegistry

        return SqliteRegistry(path)
    scheme = url.split(":", 1)[0] if ":" in url else url
    raise ConfigError(
        f"registry URL scheme {scheme!r} is not supported: use postgresql://... or sqlite:///path"
    )
