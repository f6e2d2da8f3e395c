"""The embedded registry backend: one SQLite file, stdlib ``sqlite3``.

- One connection per thread (sqlite3 connections must not be shared across threads without
  a lock); all of them are closed by :meth:`SqliteRegistry.close`.
- WAL journal (readers never block the writer), a busy timeout so that writers queue instead
  of failing, foreign keys on.
- Every write transaction starts with ``BEGIN IMMEDIATE``: it takes the write lock up front.
  A deferred transaction that reads and then writes fails at once with "database is locked"
  when another writer committed in between; IMMEDIATE makes publishers queue instead. Reads
  use a deferred ``BEGIN`` (a consistent WAL snapshot).
- Timestamps are UTC ISO-8601 text of fixed width; JSON is text.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from app.errors import (
    InvalidState,
    NotFound,
    RegistryError,
    RegistryUnavailable,
    RevisionConflict,
)
from app.registry._rows import Clock, Row, Tx
from app.registry._sql import SqlRegistry
from app.registry.base import RegistryAccess, utc_now
from app.safe_text import terminal_safe

_TS_FORMAT: Final = "%Y-%m-%dT%H:%M:%S.%fZ"
DEFAULT_BUSY_TIMEOUT_S: Final = 30.0


@contextmanager
def _map_db_errors() -> Iterator[None]:
    """Translate sqlite3 errors into the registry's typed errors (most specific first)."""
    try:
        yield
    except sqlite3.IntegrityError as exc:
        name = getattr(exc, "sqlite_errorname", "")
        if name == "SQLITE_CONSTRAINT_FOREIGNKEY":
            raise NotFound(f"a referenced record does not exist ({exc})") from exc
        if name in ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY"):
            raise RevisionConflict(f"a concurrent writer created the same record ({exc})") from exc
        raise InvalidState(f"the registry refused the values: {exc}") from exc
    except sqlite3.OperationalError as exc:
        name = getattr(exc, "sqlite_errorname", "")
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            raise RegistryUnavailable(
                f"the registry database stayed locked by another writer: {exc}"
            ) from exc
        raise RegistryError(f"registry database error: {exc}") from exc
    except sqlite3.Error as exc:
        raise RegistryError(f"registry database error: {exc}") from exc


def split_statements(script: str) -> Iterator[str]:
    """Complete statements of a SQL script, in order (sqlite3 executes one at a time;
    ``executescript`` would commit the open transaction first)."""
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    leftover = [ln for ln in buffer.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    if leftover:
        raise ValueError(f"incomplete SQL statement at the end of a script: {buffer.strip()!r}")


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row = self._conn.execute(sql, tuple(params)).fetchone()
        return None if row is None else dict(row)

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return [dict(r) for r in self._conn.execute(sql, tuple(params)).fetchall()]

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, tuple(params)).rowcount

    def script(self, sql: str) -> None:
        for statement in split_statements(sql):
            self._conn.execute(statement)


class SqliteRegistry(SqlRegistry):
    dialect = "sqlite"

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Clock = utc_now,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        access: RegistryAccess = "create",
    ) -> None:
        super().__init__(clock=clock)
        self.path = Path(path)
        self._busy_timeout_s = busy_timeout_s
        self._access = access
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._closed = False
        if access == "create":
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RegistryError(f"cannot create the directory of {self.path}: {exc}") from exc
        elif not self.path.is_file():
            # A mistyped path must not become a new, empty registry.
            raise NotFound(
                f"no registry database at {terminal_safe(str(self.path))}; "
                "create one with `rollout registry init`"
            )
        try:
            self._open_schema(access)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"SqliteRegistry({str(self.path)!r})"

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise RegistryError(f"{self!r} is closed")
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # Only ``create`` may make the file: the others open it "rw" or "ro", which
            # fails on a missing file instead of creating it.
            mode = {"create": "rwc", "read": "ro"}.get(self._access, "rw")
            with _map_db_errors():
                conn = sqlite3.connect(
                    f"{self.path.absolute().as_uri()}?mode={mode}",
                    uri=True,
                    timeout=self._busy_timeout_s,
                    isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                    check_same_thread=False,  # only so that close() may close it
                )
                conn.row_factory = sqlite3.Row
                conn.execute("PRAGMA foreign_keys = ON")
                if self._access != "read":
                    self._enable_wal(conn)  # a file write; a reader finds it done
                    conn.execute("PRAGMA synchronous = NORMAL")
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _enable_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL (a persistent setting; a no-op once done).

        While another connection is switching a fresh file, the pragma fails with
        SQLITE_BUSY at once, without consulting the busy timeout: retry it within that
        timeout with a short backoff."""
        deadline = time.monotonic() + self._busy_timeout_s
        delay = 0.002
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL").fetchone()
                return
            except sqlite3.OperationalError as exc:
                busy = getattr(exc, "sqlite_errorname", "").startswith("SQLITE_BUSY")
                if not busy or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[Tx]:
        conn = self._connection()
        with _map_db_errors():
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield _SqliteTx(conn)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _has_schema_table(self, tx: Tx) -> bool:
        return (
            tx.one("SELECT 1 AS found FROM sqlite_master WHERE name = 'schema_version'") is not None
        )

    def _lock_migrations(self, tx: Tx) -> None:
        """Nothing to add: the migration runs in a BEGIN IMMEDIATE transaction, which already
        excludes every other writer, in this process or another."""

    def _schema_version_ddl(self) -> str:
        return (
            "CREATE TABLE IF NOT EXISTS schema_version ("
            "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL);"
        )

    def _ts_param(self, value: datetime) -> str:
        if value.tzinfo is None:
            raise ValueError(f"timestamps must be timezone-aware, got {value!r}")
        return value.astimezone(UTC).strftime(_TS_FORMAT)

    def _ts_value(self, raw: Any) -> datetime:
        return datetime.strptime(raw, _TS_FORMAT).replace(tzinfo=UTC)

    def _json_param(self, value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    def _json_value(self, raw: Any) -> Any:
        return json.loads(raw)

    def close(self) -> None:
        self._closed = True
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()
