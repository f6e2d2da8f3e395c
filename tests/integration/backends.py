"""The two registry backends under test, as URLs (and raw SQL access for tampering)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

import psycopg

from app.registry import Registry, open_registry

BACKENDS = ("sqlite", "postgres")


@dataclass(frozen=True)
class Backend:
    """One empty registry database: its URL, and raw SQL access for tampering in tests."""

    name: str
    url: str

    def open(self) -> Registry:
        return open_registry(self.url)

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        """Run one statement with the plain driver (``?`` placeholders), outside the registry."""
        self.query(sql, params, fetch=False)

    def query(
        self, sql: str, params: tuple[Any, ...] = (), *, fetch: bool = True
    ) -> list[tuple[Any, ...]]:
        if self.name == "sqlite":
            conn = sqlite3.connect(self.url.removeprefix("sqlite:///"))
            try:
                with conn:
                    cursor = conn.execute(sql, params)
                    return [tuple(r) for r in cursor.fetchall()] if fetch else []
            finally:
                conn.close()
        with psycopg.connect(self.url, autocommit=True) as pg:
            cur = pg.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return [tuple(r) for r in cur.fetchall()] if fetch else []
