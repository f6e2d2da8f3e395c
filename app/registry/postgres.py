"""The production registry backend: PostgreSQL through psycopg 3 and a connection pool.

- READ COMMITTED (set on every pooled connection). Under it, a compare-and-set
  ``UPDATE ... WHERE revision = %s`` that races another one waits for the first to commit,
  re-checks its WHERE against the committed row and matches nothing: the loser sees zero
  rows, never a stale success. An ``INSERT ... ON CONFLICT DO NOTHING`` racing an insert of
  the same key likewise waits and then inserts nothing.
- Row locks where a decision rests on a row another transaction could change: publish reads
  the artifact ``FOR SHARE`` (a concurrent reject waits), approve/reject read it
  ``FOR UPDATE``.
- Migrations run under a transaction-scoped advisory lock, so concurrent openers of a fresh
  database apply each migration once.
- TIMESTAMPTZ (read back as UTC) and JSONB.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, Final

import psycopg
from psycopg import IsolationLevel, errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout

from app.errors import (
    ConfigError,
    InvalidState,
    NotFound,
    RegistryError,
    RegistryUnavailable,
    RevisionConflict,
)
from app.registry._rows import Clock, Row, Tx
from app.registry._sql import SqlRegistry
from app.registry.base import RegistryAccess, utc_now
from app.safe_text import redact_in, terminal_safe

# Key of the advisory lock that serialises migrations (any fixed 64-bit number; "rollout").
_MIGRATION_LOCK_KEY: Final = 0x726F6C6C6F7574
DEFAULT_POOL_SIZE: Final = 8
DEFAULT_CONNECT_TIMEOUT_S: Final = 10.0


@contextmanager
def _map_db_errors(url: str) -> Iterator[None]:
    """Translate psycopg errors into the registry's typed errors (most specific first).

    The driver's message may quote the connection string, or part of a malformed password:
    every message is redacted against ``url`` and made safe for a terminal."""

    def said(exc: BaseException | str | None) -> str:
        # One line (libpq's messages span several), secrets masked, controls escaped.
        return terminal_safe(" ".join(redact_in(str(exc), url).split()))

    try:
        yield
    except errors.ForeignKeyViolation as exc:
        raise NotFound(
            f"a referenced record does not exist ({said(exc.diag.message_detail)})"
        ) from None
    except errors.UniqueViolation as exc:
        raise RevisionConflict(
            f"a concurrent writer created the same record ({said(exc.diag.message_detail)})"
        ) from None
    except (errors.CheckViolation, errors.NotNullViolation) as exc:
        raise InvalidState(f"the registry refused the values: {said(exc)}") from None
    except (errors.SerializationFailure, errors.DeadlockDetected) as exc:
        raise RevisionConflict(f"a concurrent transaction won: {said(exc)}") from None
    except PoolTimeout as exc:
        raise RegistryUnavailable(
            f"no registry database connection available: {said(exc)}"
        ) from None
    except psycopg.OperationalError as exc:
        if _BAD_CONNINFO.search(str(exc)):
            # libpq's own verdict on the URL's values (a port that is not a number): no
            # retry makes it valid.
            raise ConfigError(f"registry URL refused by the driver: {said(exc)}") from None
        raise RegistryUnavailable(f"registry database unavailable: {said(exc)}") from None
    except psycopg.ProgrammingError as exc:
        # A connection string the driver cannot parse (e.g. a bad port): nothing reached a
        # server; the message may hold part of the password, hence said().
        raise ConfigError(f"registry URL refused by the driver: {said(exc)}") from None
    except psycopg.Error as exc:
        raise RegistryError(f"registry database error: {said(exc)}") from None


# libpq's messages about values of the connection string itself, not about reaching a server.
_BAD_CONNINFO: Final = re.compile(
    r'for connection option "|invalid port number|invalid connection option|'
    r"invalid sslmode value|invalid URI query parameter"
)


@lru_cache(maxsize=256)
def _placeholders(sql: str) -> str:
    # The shared statements use sqlite's "?"; none of them contains a literal "?" or "%".
    return sql.replace("?", "%s")


class _PostgresTx:
    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self._conn = conn

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        return self._conn.execute(_placeholders(sql), tuple(params)).fetchone()

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._conn.execute(_placeholders(sql), tuple(params)).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(_placeholders(sql), tuple(params)).rowcount

    def script(self, sql: str) -> None:
        # Without parameters, one execute may carry several statements.
        self._conn.execute(sql)


def _configure_writer(conn: psycopg.Connection[Any]) -> None:
    conn.isolation_level = IsolationLevel.READ_COMMITTED


def _configure_reader(conn: psycopg.Connection[Any]) -> None:
    # The server refuses every write of a read-only registry's transactions.
    conn.isolation_level = IsolationLevel.READ_COMMITTED
    conn.read_only = True


class PostgresRegistry(SqlRegistry):
    dialect = "postgres"
    share_lock = " FOR SHARE"
    update_lock = " FOR UPDATE"

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = utc_now,
        pool_size: int = DEFAULT_POOL_SIZE,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        access: RegistryAccess = "create",
    ) -> None:
        super().__init__(clock=clock)
        self._url = url
        self._configure = _configure_reader if access == "read" else _configure_writer
        self._connect_timeout_s = connect_timeout_s
        self._pool: ConnectionPool[psycopg.Connection[Row]] = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            kwargs={"row_factory": dict_row, "autocommit": False},
            configure=self._configure,
            # A pooled connection the server cut (a restart) is found out on checkout and
            # replaced, instead of failing the caller's transaction.
            check=ConnectionPool.check_connection,
            timeout=connect_timeout_s,
            open=False,
            name="registry",
        )
        # Set when a transaction could not reach the server, cleared when the pool lends a
        # connection again. The pool reconnects in the background with its own backoff (1,
        # 2, 4, 8, 16 s: psycopg_pool's, not configurable) and a caller waits for it up to
        # the connect timeout: every call of an outage waited 10 s, and the first ones after
        # it up to one backoff step (about 10 s in the e2e outage scenario). Once one call
        # found the server out of reach, each transaction opens a connection of its own
        # until the pool has one to lend: refused at once while the server is down, made as
        # soon as it is back.
        self._unreachable = False
        try:
            with _map_db_errors(url):
                # One direct connection first: an unreachable server fails at once with the
                # driver's own reason, instead of the pool retrying until its timeout.
                psycopg.connect(url, connect_timeout=max(1, round(connect_timeout_s))).close()
                self._pool.open(wait=True, timeout=connect_timeout_s)
            self._open_schema(access)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        # Never the URL: it may carry a password.
        return f"PostgresRegistry(pool={self._pool.name!r})"

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[Tx]:
        # Both kinds of connection commit when the block ends normally and roll back on an
        # exception.
        with _map_db_errors(self._url), self._connection() as conn:
            yield _PostgresTx(conn)

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Row]]:
        if self._unreachable and not self._pool.get_stats().get("pool_available"):
            with self._direct_connection() as conn:
                yield conn
            # The server answers: have the pool grow again if it has stopped trying (it gives
            # up reconnecting after five minutes; a no-op while it is still at it).
            self._pool.check()
            return
        lent: psycopg.Connection[Row] | None = None
        try:
            with self._pool.connection() as conn:
                lent = conn
                self._unreachable = False
                yield conn
        except PoolTimeout:
            self._unreachable = True
            raise
        except psycopg.OperationalError:
            # Only a lost connection, not a statement the server cancelled.
            if lent is None or lent.broken:
                self._unreachable = True
            raise

    @contextmanager
    def _direct_connection(self) -> Iterator[psycopg.Connection[Row]]:
        conn = psycopg.connect(
            self._url,
            connect_timeout=max(2, round(self._connect_timeout_s)),
            row_factory=dict_row,
            autocommit=False,
        )
        with conn:  # commits or rolls back, then closes
            self._configure(conn)
            yield conn

    def _has_schema_table(self, tx: Tx) -> bool:
        row = tx.one("SELECT to_regclass('schema_version') IS NOT NULL AS found")
        return bool(row and row["found"])

    def _lock_migrations(self, tx: Tx) -> None:
        tx.one("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK_KEY,))

    def _schema_version_ddl(self) -> str:
        return (
            "CREATE TABLE IF NOT EXISTS schema_version ("
            "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL)"
        )

    def _ts_param(self, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError(f"timestamps must be timezone-aware, got {value!r}")
        return value.astimezone(UTC)

    def _ts_value(self, raw: Any) -> datetime:
        value: datetime = raw
        return value.astimezone(UTC)

    def _json_param(self, value: Any) -> Jsonb:
        return Jsonb(value)

    def _json_value(self, raw: Any) -> Any:
        return raw

    def close(self) -> None:
        self._pool.close()
