"""Credentials in a manifest URI (userinfo, presigned query strings) never reach the cache's
error messages or the completion marker it writes to disk."""

from __future__ import annotations

import json

import pytest

from app.cache import ArtifactCache
from app.errors import ArtifactRejected
from app.manifest import COMPLETE_MARKER_NAME, MANIFEST_NAME
from tests.file_artifacts import HeldFileServer, make_file_artifact

SECRET = "s3cr3t-pw"


def with_userinfo(uri: str) -> str:
    scheme, rest = uri.split("://", 1)
    return f"{scheme}://reader:{SECRET}@{rest}"


def test_missing_manifest_error_does_not_show_the_password(tmp_path):
    (tmp_path / "empty").mkdir()
    server = HeldFileServer(tmp_path)
    with server.running():
        uri = with_userinfo(server.uri(f"empty/{MANIFEST_NAME}"))
        with pytest.raises(ArtifactRejected) as info:
            ArtifactCache(tmp_path / "cache").fetch_verified(uri, "a" * 64)
    assert info.value.category == "missing", info.value
    assert SECRET not in str(info.value) and "reader:***@" in str(info.value)


def test_the_completion_marker_records_the_source_without_its_password(tmp_path):
    art = make_file_artifact(tmp_path, {"w.bin": b"payload"}, "cred-1")
    server = HeldFileServer(tmp_path)
    with server.running():
        uri = with_userinfo(server.uri(f"cred-1/{MANIFEST_NAME}"))
        got = ArtifactCache(tmp_path / "cache").fetch_verified(uri, art.manifest_sha256)
    marker = (got.path / COMPLETE_MARKER_NAME).read_text()
    assert SECRET not in marker
    assert json.loads(marker)["source"].startswith("http://reader:***@")
    assert all(SECRET not in p.read_text(errors="replace") for p in got.path.rglob("*.json"))
