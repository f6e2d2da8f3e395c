"""Which signatures an artifact must carry, checked the same way on every path.

A ``TrustPolicy`` is built from a ``SignatureTrust`` (app args, a replica's user_config, the
CLI's ``--trust-*`` options) and answers one question for the cache (fetch and every hit),
``rollout verify``, replicas and ``rollout registry register --require-signature``: given the
pinned manifest bytes and the signature files the artifact carries, which trusted signature
covers them? Two kinds side by side:

- the project's ed25519 signature over the manifest bytes (``manifest.json.sig``; app.signing);
- OpenSSF model signatures (``model.sig``; app.openssf_signing) in key, certificate or keyless
  mode, whose signed digests must equal the manifest's file for file, the manifest's own
  included.

Either covers every byte: the manifest pins each file's SHA-256, and the loader reads only
bytes that match. Anchors are loaded when the policy is built, so a key that cannot be read
refuses the config that names it (ConfigError naming the field), not the next load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from app.artifact_store import ArtifactSource
from app.contracts import FetchConfig, SignatureTrust
from app.errors import ArtifactRejected, ConfigError
from app.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, parse_manifest
from app.openssf_signing import (
    MAX_OPENSSF_SIGNATURE_BYTES,
    CertificateIdentity,
    DirectoryDigests,
    OpenSSFVerifier,
)
from app.signing import load_trusted_key, read_key_file, verify_manifest_signature

# A project signature file holds the base64 of 64 bytes and a newline.
MAX_PROJECT_SIGNATURE_BYTES: Final = 4096
# A CA bundle or a Sigstore trust config (a trusted root of several keys and certificates).
MAX_TRUST_FILE_BYTES: Final = 4 << 20
PROJECT_MODE: Final = "ed25519"


# The options of ``rollout verify`` and ``registry register`` that set each field.
_CLI_NAMES: Final = {
    "keys": "--trust-key",
    "certificate_chains": "--trust-cert-chain",
    "keyless": "--trust-identity",
    "sigstore_trust_config": "--sigstore-trust-config",
}


def anchors_digest(trust: SignatureTrust, *, field: str = "trust") -> str | None:
    """The SHA-256 (hex) of what ``trust`` trusts, read now: its settings and the bytes of
    every anchor file it names; None when it names no anchor. A key or CA chain replaced in
    place (a ConfigMap update, a revocation by a new file) changes it while the paths stay
    the same, so a replica compares it to know when to build its policy again, and reports
    it so that replicas which disagree show. ConfigError names the field of a file that
    cannot be read."""
    if not trust.has_anchors:
        return None
    digest = hashlib.sha256(trust.model_dump_json().encode())
    named = [(f"{field}.keys[{i}]", path) for i, path in enumerate(trust.keys)]
    named += [(f"{field}.certificate_chains", path) for path in trust.certificate_chains]
    if trust.sigstore_trust_config:
        named.append((f"{field}.sigstore_trust_config", trust.sigstore_trust_config))
    for where, path in named:
        data = _named(where, lambda path=path: read_key_file(Path(path), "trust anchor",
                                                            MAX_TRUST_FILE_BYTES))  # fmt: skip
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


@dataclass(frozen=True)
class _ProjectKey:
    path: Path
    key: Ed25519PublicKey


class TrustPolicy:
    """The anchors of one ``SignatureTrust``, loaded. ``field`` prefixes the config field a
    ConfigError names (``user_config.trust``); ``cli`` names the command's options instead."""

    def __init__(self, trust: SignatureTrust, *, field: str = "trust", cli: bool = False) -> None:
        self.trust = trust
        self.signature_file = trust.signature_file
        self._project: list[_ProjectKey] = []
        self._openssf: list[OpenSSFVerifier] = []
        names = _CLI_NAMES if cli else {name: f"{field}.{name}" for name in _CLI_NAMES}
        for i, raw in enumerate(trust.keys):
            where = names["keys"] if cli else f"{field}.keys[{i}]"
            path = Path(raw)
            key = _named(where, lambda path=path: load_trusted_key(path))
            if isinstance(key, Ed25519PublicKey):
                self._project.append(_ProjectKey(path, key))
            else:
                self._openssf.append(_named(where, lambda path=path: OpenSSFVerifier.for_key(path)))
        if trust.certificate_chains:
            where = names["certificate_chains"]
            chain = [Path(p) for p in trust.certificate_chains]
            for path in chain:
                _named(
                    where,
                    lambda path=path: read_key_file(
                        path, "certificate chain", MAX_TRUST_FILE_BYTES
                    ),
                )
            identities = trust.certificate_identities
            for i, identity in enumerate(identities):
                # Each parsed once here under its own name; the verifier parses them again.
                _named(
                    f"{field}.certificate_identities[{i}]",
                    lambda identity=identity: CertificateIdentity.parse(identity),
                )
            self._openssf.append(
                _named(where, lambda: OpenSSFVerifier.for_certificates(chain, identities))
            )
        trust_config = Path(trust.sigstore_trust_config) if trust.sigstore_trust_config else None
        if trust_config is not None:
            # Parsed here once under its own name; the library reads it again per identity.
            _named(names["sigstore_trust_config"], lambda: _check_trust_config(trust_config))
        for i, signer in enumerate(trust.keyless):
            self._openssf.append(
                _named(
                    names["keyless"] if cli else f"{field}.keyless[{i}]",
                    lambda signer=signer: OpenSSFVerifier.for_identity(
                        signer.identity, signer.oidc_issuer, trust_config
                    ),
                )
            )

    @classmethod
    def of(
        cls, trust: SignatureTrust, *, field: str = "trust", cli: bool = False
    ) -> TrustPolicy | None:
        """The policy of ``trust``; None when it names no anchor (nothing to check)."""
        return cls(trust, field=field, cli=cli) if trust.has_anchors else None

    @property
    def signature_limits(self) -> dict[str, int]:
        """The signature files an artifact may carry, with the most bytes each may have."""
        return signature_limits(self.signature_file)

    def describe(self) -> str:
        anchors = [f"ed25519 key {k.path.name}" for k in self._project]
        anchors += [f"{v.mode} {v.anchor}" for v in self._openssf]
        return ", ".join(anchors)

    def verify(
        self, manifest_bytes: bytes, manifest: Manifest, signatures: Mapping[str, bytes | None]
    ) -> str:
        """The mode of a trusted signature over the artifact (``ed25519``, ``openssf-key``,
        ``openssf-certificate``, ``openssf-keyless``). ArtifactRejected ``signature`` naming
        every reason when none verifies. ``manifest_bytes`` are the pinned ones; ``signatures``
        maps signature file names to their bytes (None: absent)."""
        if self._openssf and any(item.path == self.signature_file for item in manifest.files):
            raise ArtifactRejected(
                "signature",
                f"the manifest lists {self.signature_file!r}, the signature file's name",
                artifact_id=manifest.artifact_id,
            )
        failures: list[str] = []
        project = signatures.get(SIGNATURE_NAME)
        if project is not None and self._project:
            for key in self._project:
                try:
                    verify_manifest_signature(manifest_bytes, project, key.key)
                    return PROJECT_MODE
                except ArtifactRejected as exc:
                    failures.append(f"{PROJECT_MODE} (key {key.path.name}): {exc.detail}")
        bundle = signatures.get(self.signature_file)
        if bundle is not None and self._openssf:
            digests = directory_digests(manifest_bytes, manifest, project)
            for verifier in self._openssf:
                try:
                    verifier.verify(bundle, digests, self.signature_file)
                    return verifier.mode
                except ArtifactRejected as exc:
                    failures.append(exc.detail)
        if not failures:
            looked = [SIGNATURE_NAME] if self._project else []
            looked += [self.signature_file] if self._openssf else []
            present = [name for name, data in signatures.items() if data is not None]
            if present:
                detail = (
                    f"the artifact carries no signature of a trusted kind (it has "
                    f"{', '.join(present)}, the trust needs {' or '.join(looked)})"
                )
            else:
                detail = f"the artifact is unsigned (no {' or '.join(looked)})"
            detail += f"; trusted: {self.describe()}"
        else:
            detail = "; ".join(failures)
        raise ArtifactRejected("signature", detail, artifact_id=manifest.artifact_id)


def verify_at_source(
    policy: TrustPolicy,
    manifest_uri: str,
    manifest_sha256: str,
    fetch: FetchConfig | None = None,
) -> tuple[Manifest, str]:
    """The manifest at ``manifest_uri`` (checked against its pinned digest) and the mode of the
    trusted signature over the artifact, read from the source: the manifest and its signature
    files only, no weights (every signature kind covers them through the manifest's digests).
    ArtifactRejected when the digest or the signature does not hold."""
    source = ArtifactSource(manifest_uri, fetch)
    manifest_bytes = source.read_small(None)
    assert manifest_bytes is not None  # a missing manifest is a rejection
    manifest = parse_manifest(manifest_bytes, manifest_sha256)
    signatures = {
        name: source.read_small(name, limit=limit)
        for name, limit in policy.signature_limits.items()
    }
    return manifest, policy.verify(manifest_bytes, manifest, signatures)


def signature_limits(signature_file: str) -> dict[str, int]:
    """Signature files an artifact directory may hold beside its manifest, with size limits."""
    return {
        SIGNATURE_NAME: MAX_PROJECT_SIGNATURE_BYTES,
        signature_file: MAX_OPENSSF_SIGNATURE_BYTES,
    }


def directory_digests(
    manifest_bytes: bytes, manifest: Manifest, project_signature: bytes | None
) -> DirectoryDigests:
    """What an OpenSSF signature of the artifact directory must cover: the manifest and every
    file it lists; the project's signature file too, if the directory holds one and the
    signer hashed it."""
    required = {MANIFEST_NAME: hashlib.sha256(manifest_bytes).hexdigest()}
    required.update({item.path: item.sha256 for item in manifest.files})
    optional = {}
    if project_signature is not None:
        optional[SIGNATURE_NAME] = hashlib.sha256(project_signature).hexdigest()
    return DirectoryDigests(required=required, optional=optional, name=manifest.artifact_id)


_T = TypeVar("_T")


def _check_trust_config(path: Path) -> None:
    from sigstore.models import ClientTrustConfig

    ClientTrustConfig.from_json(
        read_key_file(path, "sigstore trust config", MAX_TRUST_FILE_BYTES).decode()
    )


def _named(field: str, build: Callable[[], _T]) -> _T:
    """``build()``; its failure to set up an anchor as a ConfigError naming ``field``."""
    try:
        return build()
    except ConfigError as exc:
        raise ConfigError(f"{field}: {exc}", field=field) from None
    except Exception as exc:
        # Whatever the libraries raise for an anchor they cannot use: a file they cannot
        # parse, a key of another kind, Sigstore's trust root out of reach (keyless without
        # a trust config fetches it). The config that names it is refused; the last good one
        # keeps serving.
        raise ConfigError(f"{field}: {type(exc).__name__}: {exc}", field=field) from None
