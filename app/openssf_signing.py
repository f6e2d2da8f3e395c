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

In certificate mode more is asked of the signing certificate than the library asks
(``SigningCertificatePolicy``): the library checks its chain at the certificate's own
``notBefore`` and takes the digitalSignature key usage alone as fit to sign, so an expired
signer, a TLS server certificate of the same CA, or any signer the CA ever issued would pass.
Here the certificate and its chain must be valid now, the certificate must carry the
codeSigning extended key usage, and, when the trust names identities, name one of them.

One difference in what is accepted: the standard tool lets a signer leave files out (its
``--ignore-paths``, and git metadata by default) and then ignores them when verifying. Here the
manifest and every file it lists must be covered, since each of them is served: a signature
that leaves one out is refused. (``rollout pack`` leaves git metadata out of artifacts, so what
it packs signs and verifies the same with both.)
"""

from __future__ import annotations

import ast
import datetime
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Final, Literal

from app.errors import ArtifactRejected

if TYPE_CHECKING:
    from cryptography import x509

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


# --------------------------------------------------------------------------- certificate mode

# An identity that starts like an RFC 4514 attribute (``CN=``, ``2.5.4.3=``) names a subject;
# an e-mail, URI or DNS name does not (a URI's scheme ends at ':', before any '=').
_LOOKS_LIKE_SUBJECT: Final = re.compile(r"^(?:[A-Za-z][A-Za-z0-9-]*|[0-9]+(?:\.[0-9]+)+)=")
# Beyond cryptography's short names, the subject attribute ``openssl x509 -nameopt RFC2253``
# writes by a long name.
_EMAIL_ADDRESS_ATTRIBUTE: Final = "emailAddress"


@cache
def _subject_attribute_names() -> dict[str, Any]:
    from cryptography.x509.oid import NameOID

    return {_EMAIL_ADDRESS_ATTRIBUTE: NameOID.EMAIL_ADDRESS}


def _subject_text(certificate: x509.Certificate) -> str:
    names = {oid: name for name, oid in _subject_attribute_names().items()}
    return certificate.subject.rfc4514_string(names)


def _san_values(certificate: x509.Certificate) -> list[str]:
    """The e-mail addresses, URIs and DNS names the certificate's SANs name."""
    from cryptography import x509

    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        *names.get_values_for_type(x509.RFC822Name),
        *names.get_values_for_type(x509.UniformResourceIdentifier),
        *names.get_values_for_type(x509.DNSName),
    ]


def _when(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _usage_name(usage: x509.ObjectIdentifier) -> str:
    from cryptography.x509.oid import ExtendedKeyUsageOID as Usage

    names = {
        Usage.SERVER_AUTH: "serverAuth",
        Usage.CLIENT_AUTH: "clientAuth",
        Usage.CODE_SIGNING: "codeSigning",
        Usage.EMAIL_PROTECTION: "emailProtection",
        Usage.TIME_STAMPING: "timeStamping",
        Usage.OCSP_SIGNING: "OCSPSigning",
        Usage.ANY_EXTENDED_KEY_USAGE: "anyExtendedKeyUsage",
    }
    return names.get(usage, usage.dotted_string)


@dataclass(frozen=True)
class CertificateIdentity:
    """A signer a certificate-mode signature may come from, as configured (``text``).

    A subject in RFC 4514 form (``CN=release,O=Example``, most specific attribute first, as
    ``openssl x509 -noout -subject -nameopt RFC2253`` prints it): ``subject`` is set, and the
    certificate's subject must equal it attribute for attribute. Anything else is a SAN value:
    one of the certificate's e-mail, URI or DNS SANs must equal it exactly.
    """

    text: str
    subject: x509.Name | None

    @classmethod
    def parse(cls, text: str) -> CertificateIdentity:
        """ValueError when ``text`` starts like a subject but is not RFC 4514: it would
        match no certificate, and the config that names it should say so."""
        if not _LOOKS_LIKE_SUBJECT.match(text):
            return cls(text, None)
        from cryptography import x509

        try:
            subject = x509.Name.from_rfc4514_string(text, _subject_attribute_names())
        except ValueError as exc:
            why = f" ({exc})" if str(exc) else ""
            raise ValueError(
                f"{text!r} reads as a certificate subject but is not RFC 4514{why}: attribute "
                "types as CN, O, OU, C, L, ST, emailAddress or dotted OIDs, most specific "
                "first, no space after a comma (CN=release,O=Example)"
            ) from None
        return cls(text, subject)

    def named_by(self, certificate: x509.Certificate) -> bool:
        if self.subject is not None:
            return certificate.subject == self.subject
        return self.text in _san_values(certificate)


Clock = Callable[[], datetime.datetime]


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class SigningCertificatePolicy:
    """What certificate mode asks of a signing certificate beyond the library's checks.

    The library verifies the signature with the bundle's certificate and the chain to
    ``trusted``, but at the certificate's own ``notBefore``, and takes digitalSignature or
    codeSigning as fit to sign. A certificate-mode bundle carries no trusted timestamp (no
    transparency-log entry, no RFC 3161 token): the only time the signature is known to have
    existed is ``clock()``, so that is when the certificate and its chain must be valid.
    """

    trusted: tuple[x509.Certificate, ...]
    identities: tuple[CertificateIdentity, ...] = ()
    clock: Clock = utc_now

    def check(self, chain: Sequence[x509.Certificate]) -> None:
        """ValueError saying what does not hold of ``chain``: the bundle's certificates, the
        signing one first, after the library has verified the signature with them."""
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        leaf, now = chain[0], self.clock().astimezone(datetime.UTC)
        who = f"the signing certificate ({_subject_text(leaf)})"
        if now < leaf.not_valid_before_utc:
            raise ValueError(
                f"{who} is not valid before {_when(leaf.not_valid_before_utc)} "
                f"(checked at {_when(now)})"
            )
        if now > leaf.not_valid_after_utc:
            raise ValueError(
                f"{who} expired at {_when(leaf.not_valid_after_utc)} (checked at {_when(now)}); "
                "a certificate-mode signature carries no trusted timestamp, so its certificate "
                "must be valid when it is checked: re-sign with a current certificate"
            )
        self._check_chain_at(chain, now)
        try:
            usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            # RFC 5280: no extended key usage is any purpose, a TLS server's included.
            raise ValueError(f"{who} has no extended key usage; codeSigning is required") from None
        if ExtendedKeyUsageOID.CODE_SIGNING not in usages:
            named = ", ".join(_usage_name(usage) for usage in usages)
            raise ValueError(f"{who} has extended key usage {named}, not codeSigning")
        try:
            key_usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
        except x509.ExtensionNotFound:
            key_usage = None  # the key is not restricted
        if key_usage is not None and not key_usage.digital_signature:
            raise ValueError(f"{who} has a key usage without digitalSignature")
        if self.identities and not any(identity.named_by(leaf) for identity in self.identities):
            sans = _san_values(leaf)
            raise ValueError(
                f"the signing certificate names subject {_subject_text(leaf)} and "
                f"{'SANs ' + ', '.join(sans) if sans else 'no SAN'}: none of the trusted "
                f"identities ({', '.join(identity.text for identity in self.identities)})"
            )

    def _check_chain_at(self, chain: Sequence[x509.Certificate], now: datetime.datetime) -> None:
        """The library's chain check again (OpenSSL, the same store), at ``now``: a CA or
        intermediate that expired since the signing certificate was issued is refused."""
        from OpenSSL import crypto

        store = crypto.X509Store()
        for certificate in self.trusted:
            store.add_cert(crypto.X509.from_cryptography(certificate))
        store.set_time(now)
        context = crypto.X509StoreContext(
            store,
            crypto.X509.from_cryptography(chain[0]),
            [crypto.X509.from_cryptography(certificate) for certificate in chain[1:]],
        )
        try:
            context.verify_certificate()
        except crypto.X509StoreContextError as exc:
            failed = _subject_text(exc.certificate.to_cryptography())
            raise ValueError(
                f"the certificate chain is not valid at {_when(now)}: {failed}: {exc}"
            ) from None


def _signing_chain(signature: Path) -> list[x509.Certificate]:
    """The certificates of a certificate-mode bundle, the signing one first, read as the
    library reads them (its reader: model-signing is pinned to 1.x, pyproject)."""
    from cryptography import x509
    from model_signing._signing.sign_sigstore_pb import Signature

    chain = Signature.read(signature).bundle.verification_material.x509_certificate_chain
    return [x509.load_der_x509_certificate(item.raw_bytes) for item in chain.certificates]


class OpenSSFVerifier:
    """One trust anchor of OpenSSF signatures: a public key, a CA chain or a Sigstore identity.

    Construct through ``for_key``, ``for_certificates`` or ``for_identity``; the anchor's files
    are read then, and keyless trust without a trust config fetches Sigstore's trust root
    (errors are the library's own, for the caller to name the field: app.trust)."""

    def __init__(
        self,
        mode: OpenSSFMode,
        anchor: str,
        config: Any,
        certificate_policy: SigningCertificatePolicy | None = None,
    ) -> None:
        self.mode = mode
        self.anchor = anchor  # for messages: which key, chain or identity
        self._config = config
        self._certificate_policy = certificate_policy
        # A library config holds the hashing config of the check in progress.
        self._lock = threading.Lock()

    @classmethod
    def for_key(cls, public_key: Path) -> OpenSSFVerifier:
        config = _library().verifying.Config().use_elliptic_key_verifier(public_key=public_key)
        return cls("openssf-key", f"key {public_key.name}", config)

    @classmethod
    def for_certificates(
        cls, chain: list[Path], identities: Sequence[str] = (), clock: Clock = utc_now
    ) -> OpenSSFVerifier:
        """Certificate mode: signing certificates that chain to the CA certificates of
        ``chain``, valid at ``clock()``, for code signing, naming one of ``identities`` when
        any (``CertificateIdentity``; ValueError for one that cannot be parsed)."""
        from cryptography import x509

        config = _library().verifying.Config().use_certificate_verifier(certificate_chain=chain)
        trusted = x509.load_pem_x509_certificates(b"".join(p.read_bytes() for p in chain))
        policy = SigningCertificatePolicy(
            tuple(trusted), tuple(CertificateIdentity.parse(text) for text in identities), clock
        )
        anchor = f"certificates {', '.join(p.name for p in chain)}"
        if identities:
            anchor += f" for {', '.join(identities)}"
        return cls("openssf-certificate", anchor, config, policy)

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
                if self._certificate_policy is not None:
                    # After the library: the certificate is then the one that signed.
                    self._certificate_policy.check(_signing_chain(sig_path))
            except Exception as exc:
                # Any failure of the library is a refusal: a bundle it cannot parse, a key or
                # chain that does not match, a statement whose digests differ; and any
                # certificate the policy refuses.
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
