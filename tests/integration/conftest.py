"""Fixtures of the registry integration suite: one PostgreSQL server per session (started by
the session itself, never skipped), a fresh database or SQLite file per test, and small
manifests written to disk for registration."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.registry import Registry, open_registry
from tests.integration.backends import BACKENDS, Backend
from tests.integration.manifests import MakeManifest, ManifestRef, write_manifest
from tests.postgres import PostgresServer, running_server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with running_server() as server:
        yield server


@pytest.fixture(scope="session")
def migrated_template(postgres_server: PostgresServer) -> str:
    """A PostgreSQL database migrated once, copied (CREATE DATABASE ... TEMPLATE) per test:
    a copy is faster than migrating every test's database."""
    name = "registry_template"
    with open_registry(postgres_server.create_database(name)):
        pass  # opening migrates; closing leaves no session on it, as TEMPLATE requires
    return name


def _backend(
    request: pytest.FixtureRequest, tmp_path: Path, *, migrated: bool
) -> Iterator[Backend]:
    if request.param == "sqlite":
        yield Backend("sqlite", f"sqlite:///{tmp_path / 'registry.db'}")
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    template = request.getfixturevalue("migrated_template") if migrated else None
    name = f"registry_{uuid.uuid4().hex[:12]}"
    url = server.create_database(name, template=template)
    try:
        yield Backend("postgres", url)
    finally:
        server.drop_database(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A registry database per test, on each backend (PostgreSQL: already migrated)."""
    yield from _backend(request, tmp_path, migrated=True)


@pytest.fixture(params=BACKENDS)
def empty_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """An empty database per test, on each backend (for tests of the migrations)."""
    yield from _backend(request, tmp_path, migrated=False)


@pytest.fixture
def registry(backend: Backend) -> Iterator[Registry]:
    with backend.open() as reg:
        yield reg


@pytest.fixture
def make_manifest(tmp_path: Path) -> MakeManifest:
    """``make(artifact_id, *, model=..., metadata=..., weights_digest=...) -> ManifestRef``:
    a fresh manifest.json in its own directory."""
    counter = iter(range(1_000_000))

    def make(artifact_id: str, **kwargs: Any) -> ManifestRef:
        directory = tmp_path / "manifests" / f"{artifact_id}-{next(counter)}"
        return write_manifest(directory, artifact_id, **kwargs)

    return make


@pytest.fixture
def ready_artifacts(registry: Registry, make_manifest: MakeManifest) -> Callable[..., None]:
    """Register artifacts of model "ranker" in state ready."""

    def register(*artifact_ids: str) -> None:
        for artifact_id in artifact_ids:
            ref = make_manifest(artifact_id)
            registry.register_artifact(ref.uri, ref.sha256, state="ready")

    return register
