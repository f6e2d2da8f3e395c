"""A trust key is honoured on cache hits too: an entry that a keyless process (or `rollout
verify` without `--trust-key`) put in the node cache is not served to a process that requires
signatures unless a signature of it verifies with that key: the project's ed25519 signature of
the manifest, or an OpenSSF model signature of the directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cache import ArtifactCache
from app.errors import ArtifactRejected
from app.manifest import SIGNATURE_NAME, parse_manifest
from app.signing import generate_keypair, sign_manifest
from tests.artifacts import good_artifact
from tests.file_artifacts import make_file_artifact

REPO = Path(__file__).resolve().parents[3]
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
    # Kept in the entry: the next hit verifies without the source's copy.
    (art.out_dir / SIGNATURE_NAME).unlink()
    assert (
        ArtifactCache(root, trust_key=keys / "trust.pem")
        .fetch_verified(art.manifest_uri, art.manifest_sha256)
        .cached
    )


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


# --------------------------------------------------------------------------- OpenSSF signatures


@pytest.fixture
def ec_keys(tmp_path: Path) -> Path:
    generate_keypair(tmp_path / "ec.pem", tmp_path / "ec.pub", kind="ec-p256")
    generate_keypair(tmp_path / "other-ec.pem", tmp_path / "other-ec.pub", kind="ec-p256")
    return tmp_path


def test_an_openssf_signature_is_checked_on_every_hit(ec_keys, tmp_path):
    art = make_file_artifact(tmp_path, PAYLOAD, "openssf-1", sign_key=ec_keys / "ec.pem")
    root = tmp_path / "cache"
    # A consumer that checks no signature caches it (model.sig is not an unlisted extra file).
    first = ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)
    assert first.signature is None and (first.path / "model.sig").is_file()
    got = ArtifactCache(root, trust_key=ec_keys / "ec.pub").fetch_verified(
        art.manifest_uri, art.manifest_sha256
    )
    assert got.cached and got.signature == "openssf-key"
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(root, trust_key=ec_keys / "other-ec.pub").fetch_verified(
            art.manifest_uri, art.manifest_sha256
        )
    assert info.value.category == "signature" and "Key mismatch" in info.value.detail


def test_a_replaced_openssf_signature_in_the_entry_is_refused_unless_the_source_holds_a_good_one(
    ec_keys, tmp_path
):
    art = make_file_artifact(tmp_path, PAYLOAD, "openssf-2", sign_key=ec_keys / "ec.pem")
    other = make_file_artifact(tmp_path, PAYLOAD, "openssf-3", sign_key=ec_keys / "ec.pem")
    root = tmp_path / "cache"
    entry = ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256).path
    # A valid bundle of the same key, but over another artifact's manifest.
    (entry / "model.sig").chmod(0o644)
    (entry / "model.sig").write_bytes((other.out_dir / "model.sig").read_bytes())
    trusting = ArtifactCache(root, trust_key=ec_keys / "ec.pub")
    # The source still holds the right one: the hit is served, checked with it, and the entry
    # takes it back.
    got = trusting.fetch_verified(art.manifest_uri, art.manifest_sha256)
    assert got.cached and got.signature == "openssf-key"
    assert (entry / "model.sig").read_bytes() == (art.out_dir / "model.sig").read_bytes()
    # Replaced again, and the source has none now: refused, saying why for both.
    (entry / "model.sig").chmod(0o644)
    (entry / "model.sig").write_bytes((other.out_dir / "model.sig").read_bytes())
    (art.out_dir / "model.sig").unlink()
    with pytest.raises(ArtifactRejected) as info:
        trusting.fetch_verified(art.manifest_uri, art.manifest_sha256)
    assert info.value.category == "signature"
    assert info.value.detail.startswith(
        "cached copy: openssf-key (key ec.pub): Signature mismatch"
    ), info.value.detail
    assert "; at the source: the artifact is unsigned (no model.sig)" in info.value.detail


def test_an_openssf_signature_added_at_the_source_later_is_accepted_without_refetching(
    ec_keys, tmp_path
):
    from app.openssf_signing import sign_directory
    from app.trust import directory_digests

    art = make_file_artifact(tmp_path, PAYLOAD, "openssf-late")
    root = tmp_path / "cache"
    ArtifactCache(root).fetch_verified(art.manifest_uri, art.manifest_sha256)
    manifest_bytes = (art.out_dir / "manifest.json").read_bytes()
    manifest = parse_manifest(manifest_bytes, art.manifest_sha256)
    digests = directory_digests(manifest_bytes, manifest, project_signature=None)
    sign_directory(art.out_dir, ec_keys / "ec.pem", digests, "model.sig")
    got = ArtifactCache(root, trust_key=ec_keys / "ec.pub").fetch_verified(
        art.manifest_uri, art.manifest_sha256
    )
    assert got.cached and got.signature == "openssf-key"
    # The entry took the source's signature: later hits need the source no more.
    assert (got.path / "model.sig").read_bytes() == (art.out_dir / "model.sig").read_bytes()
    (art.out_dir / "model.sig").unlink()
    again = ArtifactCache(root, trust_key=ec_keys / "ec.pub").fetch_verified(
        art.manifest_uri, art.manifest_sha256
    )
    assert again.cached and again.signature == "openssf-key"


def test_a_listed_file_named_like_the_signature_is_a_model_file_not_a_signature(ec_keys, tmp_path):
    # Packed with another signature name, so "model.sig" could be a file of the model.
    files = {**PAYLOAD, "model.sig": b"just data"}
    art = make_file_artifact(tmp_path, files, "named-like-sig", signature_file="bundle.sig")
    got = ArtifactCache(tmp_path / "cache").fetch_verified(art.manifest_uri, art.manifest_sha256)
    assert got.read_verified("model.sig") == b"just data"
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "trusting", trust_key=ec_keys / "ec.pub").fetch_verified(
            art.manifest_uri, art.manifest_sha256
        )
    assert info.value.category == "signature"
    assert "the manifest lists 'model.sig'" in info.value.detail


def test_a_policy_and_a_trust_key_beside_it_are_refused(ec_keys, tmp_path):
    from app.contracts import SignatureTrust
    from app.trust import TrustPolicy

    policy = TrustPolicy(SignatureTrust(keys=[str(ec_keys / "ec.pub")]))
    with pytest.raises(ValueError, match="trust_key within the policy"):
        ArtifactCache(tmp_path / "c", trust=policy, trust_key=ec_keys / "other-ec.pub")
