"""OpenSSF model signatures (the ``model-signing`` package) over artifact directories.

An OpenSSF signature is a Sigstore bundle (``model.sig`` by default) holding a DSSE envelope of
an in-toto statement that lists every file of the model directory with its digest. Made with
file-level SHA-256 (the standard tool's default), those are the digests the manifest pins, plus
the manifest's own: so a signature that covers ``manifest.json`` and whose digests equal the
manifest's, file for file, speaks of exactly the bytes the pinned manifest digest does.

Signing, the bundle, the envelope and the verification of keys, certificate chains and Sigstore
identities are the library's. What this module adds is where the digests come from: the library
would hash the directory itself, reading multi-GB weights once more after the cache verified
them byte by byte; here it is handed the digests the manifest pins instead (``PinnedDigests``),
and compares them with the signed ones as it would compare its own, without the second read;
signing at pack time costs no second hash of the weights either.

One difference in what is accepted: the standard tool lets a signer leave files out (its
``--ignore-paths``, and git metadata by default) and then ignores them when verifying. Here the
manifest and every file it lists must be covered, since each of them is served: a signature
that leaves one out is refused. (``rollout pack`` leaves git metadata out of artifacts, so what
it packs signs and verifies the same with both.)
"""

from __future__ import annotations

import ast
import re
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

from app.errors import ArtifactRejected

OpenSSFMode = Literal["openssf-key", "openssf-certificate", "openssf-keyless"]
DEFAULT_SIGNATURE_FILE: Final = "model.sig"
# A bundle lists every file (at most a few hundred) and may carry a certificate chain.
MAX_OPENSSF_SIGNATURE_BYTES: Final = 1 << 20
SIGNED_HASH: Final = "sha256"
# What the standard tool leaves out of a model directory's signature by default (top level
# only), besides the signature file itself; ``rollout pack`` does not copy them either.
GIT_METADATA: Final = frozenset({".git", ".gitattributes", ".github", ".gitignore"})


@dataclass(frozen=True)
class DirectoryDigests:
    """The SHA-256 of every file an artifact directory holds, as the manifest pins them.

    ``required``: the manifest and every file it lists; a signature must cover each.
    ``optional``: files of the directory that are not part of the model (the project's own
    signature file): covered when the signer hashed them, and then checked like the others.
    ``name``: what the library calls the model in its messages (the artifact id).
    """

    required: Mapping[str, str]
    optional: Mapping[str, str]
    name: str = "artifact"


@cache
def _library() -> Any:
    """model_signing, imported on first use: it pulls in Sigstore's client (a third of a
    second), which commands that check no signature should not pay for."""
    import model_signing.hashing
    import model_signing.manifest
    import model_signing.signing
    import model_signing.verifying

    return model_signing


@cache
def _pinned_digests_class() -> type:
    ms = _library()
    # The digest type of a manifest item: public through ``model_signing.manifest``'s
    # signatures, defined in a private module; model-signing is pinned to 1.x (pyproject).
    from model_signing._hashing.hashing import Digest

    class PinnedDigests(ms.hashing.Config):  # type: ignore[misc, name-defined]
        """A hashing configuration whose hash of the directory is the digests already known
        to be true of it, instead of a second read of every file."""

        def __init__(self, digests: DirectoryDigests, ignored: Iterable[str] = ()) -> None:
            super().__init__()
            self._digests = digests
            self.set_ignored_paths(paths=list(ignored), ignore_git_paths=True)

        def _is_ignored(self, name: str) -> bool:
            path = PurePosixPath(name)
            ignored = {PurePosixPath(str(p)) for p in self._ignored_paths}
            if self._ignore_git_paths:
                ignored.update(PurePosixPath(p) for p in GIT_METADATA)
            return any(path == p or p in path.parents for p in ignored)

        def hash(self, model_path: Any, *, files_to_hash: Iterable[Any] | None = None) -> Any:
            # The manifest and its listed files are always part of what is compared, even
            # where a signer chose to ignore them: a signature that leaves one out does not
            # cover it.
            files = dict(self._digests.required)
            for name, digest in self._digests.optional.items():
                if not self._is_ignored(name):
                    files[name] = digest
            serialization = ms.manifest.SerializationType.from_args(
                {
                    "method": "files",
                    "hash_type": SIGNED_HASH,
                    "allow_symlinks": False,
                    "ignore_paths": sorted(str(p) for p in self._ignored_paths),
                }
            )
            items = [
                ms.manifest.FileManifestItem(
                    path=PurePosixPath(name), digest=Digest(SIGNED_HASH, bytes.fromhex(digest))
                )
                for name, digest in sorted(files.items())
            ]
            return ms.manifest.Manifest(self._digests.name, items, serialization)

    return PinnedDigests


def _pinned_digests(digests: DirectoryDigests, ignored: Iterable[str]) -> Any:
    return _pinned_digests_class()(digests, ignored)


def sign_directory(
    directory: Path, private_key: Path, digests: DirectoryDigests, signature_file: str
) -> None:
    """Write ``directory/signature_file``: an OpenSSF key-mode signature (EC key) over the
    digests, which the caller has just computed from the directory's bytes."""
    hashing_config = _pinned_digests(digests, ignored=[signature_file])
    _library().signing.Config().use_elliptic_key_signer(private_key=private_key).set_hashing_config(
        hashing_config
    ).sign(directory, directory / signature_file)


_DIGEST_REPR = re.compile(
    r"Digest\(algorithm='([^']*)', digest_value=(b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\")\)"
)
_MISMATCH: Final = "Signature mismatch: "


def _hexed_digests(text: str) -> str:
    """``text`` with each ``Digest(algorithm=..., digest_value=b'...')`` as ``sha256:<hex>``."""

    def hexed(match: re.Match[str]) -> str:
        try:
            value = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError):
            return match.group(0)
        return f"{match.group(1)}:{value.hex()}"

    return _DIGEST_REPR.sub(hexed, text)


def _readable(reason: str) -> str:
    """The library's reason, its mismatch list as ``; ``-joined lines with digests in hex.

    The library formats a mismatch as ``Signature mismatch: `` and the ``str`` of a list of
    lines, which escapes the bytes reprs inside once more; the list is read back first."""
    if reason.startswith(_MISMATCH):
        try:
            lines = ast.literal_eval(reason[len(_MISMATCH) :])
        except (ValueError, SyntaxError):
            lines = None
        if isinstance(lines, list) and all(isinstance(line, str) for line in lines):
            return _MISMATCH + "; ".join(_hexed_digests(line) for line in lines)
    return _hexed_digests(reason)


class OpenSSFVerifier:
    """One trust anchor of OpenSSF signatures: a public key, a CA chain or a Sigstore identity.

    Construct through ``for_key``, ``for_certificates`` or ``for_identity``; the anchor's files
    are read then, and keyless trust without a trust config fetches Sigstore's trust root
    (errors are the library's own, for the caller to name the field: app.trust)."""

    def __init__(self, mode: OpenSSFMode, anchor: str, config: Any) -> None:
        self.mode = mode
        self.anchor = anchor  # for messages: which key, chain or identity
        self._config = config
        # A library config holds the hashing config of the check in progress.
        self._lock = threading.Lock()

    @classmethod
    def for_key(cls, public_key: Path) -> OpenSSFVerifier:
        config = _library().verifying.Config().use_elliptic_key_verifier(public_key=public_key)
        return cls("openssf-key", f"key {public_key.name}", config)

    @classmethod
    def for_certificates(cls, chain: list[Path]) -> OpenSSFVerifier:
        config = _library().verifying.Config().use_certificate_verifier(certificate_chain=chain)
        names = ", ".join(p.name for p in chain)
        return cls("openssf-certificate", f"certificates {names}", config)

    @classmethod
    def for_identity(
        cls, identity: str, oidc_issuer: str, trust_config: Path | None
    ) -> OpenSSFVerifier:
        config = (
            _library()
            .verifying.Config()
            .use_sigstore_verifier(
                identity=identity, oidc_issuer=oidc_issuer, trust_config=trust_config
            )
        )
        return cls("openssf-keyless", f"identity {identity} ({oidc_issuer})", config)

    def verify(self, bundle: bytes, digests: DirectoryDigests, signature_file: str) -> None:
        """ArtifactRejected ``signature`` with the library's reason unless ``bundle`` is a valid
        signature of this anchor over exactly ``digests``."""
        # The library reads a bundle from a file: a private one, gone when this returns.
        with self._lock, tempfile.TemporaryDirectory(prefix="openssf-") as scratch:
            self._config.set_hashing_config(_pinned_digests(digests, [signature_file]))
            sig_path = Path(scratch) / signature_file
            sig_path.write_bytes(bundle)
            try:
                # The directory is never read: the digests are pinned.
                self._config.verify(Path(scratch) / "model", sig_path)
            except Exception as exc:
                # Any failure of the library is a refusal: a bundle it cannot parse, a key or
                # chain that does not match, a statement whose digests differ.
                raise ArtifactRejected(
                    "signature", f"{self.mode} ({self.anchor}): {_reason(exc)}"
                ) from None


def _reason(exc: BaseException) -> str:
    text = _readable(str(exc)).strip()
    if text.startswith("Signature mismatch"):
        text += (
            " (digests are compared file by file with the manifest's SHA-256: sign with the"
            " standard tool's default file serialization)"
        )
    return text or type(exc).__name__
