"""A FIFO swapped into the cache in place of a file must never hang a reader: opening a FIFO
for reading blocks until a writer comes, forever if none does. Every open of a cached file is
refused (category ``path``) or treated as a corrupt entry, promptly.

Each call runs on a thread with a join timeout: only a guard so that a regression fails the
test instead of hanging the run, never a measure of speed."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cache import ArtifactCache
from app.compatibility import WEIGHTS_FILES
from app.errors import ArtifactRejected
from app.loading.candidate import load_verified
from app.manifest import COMPLETE_MARKER_NAME, MANIFEST_NAME, SIGNATURE_NAME
from app.signing import generate_keypair
from tests.artifacts import good_artifact
from tests.file_artifacts import make_file_artifact

HANG_GUARD_S = 30.0
PAYLOAD = {"weights.bin": os.urandom(100_000), "conf/normalization.json": b'{"a": 1}'}


def swap_for_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def call_guarded(fn: Callable[[], Any], fifo: Path) -> Any:
    """Run ``fn`` on a thread; if it is still blocked after the guard, free it (a writer that
    opens and closes the FIFO) and fail."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(HANG_GUARD_S)
        pytest.fail(f"blocked on the FIFO {fifo.name} for {HANG_GUARD_S} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.fixture
def artifact(tmp_path: Path):
    return make_file_artifact(tmp_path, PAYLOAD)


@pytest.fixture
def cache(tmp_path: Path) -> ArtifactCache:
    return ArtifactCache(tmp_path / "cache")


def test_fifo_in_place_of_a_cached_file_is_refused_on_read(artifact, cache):
    got = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    fifo = swap_for_fifo(got.path / "weights.bin")
    with pytest.raises(ArtifactRejected) as info:
        call_guarded(lambda: got.read_verified("weights.bin"), fifo)
    assert info.value.category == "path", info.value
    assert "weights.bin" in info.value.detail and "a FIFO" in info.value.detail


def test_fifo_in_place_of_the_weights_is_a_path_rejection_of_the_loader(tmp_path):
    result = good_artifact(tmp_path)
    got = ArtifactCache(tmp_path / "cache").fetch_verified(
        result.manifest_uri, result.manifest_sha256
    )
    fifo = swap_for_fifo(got.path / WEIGHTS_FILES["safetensors"])
    with pytest.raises(ArtifactRejected) as info:
        call_guarded(lambda: load_verified(got, device=torch.device("cpu")), fifo)
    assert info.value.category == "path", info.value
    assert info.value.artifact_id == "ranker-test"


def test_symlink_in_place_of_a_cached_file_is_refused_on_read(artifact, cache, tmp_path):
    got = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    elsewhere = tmp_path / "same-bytes.bin"
    elsewhere.write_bytes(PAYLOAD["weights.bin"])
    (got.path / "weights.bin").unlink()
    (got.path / "weights.bin").symlink_to(elsewhere)
    with pytest.raises(ArtifactRejected) as info:
        got.read_verified("weights.bin")
    assert info.value.category == "path" and "symlink" in info.value.detail


@pytest.mark.parametrize("recheck", ["sizes", "digests"])
def test_fifo_in_place_of_the_cached_manifest_sets_the_entry_aside(artifact, cache, recheck):
    got = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    fifo = swap_for_fifo(got.path / MANIFEST_NAME)
    fresh = call_guarded(
        lambda: cache.fetch_verified(
            artifact.manifest_uri, artifact.manifest_sha256, recheck=recheck
        ),
        fifo,
    )
    assert not fresh.cached, "a corrupt entry must be fetched again"
    assert fresh.read_verified("weights.bin") == PAYLOAD["weights.bin"]


def test_fifo_in_place_of_the_stored_signature_sets_the_entry_aside(tmp_path):
    generate_keypair(tmp_path / "sign.pem", tmp_path / "trust.pem")
    art = make_file_artifact(tmp_path, PAYLOAD, "signed", sign_key=tmp_path / "sign.pem")
    cache = ArtifactCache(tmp_path / "cache", trust_key=tmp_path / "trust.pem")
    got = cache.fetch_verified(art.manifest_uri, art.manifest_sha256)
    fifo = swap_for_fifo(got.path / SIGNATURE_NAME)
    fresh = call_guarded(lambda: cache.fetch_verified(art.manifest_uri, art.manifest_sha256), fifo)
    assert not fresh.cached


def test_fifo_in_place_of_a_completion_marker_does_not_hang_the_listing(artifact, cache):
    got = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    fifo = swap_for_fifo(got.path / COMPLETE_MARKER_NAME)
    assert call_guarded(cache.entries, fifo) == []
    fresh = call_guarded(
        lambda: cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256), fifo
    )
    assert not fresh.cached, "an entry without a regular completion marker is fetched again"
    assert [digest for digest, _, _ in cache.entries()] == [artifact.manifest_sha256]


def test_fifo_in_the_temp_dir_does_not_hang_opening_the_cache(tmp_path):
    root = tmp_path / "cache"
    ArtifactCache(root)
    fifo = root / "tmp" / "stray.fifo"
    os.mkfifo(fifo)
    reopened = call_guarded(lambda: ArtifactCache(root), fifo)
    assert reopened.swept == []
    assert fifo.exists(), "the sweep removes only temp directories"
