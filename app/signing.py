"""Signing keys, and the project's own detached ed25519 signatures over the manifest bytes.

Two kinds of key: ed25519 for the project's signature (a manifest lists every file with its
SHA-256, so a signature over the manifest bytes covers the whole artifact; ``cryptography``,
fully offline), and EC P-256/P-384/P-521 for OpenSSF model signatures (app.openssf_signing),
the format the ecosystem's tools check. The kind of a key decides which signature it makes
(``rollout pack --sign-key``) and which it accepts (``trust.keys``).

Keys are PEM files: PKCS#8 private keys, SubjectPublicKeyInfo public keys. The project's
signature file (`manifest.json.sig`) holds the base64 of the 64-byte raw signature and a newline.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Final, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from app.errors import ArtifactRejected, ConfigError
from app.safe_files import UnsafeFile, read_regular

# O_EXCL: never through an existing file; O_NOFOLLOW (and O_EXCL, which refuses any symlink):
# never through a symlink planted where the key is to be created.
_NEW_KEY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
PRIVATE_KEY_MODE = 0o600
PUBLIC_KEY_MODE = 0o644
# A PEM ed25519 key is ~120 bytes; anything near this is not a key (``/dev/zero``, a dataset).
MAX_KEY_FILE_BYTES = 64 * 1024
KeyKind = Literal["ed25519", "ec-p256"]
KEY_KINDS: Final[tuple[KeyKind, ...]] = ("ec-p256", "ed25519")
# Curves OpenSSF key and certificate modes sign with (Sigstore's protobuf specs).
OPENSSF_CURVES: Final = frozenset({"secp256r1", "secp384r1", "secp521r1"})
SigningKey = Ed25519PrivateKey | ec.EllipticCurvePrivateKey
TrustedKey = Ed25519PublicKey | ec.EllipticCurvePublicKey


def read_key_file(path: Path, what: str, limit: int = MAX_KEY_FILE_BYTES) -> bytes:
    """The bytes of a key file (or of a CA chain, a trust config: ``limit``): a regular file
    (symlinks followed, as mounted secrets are), of bounded size, opened without blocking so a
    FIFO or device named by mistake (in a user_config's ``trust_key`` too) is refused instead
    of hanging or filling memory (app.safe_files)."""
    try:
        data = read_regular(path, what, limit, follow_symlinks=True)
    except UnsafeFile:
        raise ConfigError(f"{what} {path}: not a regular file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path}: larger than {limit} bytes")
    return data


def _create_key_file(path: Path, mode: int) -> int:
    """A new file that has ``mode`` from its first byte (the umask can only narrow it)."""
    try:
        return os.open(path, _NEW_KEY_FLAGS, mode)
    except FileExistsError:
        raise ConfigError(
            f"keygen: {path} exists (a file or a symlink); refusing to overwrite a key"
        ) from None
    except OSError as exc:
        raise ConfigError(f"keygen: cannot create {path}: {exc.strerror or exc}") from None


def _write_and_close(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def generate_keypair(private_path: Path, public_path: Path, kind: KeyKind = "ed25519") -> None:
    """Write a new key pair (``ed25519``: the project's signatures; ``ec-p256``: OpenSSF
    ones); ConfigError if either path exists (or is a symlink).

    Both files are created before anything is written, so a refusal leaves nothing behind."""
    private_fd = _create_key_file(private_path, PRIVATE_KEY_MODE)
    try:
        public_fd = _create_key_file(public_path, PUBLIC_KEY_MODE)
    except BaseException:
        os.close(private_fd)
        private_path.unlink()
        raise
    key: SigningKey = (
        Ed25519PrivateKey.generate()
        if kind == "ed25519"
        else ec.generate_private_key(ec.SECP256R1())
    )
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        _write_and_close(private_fd, private_pem)
    except BaseException:
        os.close(public_fd)
        for path in (private_path, public_path):
            path.unlink(missing_ok=True)
        raise
    try:
        _write_and_close(public_fd, public_pem)
    except BaseException:
        for path in (private_path, public_path):
            path.unlink(missing_ok=True)
        raise


def _key_kind(key: object) -> str:
    return (
        key.curve.name
        if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey)
        else type(key).__name__
    )


def _of_accepted_kind(key: object, where: str) -> SigningKey | TrustedKey:
    """``key`` if it is ed25519 or EC on a curve OpenSSF signatures use; ConfigError else."""
    if isinstance(key, Ed25519PrivateKey | Ed25519PublicKey):
        return key
    if (
        isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey)
        and key.curve.name in OPENSSF_CURVES
    ):
        return key
    raise ConfigError(
        f"{where}: a {_key_kind(key)} key; accepted are ed25519 (the project's signature) "
        "and EC P-256/P-384/P-521 (an OpenSSF model signature)"
    )


def load_signing_key(path: Path) -> SigningKey:
    """A PEM private key that signs artifacts: ed25519 (the project's signature) or EC
    P-256/P-384/P-521 (an OpenSSF one). ConfigError for anything else."""
    try:
        key = serialization.load_pem_private_key(read_key_file(path, "sign key"), password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"sign key {path}: not a readable PEM private key ({exc})") from exc
    return _of_accepted_kind(key, f"sign key {path}")  # type: ignore[return-value]


def _load_private(path: Path) -> Ed25519PrivateKey:
    key = load_signing_key(path)
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"sign key {path}: not an ed25519 key")
    return key


def load_trusted_key(path: Path, what: str = "trust key") -> TrustedKey:
    """A PEM public key this service verifies with: ed25519 (the project's signatures) or EC
    P-256/P-384/P-521 (OpenSSF key mode). ConfigError for anything else."""
    try:
        key = serialization.load_pem_public_key(read_key_file(path, what))
    except ValueError as exc:
        raise ConfigError(f"{what} {path}: not a readable PEM public key ({exc})") from exc
    return _of_accepted_kind(key, f"{what} {path}")  # type: ignore[return-value]


def sign_manifest(manifest_bytes: bytes, private_key: Path | Ed25519PrivateKey) -> bytes:
    """Return the contents of the project's detached signature file."""
    key = private_key if isinstance(private_key, Ed25519PrivateKey) else _load_private(private_key)
    signature = key.sign(manifest_bytes)
    return base64.b64encode(signature) + b"\n"


def verify_manifest_signature(
    manifest_bytes: bytes, signature_file: bytes | None, public_key: Ed25519PublicKey
) -> None:
    if signature_file is None:
        raise ArtifactRejected(
            "signature", "a trust key is configured but the artifact is unsigned"
        )
    try:
        raw = base64.b64decode(signature_file.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ArtifactRejected("signature", "signature file is not base64") from exc
    try:
        public_key.verify(raw, manifest_bytes)
    except InvalidSignature as exc:
        raise ArtifactRejected(
            "signature", "manifest signature does not verify with the trust key"
        ) from exc
