"""Read commands never create state: run as the installed binary, a registry read against a
mistyped SQLite path fails in one line and leaves no file behind; a database at an older schema
is not migrated by a read (nor by a write other than `init`/`migrate`), and says what to run."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.registry._rows import migrations
from tests.integration.test_cli_servable import servable_manifest

ROLLOUT = str(Path(sys.executable).with_name("rollout"))

REGISTRY_READS = (("artifacts",), ("targets",), ("history",), ("--json", "history"))
REGISTRY_WRITES = (
    ("approve", "ranker-v41", "--reason", "ok"),
    ("reject", "ranker-v41", "--reason", "no"),
    ("publish", "stable", "ranker-v41", "--expected-revision", "0", "--reason", "r"),
)


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def one_error_line(done: subprocess.CompletedProcess[str], code: int, category: str) -> str:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error[{category}]: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("args", [*REGISTRY_READS, *REGISTRY_WRITES])
def test_a_registry_command_at_a_mistyped_sqlite_path_creates_nothing(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    missing = tmp_path / "typo" / "registyr.db"
    done = rollout("registry", "--db", f"sqlite:///{missing}", *args, cwd=tmp_path)
    line = one_error_line(done, 5, "registry.not_found")
    assert str(missing) in line and "rollout registry init" in line, line
    assert not missing.exists() and not missing.parent.exists()


def test_rollout_history_at_a_mistyped_sqlite_path_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "registyr.db"
    done = rollout("history", "--db", f"sqlite:///{missing}", cwd=tmp_path)
    one_error_line(done, 5, "registry.not_found")
    assert not missing.exists()


def test_register_at_a_mistyped_sqlite_path_creates_nothing(tmp_path: Path) -> None:
    ref = servable_manifest(tmp_path / "art")
    missing = tmp_path / "registyr.db"
    done = rollout(
        "registry", "--db", f"sqlite:///{missing}", "register", ref.manifest_uri,
        "--sha256", ref.manifest_sha256, cwd=tmp_path,
    )  # fmt: skip
    one_error_line(done, 5, "registry.not_found")
    assert not missing.exists()


def old_schema_database(path: Path) -> None:
    """An SQLite registry at schema version 1, as an older release left it."""
    version, name, sql = migrations("sqlite")[0]
    conn = sqlite3.connect(path)
    with conn:
        conn.executescript(sql)
        conn.execute(
            "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
            " applied_at TEXT NOT NULL)"
        )
        conn.execute(
            "INSERT INTO schema_version VALUES (?, ?, ?)",
            (version, name, "2026-01-01T00:00:00.000000Z"),
        )
    conn.close()


def schema_versions(path: Path) -> list[int]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY 1")]
    finally:
        conn.close()


def test_an_old_schema_is_not_migrated_by_reads_or_writes_and_says_to_migrate(
    tmp_path: Path,
) -> None:
    assert len(migrations("sqlite")) >= 2, "needs a schema newer than version 1"
    path = tmp_path / "registry.db"
    old_schema_database(path)
    db = f"sqlite:///{path}"
    for args in (*REGISTRY_READS, *REGISTRY_WRITES):
        line = one_error_line(
            rollout("registry", "--db", db, *args, cwd=tmp_path), 5, "registry.schema_version"
        )
        assert "rollout registry migrate" in line, line
    one_error_line(rollout("history", "--db", db, cwd=tmp_path), 5, "registry.schema_version")
    assert schema_versions(path) == [1]

    migrated = rollout("registry", "--db", db, "migrate", cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    assert schema_versions(path) == [v for v, _, _ in migrations("sqlite")]
    assert rollout("registry", "--db", db, "history", cwd=tmp_path).returncode == 0


def test_migrate_refuses_a_missing_file_and_init_creates_it(tmp_path: Path) -> None:
    path = tmp_path / "new" / "registry.db"
    db = f"sqlite:///{path}"
    migrate = rollout("registry", "--db", db, "migrate", cwd=tmp_path)
    one_error_line(migrate, 5, "registry.not_found")
    assert not path.exists()
    created = rollout("registry", "--db", db, "init", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert path.is_file()
    assert rollout("registry", "--db", db, "artifacts", cwd=tmp_path).returncode == 0
