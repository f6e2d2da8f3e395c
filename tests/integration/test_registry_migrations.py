"""Schema migrations on both backends: applied once, a no-op on reopen, safe for concurrent
openers, and a database newer than the code is refused."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import SchemaVersionError
from app.registry import open_registry
from app.registry._rows import migrations
from tests.integration.backends import Backend
from tests.integration.manifests import MakeManifest


def _schema_rows(backend: Backend) -> list[tuple[int, str]]:
    return backend.query("SELECT version, name FROM schema_version ORDER BY version")


def test_reopening_a_migrated_database_is_a_no_op(
    empty_backend: Backend, make_manifest: MakeManifest
) -> None:
    backend = empty_backend
    known = migrations(backend.name)
    ref = make_manifest("v1")
    with backend.open() as registry:
        assert registry.schema_version == known[-1][0]
        registry.register_artifact(ref.uri, ref.sha256, state="ready")
        registry.publish("ranker", "default", "stable", "v1", 0, actor="a", reason="r")
    rows = _schema_rows(backend)

    with backend.open() as registry:
        assert registry.schema_version == known[-1][0]
        assert registry.get_target("ranker", "default", "stable").revision == 1
    assert _schema_rows(backend) == rows == [(v, name) for v, name, _ in known]


def test_concurrent_openers_of_a_fresh_database_migrate_it_once(empty_backend: Backend) -> None:
    backend = empty_backend
    openers = 4
    barrier = threading.Barrier(openers)

    def open_and_close(_: int) -> int:
        barrier.wait(timeout=30)
        with open_registry(backend.url) as registry:
            return registry.schema_version

    with ThreadPoolExecutor(openers) as pool:
        versions = list(pool.map(open_and_close, range(openers)))

    known = migrations(backend.name)
    assert versions == [known[-1][0]] * openers
    assert _schema_rows(backend) == [(v, name) for v, name, _ in known]


def test_a_database_newer_than_the_code_is_refused(backend: Backend) -> None:
    with backend.open():
        pass
    backend.execute(
        "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
        (999, "0999_from_the_future.sql", "2030-01-01T00:00:00.000000Z"),
    )

    with pytest.raises(
        SchemaVersionError, match=r"schema version 999, newer than this code"
    ) as info:
        backend.open()

    assert info.value.category == "registry.schema_version"
    assert f"up to {migrations(backend.name)[-1][0]}" in str(info.value)
