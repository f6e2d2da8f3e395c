"""A trust key is honoured on cache hits too: an entry that a keyless process (or `rollout
verify` without `--trust-key`) put in the node cache is not served to a process that requires
signatures unless its manifest signature verifies with that key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cache import ArtifactCache
from app.errors import ArtifactRejected
from app.manifest import SIGNATURE_NAME
from app.signing import generate_keypair, sign_manifest
from tests.artifacts import good_artifact
from tests.file_artifacts import make_file_artifact

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = Path(sys.executable).with_name("rollout")
PAYLOAD = {"weights.bin": os.urandom(50_000), "conf/normalization.json": b'{"a": 1}'}


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keypair(tmp_path / "sign.pem", tmp_path / "trust.pem")
    generate_keypair(tmp_path / "other.pem", tmp_path / "other-pub.pem")
    return tmp_path


def rollout_verify(
    uri: str, digest: str, cache_dir: Path, *extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROLLOUT), "verify", uri, "--sha256", digest, "--cache", str(cache_dir), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_unsigned_entry_put_by_a_keyless_cache_is_refused_with_a_trust_key(keys, tmp_path):
    art = make_file_artifact(tmp_path, PAYLOAD, "unsigned-1")
    root = tmp_path / "cache"
    ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)

    trusting = ArtifactCache(root, trust_key=keys / "trust.pem")
    for recheck in ("sizes", "digests"):
        with pytest.raises(ArtifactRejected) as info:
            trusting.fetch_verified(art.manifest_uri, art.manifest_sha256, recheck=recheck)
        assert info.value.category == "signature", info.value
        assert info.value.artifact_id == "unsigned-1"
    # The entry is intact for keyless consumers: refusing it is not evidence of corruption.
    again = ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)
    assert again.cached


def test_entry_signed_by_another_key_is_refused_on_a_hit(keys, tmp_path):
    art = make_file_artifact(tmp_path, PAYLOAD, "other-key-1", sign_key=keys / "other.pem")
    root = tmp_path / "cache"
    ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(root, trust_key=keys / "trust.pem").fetch_verified(
            art.manifest_uri, art.manifest_sha256
        )
    assert info.value.category == "signature"


def test_signed_entry_is_a_hit_for_a_trusting_cache(keys, tmp_path):
    art = make_file_artifact(tmp_path, PAYLOAD, "signed-1", sign_key=keys / "sign.pem")
    root = tmp_path / "cache"
    ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)
    got = ArtifactCache(root, trust_key=keys / "trust.pem").fetch_verified(
        art.manifest_uri, art.manifest_sha256, recheck="digests"
    )
    assert got.cached


def test_a_signature_added_at_the_source_later_is_accepted_without_refetching(keys, tmp_path):
    # Key rotation or late signing: the manifest bytes (pinned by digest) are the same, only
    # the detached signature is new. The entry's stored signature fails, the source's verifies.
    art = make_file_artifact(tmp_path, PAYLOAD, "late-signed-1")
    root = tmp_path / "cache"
    ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)
    manifest_bytes = (art.out_dir / "manifest.json").read_bytes()
    (art.out_dir / SIGNATURE_NAME).write_bytes(sign_manifest(manifest_bytes, keys / "sign.pem"))
    got = ArtifactCache(root, trust_key=keys / "trust.pem").fetch_verified(
        art.manifest_uri, art.manifest_sha256
    )
    assert got.cached


def test_rollout_verify_with_trust_key_refuses_what_a_keyless_verify_cached(keys, tmp_path):
    # A servable artifact: `rollout verify` also refuses what the service could not serve.
    art = good_artifact(tmp_path / "src", artifact_id="unsigned-cli")
    cache_dir = tmp_path / "cache"
    first = rollout_verify(art.manifest_uri, art.manifest_sha256, cache_dir)
    assert first.returncode == 0, first.stderr
    second = rollout_verify(
        art.manifest_uri, art.manifest_sha256, cache_dir, "--trust-key", str(keys / "trust.pem")
    )
    assert second.returncode == 3, (second.stdout, second.stderr)
    assert second.stderr.strip().startswith("rejected: signature: "), second.stderr
    assert "Traceback" not in second.stderr
