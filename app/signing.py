"""Detached ed25519 signatures over the manifest bytes.

Why `cryptography` and not OpenSSF model-signing: a manifest already lists every file with its
SHA-256, so a signature over the manifest bytes covers the whole artifact; model-signing would
re-hash the files in its own format and its default flows lean on Sigstore's online services.
`cryptography` is a small, well-kept wheel that works fully offline with a local key.

Keys are PEM files: PKCS#8 private keys, SubjectPublicKeyInfo public keys. The signature file
(`manifest.json.sig`) holds the base64 of the 64-byte raw signature and a newline.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from app.errors import ArtifactRejected, ConfigError

# O_EXCL: never through an existing file; O_NOFOLLOW (and O_EXCL, which refuses any symlink):
# never through a symlink planted where the key is to be created.
_NEW_KEY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
PRIVATE_KEY_MODE = 0o600
PUBLIC_KEY_MODE = 0o644
# A PEM ed25519 key is ~120 bytes; anything near this is not a key (``/dev/zero``, a dataset).
MAX_KEY_FILE_BYTES = 64 * 1024


def _read_key_file(path: Path, what: str) -> bytes:
    """The bytes of a key file: a regular file (symlinks followed, as mounted secrets are), of
    bounded size, opened without blocking so a FIFO or device named by mistake (in a
    user_config's ``trust_key`` too) is refused instead of hanging or filling memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot be opened ({exc.strerror or exc})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{what} {path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{what} {path}: larger than {MAX_KEY_FILE_BYTES} bytes, not a key")
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


def generate_keypair(private_path: Path, public_path: Path) -> None:
    """Write a new ed25519 key pair; ConfigError if either path exists (or is a symlink).

    Both files are created before anything is written, so a refusal leaves nothing behind."""
    private_fd = _create_key_file(private_path, PRIVATE_KEY_MODE)
    try:
        public_fd = _create_key_file(public_path, PUBLIC_KEY_MODE)
    except BaseException:
        os.close(private_fd)
        private_path.unlink()
        raise
    key = Ed25519PrivateKey.generate()
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


def _load_private(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(_read_key_file(path, "sign key"), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"sign key {path}: not a readable PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"sign key {path}: not an ed25519 key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(_read_key_file(path, "trust key"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"trust key {path}: not a readable PEM public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"trust key {path}: not an ed25519 key")
    return key


def sign_manifest(manifest_bytes: bytes, private_key_path: Path) -> bytes:
    """Return the contents of the detached signature file."""
    signature = _load_private(private_key_path).sign(manifest_bytes)
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
