"""Opening a cache sweeps directories under its root, so a cache only ever opens a directory
that is one: new, empty, marked by a cache (``.ray-rollout-cache``), or a cache from before the
marker whose layout is exactly a cache's. Anything else is a ConfigError naming cache_dir, and
nothing in it is touched: ``cache_dir: /`` must not wipe /tmp (Ray's session directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app.cache import CACHE_FORMAT_VERSION, CACHE_MARKER_NAME, ArtifactCache
from app.errors import ConfigError
from app.manifest import COMPLETE_MARKER_NAME
from tests.file_artifacts import make_file_artifact

REPO = Path(__file__).resolve().parents[3]
ROLLOUT = Path(sys.executable).with_name("rollout")


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory or other kind)."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() and not p.is_symlink() else None
        for p in sorted(root.rglob("*"))
    }


def refused(root: Path) -> ConfigError:
    before = tree(root)
    with pytest.raises(ConfigError) as info:
        ArtifactCache(root)
    assert tree(root) == before, "a refused cache_dir must be left exactly as it was"
    assert "cache_dir" in str(info.value) and str(root) in str(info.value)
    assert info.value.ids.get("field") == "cache_dir"
    return info.value


def test_a_directory_that_is_not_a_cache_is_refused_and_nothing_deleted(tmp_path):
    # What `cache_dir: /` looks like: other things, and a tmp/ holding a live session dir.
    root = tmp_path / "not-a-cache"
    (root / "tmp" / "ray" / "session_2026").mkdir(parents=True)
    (root / "tmp" / "ray" / "session_2026" / "ports.json").write_text("{}")
    (root / "tmp" / "notes.txt").write_text("keep me")
    (root / "etc").mkdir()
    err = refused(root)
    assert "not an artifact cache" in str(err)


def test_a_directory_holding_only_tmp_is_not_adopted(tmp_path):
    root = tmp_path / "only-tmp"
    (root / "tmp" / "unlocked-dir").mkdir(parents=True)
    (root / "tmp" / "unlocked-dir" / "data").write_bytes(b"precious")
    refused(root)


def test_a_file_as_cache_dir_is_a_config_error(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    with pytest.raises(ConfigError) as info:
        ArtifactCache(path)
    assert "cache_dir" in str(info.value)
    assert path.read_text() == "x"


def test_a_new_directory_becomes_a_marked_cache(tmp_path):
    root = tmp_path / "deep" / "new-cache"
    ArtifactCache(root)
    marker = json.loads((root / CACHE_MARKER_NAME).read_bytes())
    assert marker["version"] == CACHE_FORMAT_VERSION
    assert sorted(os.listdir(root)) == sorted(
        [CACHE_MARKER_NAME, "artifacts", "tmp", "locks", "leases"]
    )
    ArtifactCache(root)  # and opens again


def test_an_empty_existing_directory_is_adopted(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    ArtifactCache(root)
    assert (root / CACHE_MARKER_NAME).is_file()


def test_a_marked_cache_with_foreign_files_still_opens(tmp_path):
    # Once marked, the directory is the cache's: an operator's stray file does not lock it out.
    root = tmp_path / "cache"
    ArtifactCache(root)
    (root / "README").write_text("node cache")
    reopened = ArtifactCache(root)
    # Opened as the cache it was, the stray file left as it was, and usable.
    assert (root / CACHE_MARKER_NAME).is_file()
    assert (root / "README").read_text() == "node cache"
    assert reopened.swept == []
    art = make_file_artifact(tmp_path, {"w.bin": os.urandom(1000)}, "after-reopen-1")
    assert not reopened.fetch_verified(art.manifest_uri, art.manifest_sha256).cached
    assert ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256).cached


def test_a_cache_from_before_the_marker_is_adopted_with_its_entries(tmp_path):
    art = make_file_artifact(tmp_path, {"w.bin": os.urandom(10_000)}, "old-1")
    root = tmp_path / "old-cache"
    cache = ArtifactCache(root)
    cache.fetch_verified(art.manifest_uri, art.manifest_sha256)
    with cache.lease(art.manifest_sha256):
        pass
    (root / CACHE_MARKER_NAME).unlink()  # what the code before the marker left behind
    crashed = root / "tmp" / f"{art.manifest_sha256[:16]}.abc_1234"
    (crashed / "w.bin").parent.mkdir(parents=True)
    (crashed / "w.bin").write_bytes(b"partial")

    adopted = ArtifactCache(root)
    assert (root / CACHE_MARKER_NAME).is_file()
    assert adopted.swept == [crashed.name]
    assert adopted.fetch_verified(art.manifest_uri, art.manifest_sha256).cached


@pytest.mark.parametrize(
    "intruder",
    ["extra-top-level", "artifacts/not-a-digest", "tmp/someones-dir", "locks/x.txt"],
)
def test_a_layout_that_is_not_exactly_a_cache_is_not_adopted(tmp_path, intruder):
    root = tmp_path / "almost"
    for name in ("artifacts", "tmp", "locks", "leases"):
        (root / name).mkdir(parents=True)
    path = root / intruder
    if intruder.startswith("locks/"):
        path.write_text("x")
    else:
        path.mkdir()
        (path / COMPLETE_MARKER_NAME).write_text("{}")
    refused(root)


def test_a_cache_of_a_newer_format_is_refused(tmp_path):
    root = tmp_path / "future"
    ArtifactCache(root)
    marker = root / CACHE_MARKER_NAME
    marker.write_text(json.dumps({"format": "ray-rollout-cache", "version": 99}))
    err = refused(root)
    assert "99" in str(err)


def test_rollout_verify_refuses_a_cache_dir_that_is_not_a_cache(tmp_path):
    art = make_file_artifact(tmp_path, {"w.bin": b"abc"}, "cli-1")
    root = tmp_path / "home"
    (root / "tmp" / "work").mkdir(parents=True)
    (root / "tmp" / "work" / "draft.txt").write_text("unsaved")
    proc = subprocess.run(
        [str(ROLLOUT), "verify", art.manifest_uri, "--sha256", art.manifest_sha256,
         "--cache", str(root)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 6, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error[config]: cache_dir "), proc.stderr
    assert (root / "tmp" / "work" / "draft.txt").read_text() == "unsaved"
    assert sorted(os.listdir(root)) == ["tmp"]


def test_openers_racing_on_a_new_directory_all_get_the_cache(tmp_path):
    # Replicas of one node start together on a fresh cache_dir: none may see another's
    # half-made cache as "not a cache".
    root = tmp_path / "fresh"
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def open_it() -> None:
        start.wait()
        try:
            ArtifactCache(root)
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(os.listdir(root)) == sorted(
        [CACHE_MARKER_NAME, "artifacts", "tmp", "locks", "leases"]
    )
