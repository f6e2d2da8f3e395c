"""A cache hit that fails to read is not a verdict on the entry: an OSError that says nothing
about the bytes (EIO, EMFILE, ESTALE...) is retried a bounded number of times and never
unpublishes an entry, least of all one another replica holds a lease on; a piece of the entry
missing (ENOENT) or bytes that do not match still set it aside, as before."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import app.cache.artifact_cache
from app.cache import HIT_READ_ATTEMPTS, ArtifactCache
from app.errors import FetchFailed
from app.manifest import MANIFEST_NAME
from app.packing import PackResult
from tests.file_artifacts import make_file_artifact


@pytest.fixture
def artifact(tmp_path: Path) -> PackResult:
    return make_file_artifact(tmp_path, {"weights.bin": os.urandom(50_000)})


def failing_manifest_reads(
    monkeypatch: pytest.MonkeyPatch, times: int, code: int = errno.EIO
) -> list[Path]:
    """Make the next ``times`` reads of a cached manifest fail with ``code``; returns the
    paths of the failed reads."""
    real: Callable[[Path, str, int], bytes] = app.cache.artifact_cache.read_cached_file
    failed: list[Path] = []

    def flaky(path: Path, what: str, limit: int) -> bytes:
        if path.name == MANIFEST_NAME and len(failed) < times:
            failed.append(path)
            raise OSError(code, os.strerror(code), str(path))
        return real(path, what, limit)

    monkeypatch.setattr(app.cache.artifact_cache, "read_cached_file", flaky)
    return failed


def test_a_transient_os_error_during_a_hit_is_retried_and_keeps_a_leased_entry(
    tmp_path: Path, artifact: PackResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    first = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    # Another replica on the node serves this entry.
    other_replica = ArtifactCache(tmp_path / "cache").lease(artifact.manifest_sha256)
    try:
        failed = failing_manifest_reads(monkeypatch, times=1)
        hit = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    finally:
        other_replica.release()
    assert failed, "the injected error was never raised"
    assert hit.cached and hit.path == first.path
    assert (first.path / "weights.bin").is_file()
    assert [p.name for p in cache.tmp_dir.iterdir()] == []  # nothing was set aside


def test_an_os_error_that_persists_fails_the_hit_as_fetch_and_keeps_the_entry(
    tmp_path: Path, artifact: PackResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    first = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    with cache.lease(artifact.manifest_sha256):
        failed = failing_manifest_reads(monkeypatch, times=1000, code=errno.EMFILE)
        with pytest.raises(FetchFailed) as info:
            cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    assert len(failed) == HIT_READ_ATTEMPTS  # bounded
    assert "Too many open files" in str(info.value) and artifact.manifest_sha256[:12] in str(
        info.value
    )
    assert (first.path / "weights.bin").is_file()
    monkeypatch.undo()
    assert cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256).cached


def test_a_missing_piece_of_an_entry_still_sets_it_aside_and_fetches_again(
    tmp_path: Path, artifact: PackResult
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    first = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    (first.path / "weights.bin").unlink()
    again = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    assert not again.cached  # fetched again: the entry had lost a file
    assert again.read_verified("weights.bin") == (artifact.out_dir / "weights.bin").read_bytes()


def test_damage_seen_once_but_not_under_the_digest_lock_keeps_the_entry(
    tmp_path: Path, artifact: PackResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a check made under the digest lock sets an entry aside: checked without it, the
    entry may since have been replaced by a good copy another fetcher published."""
    cache = ArtifactCache(tmp_path / "cache")
    first = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    failed = failing_manifest_reads(monkeypatch, times=1, code=errno.ENOENT)
    again = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    assert failed and again.cached and again.path == first.path


def test_a_failure_to_note_the_last_use_does_not_fail_a_hit(
    tmp_path: Path, artifact: PackResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)

    def read_only_fs(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(app.cache.artifact_cache.os, "utime", read_only_fs)
    assert cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256).cached
