"""A throwaway PostgreSQL server for tests and benchmarks.

Started once per test session (tests/integration/conftest.py) or per benchmark run: ``initdb``
into a fresh directory directly under /tmp, a free loopback port, a Unix socket in that same
directory, ``fsync=off``. As root, PostgreSQL refuses to run, so every server binary runs
through ``runuser -u postgres``; pytest's own tmp dirs (mode 0700) are unreachable for that
user, hence the dedicated directory. Missing binaries are an error, never a skip: a registry
suite that silently skips its production backend proves nothing.

The server object also stops and starts again on the same data directory, port and socket
(``stop``/``start``/``is_running``): a test stages a registry outage with it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from rollout.local.cluster import free_port

_SERVER_USER = "postgres"
_START_TIMEOUT_S = 60


class PostgresUnavailable(RuntimeError):
    """PostgreSQL server binaries are not installed, or the server would not start or stop."""


def find_bindir() -> Path:
    """The directory holding initdb/pg_ctl: ``pg_config --bindir``, else the newest
    /usr/lib/postgresql/*/bin. PATH is not consulted: plain Debian does not link them there."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    versioned = glob.glob("/usr/lib/postgresql/*/bin")
    versioned.sort(key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0)
    candidates.extend(Path(p) for p in reversed(versioned))
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    raise PostgresUnavailable(
        "PostgreSQL server binaries not found (looked at `pg_config --bindir` and "
        "/usr/lib/postgresql/*/bin). Install them: "
        "apt-get install -y --no-install-recommends postgresql (scripts/setup.sh does this)."
    )


@dataclass(frozen=True)
class PostgresServer:
    bindir: Path
    root: Path
    port: int
    host: str = "127.0.0.1"
    user: str = _SERVER_USER

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "log"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """CREATE DATABASE ``name`` (a copy of ``template`` if given); returns its URL."""
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(statement)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def start(self) -> None:
        """Start the server on its data directory (initdb'd by :func:`start_server`); waits
        until it accepts connections."""
        # autovacuum off: a worker connected to a template database makes CREATE DATABASE ...
        # TEMPLATE wait for it, and a throwaway server never lives long enough to need it.
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses={self.host} -c fsync=off "
            "-c max_connections=200 -c autovacuum=off"
        )
        self._pg_ctl(
            "start", "-l", str(self.log_file), "-w", "-t", str(_START_TIMEOUT_S), "-o", options
        )

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are cut); its data directory stays,
        for :meth:`start`."""
        self._pg_ctl("stop", "-m", "fast", "-w")

    def is_running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def _pg_ctl(self, action: str, *args: str) -> None:
        done = _as_server_user(self.bindir, "pg_ctl", "-D", str(self.data_dir), *args, action)
        if done.returncode != 0:
            raise PostgresUnavailable(
                f"pg_ctl {action} failed ({done.returncode}): {done.stderr}\n"
                f"server log:\n{self.log_tail()}"
            )


def _as_server_user(bindir: Path, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(bindir / tool), *args]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", _SERVER_USER, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def start_server() -> PostgresServer:
    """initdb + start on a free port. The caller must call :func:`stop_server`."""
    bindir = find_bindir()
    root = Path(tempfile.mkdtemp(prefix="rollout-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(root, _SERVER_USER, _SERVER_USER)
    server = PostgresServer(bindir=bindir, root=root, port=free_port())
    init = _as_server_user(
        bindir, "initdb", "-D", str(server.data_dir), "-U", server.user, "-A", "trust",
        "--no-sync", "-E", "UTF8", "--locale=C",
    )  # fmt: skip
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise PostgresUnavailable(f"initdb failed ({init.returncode}):\n{init.stderr}")
    try:
        server.start()
    except PostgresUnavailable:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return server


def stop_server(server: PostgresServer) -> None:
    """Stop exactly the server this module started (by its data directory; nothing to stop if
    a test stopped it already), then remove it."""
    _as_server_user(server.bindir, "pg_ctl", "-D", str(server.data_dir), "-m", "fast", "-w", "stop")
    shutil.rmtree(server.root, ignore_errors=True)


@contextmanager
def running_server() -> Iterator[PostgresServer]:
    server = start_server()
    try:
        yield server
    finally:
        stop_server(server)
