"""OpenSSF model signatures, met where users meet them: the installed ``rollout`` binary and the
standard ``model_signing`` command line of the ``model-signing`` package, both as subprocesses,
on real artifact directories.

Interop both ways (signed by the standard tool, verified here; signed here, verified by the
standard tool), in key and certificate mode; a file added, removed or changed after signing is
refused by both; keyless trust checks offline against a bundled Sigstore trust root; the
project's ed25519 signatures keep working beside OpenSSF ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from app.demo_artifacts import write_ranker_source
from app.manifest import MANIFEST_NAME, SIGNATURE_NAME, sha256_hex
from app.packing import PackResult, manifest_uri_for, pack_artifact
from app.signing import generate_keypair
from tests.file_artifacts import file_entry, rewrite_manifest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROLLOUT = BIN / "rollout"
MODEL_SIGNING = BIN / "model_signing"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
EXIT_REJECTED = 3


def run(*cmd: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=120, env=ENV
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    generate_keypair(d / "ec.pem", d / "ec.pub", kind="ec-p256")
    generate_keypair(d / "other-ec.pem", d / "other-ec.pub", kind="ec-p256")
    generate_keypair(d / "ed.pem", d / "ed.pub", kind="ed25519")
    return d


def packed(root: Path, name: str, sign_key: Path | None = None, seed: int = 1) -> PackResult:
    src = root / f"src-{name}"
    write_ranker_source(src, seed=seed)
    return pack_artifact(
        src, root / name, model="ranker", artifact_id=name,
        feature_schema="ranker-features-v3", sign_key=sign_key,
    )  # fmt: skip


def rollout_pack(
    src: Path, out: Path, sign_key: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return run(
        ROLLOUT, "pack", src, "--model", "ranker", "--artifact-id", out.name,
        "--feature-schema", "ranker-features-v3", "--out", out, "--sign-key", sign_key, *extra,
    )  # fmt: skip


def standard_sign(art: PackResult, key: Path, *extra: str) -> None:
    done = run(
        MODEL_SIGNING, "sign", "key", "--private_key", key,
        "--signature", art.out_dir / "model.sig", *extra, art.out_dir,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout


def standard_verify(directory: Path, public_key: Path) -> subprocess.CompletedProcess[str]:
    return run(
        MODEL_SIGNING, "verify", "key", "--public_key", public_key,
        "--signature", directory / "model.sig", directory,
    )  # fmt: skip


def rollout_verify(
    tmp: Path, manifest_uri: str, sha256: str, *trust: str | Path
) -> tuple[int, dict[str, Any] | None, str]:
    done = run(
        ROLLOUT, "verify", manifest_uri, "--sha256", sha256,
        "--cache", tmp / "cache", *trust,
    )  # fmt: skip
    payload = json.loads(done.stdout) if done.returncode == 0 else None
    return done.returncode, payload, done.stderr


def entry_of(directory: Path, rel: str) -> dict[str, Any]:
    return file_entry(rel, (directory / rel).read_bytes())


# --------------------------------------------------------------------------- interop


def test_an_artifact_signed_by_the_standard_tool_verifies_here(tmp_path: Path, keys: Path) -> None:
    art = packed(tmp_path, "std-signed")
    standard_sign(art, keys / "ec.pem")
    code, payload, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256, "--trust-key", keys / "ec.pub"
    )
    assert code == 0, err
    assert payload is not None and payload["signature"] == "openssf-key"
    # The cache keeps the signature beside the manifest: a later hit is checked with it.
    assert (Path(payload["cache_path"]) / "model.sig").read_bytes() == (
        art.out_dir / "model.sig"
    ).read_bytes()
    code, payload, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256, "--trust-key", keys / "ec.pub"
    )
    assert code == 0 and payload is not None and payload["cached"] is True, err
    assert payload["signature"] == "openssf-key"


def test_an_artifact_packed_and_signed_here_verifies_with_the_standard_tool(
    tmp_path: Path, keys: Path
) -> None:
    src = tmp_path / "src"
    write_ranker_source(src, seed=4)
    done = rollout_pack(src, tmp_path / "ours", keys / "ec.pem")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ours" / "model.sig").is_file()
    assert not (tmp_path / "ours" / SIGNATURE_NAME).exists()  # an EC key signs the OpenSSF way
    checked = standard_verify(tmp_path / "ours", keys / "ec.pub")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Verification succeeded" in checked.stdout
    other = standard_verify(tmp_path / "ours", keys / "other-ec.pub")
    assert other.returncode != 0
    # And here, with the key that signed it only.
    result = json.loads(done.stdout)
    code, _, err = rollout_verify(
        tmp_path, result["manifest_uri"], result["manifest_sha256"],
        "--trust-key", keys / "other-ec.pub",
    )  # fmt: skip
    assert code == EXIT_REJECTED and err.startswith("rejected: signature: openssf-key"), err


# --------------------------------------------------------------------------- tampering


def _change(d: Path) -> None:
    # One byte, the size kept: only a digest tells the files apart.
    path = d / "normalization.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def _remove(d: Path) -> None:
    (d / "label_mapping.json").unlink()


def _add(d: Path) -> None:
    (d / "extra.bin").write_bytes(b"not signed")


Files = list[dict[str, Any]]
TAMPERING: dict[str, tuple[Callable[[Path], Any], Callable[[Path, Files], Files], str]] = {
    # what is done to the directory; how the re-pinned manifest follows; the refusal here when
    # the manifest is left as it was.
    "changed": (
        _change,
        lambda d, files: [
            entry_of(d, f["path"]) if f["path"] == "normalization.json" else f for f in files
        ],
        "digest",
    ),
    "removed": (
        _remove,
        lambda d, files: [f for f in files if f["path"] != "label_mapping.json"],
        "missing",
    ),
    "added": (_add, lambda d, files: [*files, entry_of(d, "extra.bin")], "extra"),
}


@pytest.fixture(scope="module")
def signed_by_the_standard_tool(tmp_path_factory: pytest.TempPathFactory, keys: Path) -> PackResult:
    """One artifact signed by the standard tool, which verifies it as signed; each tampering
    case below works on a copy of it (the signature names the model as it was signed:
    'signed', whatever the copy's directory)."""
    art = packed(tmp_path_factory.mktemp("signed"), "signed")
    standard_sign(art, keys / "ec.pem")
    assert standard_verify(art.out_dir, keys / "ec.pub").returncode == 0
    return art


def copy_of(art: PackResult, out_dir: Path) -> PackResult:
    shutil.copytree(art.out_dir, out_dir)
    return dataclasses.replace(art, out_dir=out_dir, manifest_uri=manifest_uri_for(out_dir))


@pytest.mark.parametrize("what", sorted(TAMPERING))
@pytest.mark.parametrize("manifest", ["re-pinned", "as signed"])
def test_a_file_changed_removed_or_added_after_signing_is_refused_by_both(
    tmp_path: Path, keys: Path, signed_by_the_standard_tool: PackResult, what: str, manifest: str
) -> None:
    art = copy_of(signed_by_the_standard_tool, tmp_path / f"tampered-{what}")
    tamper, follow, category_as_signed = TAMPERING[what]
    signed_normalization = sha256_hex((art.out_dir / "normalization.json").read_bytes())
    tamper(art.out_dir)
    sha256 = art.manifest_sha256
    if manifest == "re-pinned":
        # The manifest is made to agree with the files and the new digest pinned: only the
        # signature still speaks of the bytes that were signed.
        (art.out_dir / MANIFEST_NAME).chmod(0o644)
        sha256 = rewrite_manifest(
            art, lambda doc: doc.update(files=follow(art.out_dir, doc["files"]))
        )
    standard = standard_verify(art.out_dir, keys / "ec.pub")
    assert standard.returncode != 0, standard.stdout
    assert "Verification failed" in standard.stdout + standard.stderr
    code, _, err = rollout_verify(
        tmp_path, art.manifest_uri, sha256, "--trust-key", keys / "ec.pub"
    )
    assert code == EXIT_REJECTED, err
    expected = "signature" if manifest == "re-pinned" else category_as_signed
    assert err.startswith(f"rejected: {expected}: "), err
    if manifest == "re-pinned":
        assert "Signature mismatch" in err and "openssf-key (key ec.pub)" in err, err
        # The library's reason, readable: which file, and its real digests in hex.
        assert "in model 'signed'" in err or what == "changed", err
        if what == "changed":
            now = sha256_hex((art.out_dir / "normalization.json").read_bytes())
            assert (
                f"Hash mismatch for 'normalization.json': Expected 'sha256:{signed_normalization}',"
                f" Actual 'sha256:{now}'"
            ) in err, err


def test_a_signature_that_leaves_a_manifest_file_out_is_refused_here(
    tmp_path: Path, keys: Path
) -> None:
    """The standard tool lets a signer ignore files; a listed file the signature does not
    cover would be served unvouched for, so it is refused here (the standard tool, which
    ignores it too, accepts the directory)."""
    art = packed(tmp_path, "partial")
    standard_sign(art, keys / "ec.pem", "--ignore-paths", str(art.out_dir / "normalization.json"))
    assert standard_verify(art.out_dir, keys / "ec.pub").returncode == 0
    code, _, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256, "--trust-key", keys / "ec.pub"
    )
    assert code == EXIT_REJECTED and err.startswith("rejected: signature: "), err
    assert "Extra files found in model 'partial': normalization.json" in err, err


# --------------------------------------------------------------------------- certificate mode


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        usage = {"key_cert_sign": True, "crl_sign": True, "digital_signature": False}
    else:
        usage = {"key_cert_sign": False, "crl_sign": False, "digital_signature": True}
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False
        )
    builder = builder.add_extension(
        x509.KeyUsage(
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False, **usage,
        ),
        critical=True,
    )  # fmt: skip
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pem(path: Path, item: x509.Certificate | ec.EllipticCurvePrivateKey) -> Path:
    if isinstance(item, x509.Certificate):
        path.write_bytes(item.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            item.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a code-signing certificate it issued; and a second, unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key, leaf_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    _write_pem(d / "ca.crt", _certificate("Model CA", ca_key, None, ca=True))
    _write_pem(d / "other-ca.crt", _certificate("Other CA", other_key, None, ca=True))
    leaf = _certificate("trainer", leaf_key, ("Model CA", ca_key), ca=False)
    _write_pem(d / "leaf.crt", leaf)
    _write_pem(d / "leaf.key", leaf_key)
    return d


def test_certificate_mode_signatures_verify_against_the_trusted_chain_only(
    tmp_path: Path, pki: Path
) -> None:
    art = packed(tmp_path, "cert-signed")
    done = run(
        MODEL_SIGNING, "sign", "certificate", "--private_key", pki / "leaf.key",
        "--signing_certificate", pki / "leaf.crt", "--certificate_chain", pki / "ca.crt",
        "--signature", art.out_dir / "model.sig", art.out_dir,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    code, payload, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256, "--trust-cert-chain", pki / "ca.crt"
    )
    assert code == 0 and payload is not None, err
    assert payload["signature"] == "openssf-certificate"
    code, _, err = rollout_verify(
        tmp_path / "fresh", art.manifest_uri, art.manifest_sha256,
        "--trust-cert-chain", pki / "other-ca.crt",
    )  # fmt: skip
    assert code == EXIT_REJECTED, err
    assert err.startswith("rejected: signature: openssf-certificate (certificates other-ca.crt)")
    # The signer named on the command line: the leaf's subject passes, another is refused.
    code, payload, err = rollout_verify(
        tmp_path / "named", art.manifest_uri, art.manifest_sha256,
        "--trust-cert-chain", pki / "ca.crt", "--trust-cert-identity", "CN=trainer",
    )  # fmt: skip
    assert code == 0 and payload is not None, err
    code, _, err = rollout_verify(
        tmp_path / "misnamed", art.manifest_uri, art.manifest_sha256,
        "--trust-cert-chain", pki / "ca.crt", "--trust-cert-identity", "CN=someone-else",
    )  # fmt: skip
    assert code == EXIT_REJECTED and err.startswith("rejected: signature: "), err
    assert "CN=someone-else" in err, err
    # An identity with no chain to check it against is a usage error naming the option.
    code, _, err = rollout_verify(
        tmp_path / "chainless", art.manifest_uri, art.manifest_sha256,
        "--trust-cert-identity", "CN=trainer",
    )  # fmt: skip
    assert code == 2 and "--trust-cert-identity" in err, err


# --------------------------------------------------------------------------- keyless


@pytest.fixture(scope="module")
def sigstore_trust_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sigstore's public-good trust root as the sigstore package ships it, as a client trust
    config: keyless signatures are then checked with no network at all."""
    import sigstore

    store = Path(sigstore.__file__).parent / "_store" / "https%3A%2F%2Ftuf-repo-cdn.sigstore.dev"
    config = {
        "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
        "trustedRoot": json.loads((store / "trusted_root.json").read_text()),
        "signingConfig": json.loads((store / "signing_config.v0.2.json").read_text()),
    }
    path = tmp_path_factory.mktemp("sigstore") / "trust-config.json"
    path.write_text(json.dumps(config))
    return path


def test_keyless_trust_refuses_a_signature_without_a_sigstore_certificate_offline(
    tmp_path: Path, keys: Path, sigstore_trust_config: Path
) -> None:
    art = packed(tmp_path, "key-signed")
    standard_sign(art, keys / "ec.pem")
    code, _, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256,
        "--trust-identity", "release@example.com",
        "--trust-issuer", "https://accounts.google.com",
        "--sigstore-trust-config", sigstore_trust_config,
    )  # fmt: skip
    assert code == EXIT_REJECTED, err
    assert err.startswith(
        "rejected: signature: openssf-keyless (identity release@example.com "
        "(https://accounts.google.com)): "
    ), err


def test_keyless_options_that_cannot_be_used_are_named(tmp_path: Path, keys: Path) -> None:
    art = packed(tmp_path, "unused")
    base = ("--trust-identity", "release@example.com")
    code, _, err = rollout_verify(tmp_path, art.manifest_uri, art.manifest_sha256, *base)
    assert code == 2 and "--trust-issuer" in err, err
    code, _, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256, *base,
        "--trust-issuer", "http://insecure.example.com",
    )  # fmt: skip
    assert code == 2 and "--trust-issuer" in err, err
    (tmp_path / "garbage.json").write_text("{not json")
    code, _, err = rollout_verify(
        tmp_path, art.manifest_uri, art.manifest_sha256, *base,
        "--trust-issuer", "https://accounts.google.com",
        "--sigstore-trust-config", tmp_path / "garbage.json",
    )  # fmt: skip
    assert code == 6 and err.startswith("error[config]: --sigstore-trust-config: "), err


# --------------------------------------------------------------------------- modes side by side


def test_project_and_openssf_signatures_are_accepted_side_by_side(
    tmp_path: Path, keys: Path
) -> None:
    """During a move from the project's ed25519 signatures to OpenSSF ones both keys are
    trusted; an artifact signed with neither is refused with both reasons."""
    both = ("--trust-key", keys / "ed.pub", "--trust-key", keys / "ec.pub")
    old = packed(tmp_path, "old", sign_key=keys / "ed.pem")
    new = packed(tmp_path, "new", sign_key=keys / "ec.pem", seed=2)
    stranger = packed(tmp_path, "stranger", sign_key=keys / "other-ec.pem", seed=3)
    for art, mode in ((old, "ed25519"), (new, "openssf-key")):
        code, payload, err = rollout_verify(tmp_path, art.manifest_uri, art.manifest_sha256, *both)
        assert code == 0 and payload is not None and payload["signature"] == mode, err
    code, _, err = rollout_verify(tmp_path, stranger.manifest_uri, stranger.manifest_sha256, *both)
    assert code == EXIT_REJECTED, err
    assert "openssf-key (key ec.pub): Key mismatch" in err, err
    # An ed25519 key alone does not accept an OpenSSF signature, and says what it looked for.
    code, _, err = rollout_verify(
        tmp_path, new.manifest_uri, new.manifest_sha256, "--trust-key", keys / "ed.pub"
    )
    assert code == EXIT_REJECTED, err
    assert "it has model.sig, the trust needs manifest.json.sig" in err, err


def test_an_openssf_signature_over_a_directory_with_a_project_signature_covers_it(
    tmp_path: Path, keys: Path
) -> None:
    """Signing with the standard tool after ``rollout pack --sign-key ed.pem`` covers
    ``manifest.json.sig`` too: accepted while it is unchanged, refused by both once it is."""
    art = packed(tmp_path, "dual", sign_key=keys / "ed.pem")
    standard_sign(art, keys / "ec.pem")
    trust = ("--trust-key", keys / "ec.pub")
    code, payload, err = rollout_verify(tmp_path, art.manifest_uri, art.manifest_sha256, *trust)
    assert code == 0 and payload is not None and payload["signature"] == "openssf-key", err
    # A new ed25519 signature of the same manifest (another key) after OpenSSF signing.
    (art.out_dir / SIGNATURE_NAME).write_bytes(
        _ed25519_signature(art.out_dir / MANIFEST_NAME, tmp_path)
    )
    assert standard_verify(art.out_dir, keys / "ec.pub").returncode != 0
    code, _, err = rollout_verify(tmp_path / "fresh", art.manifest_uri, art.manifest_sha256, *trust)
    assert code == EXIT_REJECTED and "manifest.json.sig" in err, err


def _ed25519_signature(manifest: Path, tmp: Path) -> bytes:
    from app.signing import sign_manifest

    generate_keypair(tmp / "later.pem", tmp / "later.pub", kind="ed25519")
    return sign_manifest(manifest.read_bytes(), tmp / "later.pem")


def test_pack_refuses_a_key_of_a_kind_that_cannot_sign_and_writes_nothing(
    tmp_path: Path,
) -> None:
    key = ec.generate_private_key(ec.SECP256K1())  # a curve OpenSSF signatures do not use
    _write_pem(tmp_path / "k1.pem", key)
    src = tmp_path / "src"
    write_ranker_source(src, seed=1)
    done = rollout_pack(src, tmp_path / "out", tmp_path / "k1.pem")
    assert done.returncode == 6, done.stderr
    assert "secp256k1 key" in done.stderr and "EC P-256" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- registry


def test_registry_register_require_signature_checks_with_the_same_verifier(
    tmp_path: Path, keys: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    assert run(ROLLOUT, "registry", "--db", db, "init").returncode == 0

    def register(art: PackResult, *extra: str | Path, sha256: str | None = None) -> Any:
        return run(
            ROLLOUT, "registry", "--db", db, "--json", "register", art.manifest_uri,
            "--sha256", sha256 or art.manifest_sha256, *extra,
        )  # fmt: skip

    def registered() -> list[str]:
        listed = run(ROLLOUT, "registry", "--db", db, "--json", "artifacts")
        assert listed.returncode == 0, listed.stderr
        return [row["artifact_id"] for row in json.loads(listed.stdout)]

    unsigned = packed(tmp_path, "unsigned")
    signed = packed(tmp_path, "signed", sign_key=keys / "ec.pem", seed=2)
    trust = ("--require-signature", "--trust-key", keys / "ec.pub")

    done = register(signed, "--require-signature")  # no anchor: nothing could be checked
    assert done.returncode == 2 and "needs a trust anchor" in done.stderr, done.stderr
    done = register(unsigned, *trust)
    assert done.returncode == EXIT_REJECTED, done.stderr
    assert done.stderr.startswith("rejected: signature: the artifact is unsigned"), done.stderr
    (signed.out_dir / MANIFEST_NAME).chmod(0o644)
    original = (signed.out_dir / MANIFEST_NAME).read_bytes()
    repinned = rewrite_manifest(signed, lambda doc: doc["metadata"].update(approved=True))
    done = register(signed, *trust, sha256=repinned)
    assert done.returncode == EXIT_REJECTED and "Signature mismatch" in done.stderr, done.stderr
    assert registered() == []

    (signed.out_dir / MANIFEST_NAME).write_bytes(original)
    done = register(signed, *trust)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["artifact_id"] == "signed"
    assert row["metadata"]["registered_signature"] == "openssf-key"
    assert registered() == ["signed"]


# --------------------------------------------------------------------------- packing


def test_pack_leaves_git_metadata_out_so_both_tools_agree_on_the_files(
    tmp_path: Path, keys: Path
) -> None:
    """A model hub snapshot carries ``.gitattributes`` (and a checkout ``.git/``): not part of
    the model, left out of the artifact as the standard tool leaves it out of a signature, so
    what is packed and signed here verifies with the standard tool."""
    src = tmp_path / "snapshot"
    write_ranker_source(src, seed=5)
    (src / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / "docs").mkdir()
    (src / "docs" / ".gitignore").write_text("*.tmp\n")  # not top level: a model file
    art = pack_artifact(
        src, tmp_path / "art", model="ranker", artifact_id="snapshot",
        feature_schema="ranker-features-v3", sign_key=keys / "ec.pem",
    )  # fmt: skip
    listed = [f["path"] for f in json.loads((art.out_dir / MANIFEST_NAME).read_text())["files"]]
    assert ".gitattributes" not in listed and not any(p.startswith(".git/") for p in listed)
    assert "docs/.gitignore" in listed
    assert not (art.out_dir / ".gitattributes").exists()
    checked = standard_verify(art.out_dir, keys / "ec.pub")
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("name", ["manifest.json", "../outside.sig", ".hidden.sig", "a/b.sig"])
def test_pack_refuses_a_signature_file_name_that_is_not_a_plain_unreserved_name(
    tmp_path: Path, keys: Path, name: str
) -> None:
    src = tmp_path / "src"
    write_ranker_source(src, seed=1)
    done = rollout_pack(src, tmp_path / "out", keys / "ec.pem", "--signature-file", name)
    assert done.returncode == 2 and "--signature-file" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "outside.sig").exists()


def test_pack_refuses_a_source_file_named_like_the_signature(tmp_path: Path) -> None:
    from app.errors import ConfigError

    src = tmp_path / "src"
    write_ranker_source(src, seed=1)
    (src / "model.sig").write_bytes(b"a model file that happens to have this name")
    with pytest.raises(ConfigError, match="reserved for an OpenSSF signature"):
        pack_artifact(
            src, tmp_path / "out", model="ranker", artifact_id="x",
            feature_schema="ranker-features-v3",
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_an_anchor_the_library_cannot_set_up_is_a_config_error_naming_its_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keyless trust without a trust config fetches Sigstore's trust root when the policy is
    built; whatever the library raises when that fails (its own error types, not OSError) is
    a ConfigError naming the field, so a replica refuses the config and keeps the old one."""
    from app.contracts import SignatureTrust
    from app.errors import ConfigError
    from app.openssf_signing import OpenSSFVerifier
    from app.trust import TrustPolicy

    class TUFError(Exception):  # stands in for sigstore.errors.TUFError
        pass

    def unreachable(*_args: Any, **_kwargs: Any) -> OpenSSFVerifier:
        raise TUFError("Failed to refresh TUF metadata")

    monkeypatch.setattr(OpenSSFVerifier, "for_identity", unreachable)
    trust = SignatureTrust(
        keyless=[{"identity": "release@example.com", "oidc_issuer": "https://accounts.google.com"}]
    )
    with pytest.raises(ConfigError) as info:
        TrustPolicy(trust, field="user_config.trust")
    assert info.value.ids["field"] == "user_config.trust.keyless[0]"
    assert "TUFError: Failed to refresh TUF metadata" in str(info.value)


KEYLESS_FIXTURE = REPO / "tests" / "data" / "openssf-keyless"
KEYLESS_IDENTITY = ("stefanb@us.ibm.com", "https://sigstore.verify.ibm.com/oauth2")


def test_a_recorded_keyless_signature_verifies_offline_for_its_identity_only(
    sigstore_trust_config: Path,
) -> None:
    """A real keyless bundle (Fulcio certificate, Rekor entry) checked with no network: the
    accept path of keyless trust, then a wrong identity and a changed file refused."""
    from app.errors import ArtifactRejected
    from app.openssf_signing import DirectoryDigests, OpenSSFVerifier

    bundle = (KEYLESS_FIXTURE / "model.sig").read_bytes()
    files = {n: sha256_hex((KEYLESS_FIXTURE / n).read_bytes()) for n in ("signme-1", "signme-2")}
    digests = DirectoryDigests(required=files, optional={}, name="recorded")
    signer = OpenSSFVerifier.for_identity(*KEYLESS_IDENTITY, sigstore_trust_config)
    signer.verify(bundle, digests, "model.sig")

    impostor = OpenSSFVerifier.for_identity(
        "mallory@example.com", KEYLESS_IDENTITY[1], sigstore_trust_config
    )
    with pytest.raises(ArtifactRejected, match=r"SANs do not match mallory@example\.com"):
        impostor.verify(bundle, digests, "model.sig")
    changed = DirectoryDigests(
        required={**files, "signme-2": sha256_hex(b"signme-3")}, optional={}, name="recorded"
    )
    with pytest.raises(ArtifactRejected, match="Hash mismatch for 'signme-2'"):
        signer.verify(bundle, changed, "model.sig")
