"""OpenSSF certificate mode: what is checked of the signing certificate after the library.

The library checks the chain at the signing certificate's own ``notBefore`` and accepts any
certificate with the digitalSignature key usage, so on its own an expired signer, a TLS server
certificate of the same CA, or any signer the CA ever issued verifies. Here the certificate
must also be valid now (the chain too), carry the codeSigning extended key usage, and, when
the trust names identities, name one of them.

In process: a CA and signing certificates minted with ``cryptography``, a small directory
signed with the library's certificate signer, checked by ``OpenSSFVerifier`` and through a
``TrustPolicy``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from pydantic import ValidationError

from app.contracts import SignatureTrust
from app.demo_artifacts import write_ranker_source
from app.errors import ArtifactRejected, ConfigError
from app.manifest import MANIFEST_NAME, parse_manifest, sha256_hex
from app.openssf_signing import DirectoryDigests, OpenSSFVerifier
from app.packing import pack_artifact
from app.trust import TrustPolicy

NOW = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
DAY = datetime.timedelta(days=1)
YEAR = 365 * DAY
SIGNER_EMAIL = "release@example.com"
SIGNER_URI = "https://ci.example.com/pipelines/release"
SIGNER_SUBJECT = "CN=release signer,O=Example"


@dataclass(frozen=True)
class Authority:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    pem: Path


def _subject(rfc4514: str) -> x509.Name:
    return x509.Name.from_rfc4514_string(rfc4514)


def _mint(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: Authority | None,
    *,
    valid: tuple[datetime.datetime, datetime.datetime],
    ca: bool = False,
    usages: Sequence[x509.ObjectIdentifier] | None = (ExtendedKeyUsageOID.CODE_SIGNING,),
    digital_signature: bool = True,
    sans: Sequence[x509.GeneralName] = (),
) -> x509.Certificate:
    """A certificate: a CA (self-signed when ``issuer`` is None) or a signing certificate;
    ``usages`` None leaves the extended key usage extension out."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.name if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=digital_signature and not ca, content_commitment=False,
                key_encipherment=not digital_signature, data_encipherment=False,
                key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )  # fmt: skip
    if usages is not None and not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer.key if issuer else key, hashes.SHA256())


def _pem(path: Path, item: x509.Certificate | ec.EllipticCurvePrivateKey) -> Path:
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


def _authority(d: Path, name: str, valid: tuple[datetime.datetime, datetime.datetime]) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _subject(f"CN={name}")
    pem = _pem(d / f"{name.replace(' ', '-')}.crt", _mint(subject, key, None, valid=valid, ca=True))
    return Authority(subject, key, pem)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    """A CA valid for years on both sides of now: any refusal is the signing certificate's."""
    return _authority(tmp_path_factory.mktemp("ca"), "Model CA", (NOW - 5 * YEAR, NOW + 5 * YEAR))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DirectoryDigests]:
    d = tmp_path_factory.mktemp("model")
    (d / "weights.bin").write_bytes(b"\x00\x01weights")
    (d / "config.json").write_text('{"layers": 2}')
    files = {p.name: sha256_hex(p.read_bytes()) for p in d.iterdir()}
    return d, DirectoryDigests(required=files, optional={}, name="model")


def _sign(
    directory: Path, signature: Path, ca: Authority, tmp: Path, **certificate: object
) -> None:
    """``signature``: the library's certificate-mode signature of ``directory``, made with a
    new key and a certificate ``ca`` issues it (``_mint``'s options; valid now by default)."""
    import model_signing.signing

    key = ec.generate_private_key(ec.SECP256R1())
    options: dict[str, object] = {
        "valid": (NOW - DAY, NOW + YEAR),
        "sans": (x509.RFC822Name(SIGNER_EMAIL), x509.UniformResourceIdentifier(SIGNER_URI)),
        **certificate,
    }
    leaf = _mint(_subject(SIGNER_SUBJECT), key, ca, **options)  # type: ignore[arg-type]
    model_signing.signing.Config().use_certificate_signer(
        private_key=_pem(tmp / "signer.key", key),
        signing_certificate=_pem(tmp / "signer.crt", leaf),
        certificate_chain=[ca.pem],
    ).sign(directory, signature)


def _bundle(
    model: tuple[Path, DirectoryDigests], ca: Authority, tmp: Path, **certificate: object
) -> bytes:
    tmp.mkdir(parents=True, exist_ok=True)
    _sign(model[0], tmp / "model.sig", ca, tmp, **certificate)
    return (tmp / "model.sig").read_bytes()


def _refusal(verifier: OpenSSFVerifier, bundle: bytes, digests: DirectoryDigests) -> str:
    with pytest.raises(ArtifactRejected) as info:
        verifier.verify(bundle, digests, "model.sig")
    assert info.value.category == "signature"
    assert info.value.detail.startswith("openssf-certificate (certificates Model-CA.crt"), (
        info.value.detail
    )
    return info.value.detail


# --------------------------------------------------------------------------- validity


def test_a_current_code_signing_certificate_verifies(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    bundle = _bundle(model, ca, tmp_path)
    OpenSSFVerifier.for_certificates([ca.pem]).verify(bundle, model[1], "model.sig")


def test_an_expired_signing_certificate_is_refused_saying_when_it_expired(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    """Valid three years ago for one year: the library, checking at its notBefore, accepts."""
    expired_at = NOW - 2 * YEAR
    bundle = _bundle(model, ca, tmp_path, valid=(NOW - 3 * YEAR, expired_at))
    detail = _refusal(OpenSSFVerifier.for_certificates([ca.pem]), bundle, model[1])
    assert f"expired at {expired_at:%Y-%m-%dT%H:%M:%SZ}" in detail, detail
    assert SIGNER_SUBJECT in detail, detail


def test_a_signing_certificate_not_yet_valid_is_refused(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    starts = NOW + 30 * DAY
    bundle = _bundle(model, ca, tmp_path, valid=(starts, NOW + YEAR))
    detail = _refusal(OpenSSFVerifier.for_certificates([ca.pem]), bundle, model[1])
    assert f"not valid before {starts:%Y-%m-%dT%H:%M:%SZ}" in detail, detail


def test_validity_is_judged_at_the_verifiers_clock(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    """The same expired certificate, judged at a time inside its validity, is accepted: the
    refusal is about when, and the clock is the only input to it."""
    bundle = _bundle(model, ca, tmp_path, valid=(NOW - 3 * YEAR, NOW - 2 * YEAR))
    then = OpenSSFVerifier.for_certificates([ca.pem], clock=lambda: NOW - 2 * YEAR - 30 * DAY)
    then.verify(bundle, model[1], "model.sig")


def test_a_chain_that_expired_since_the_certificate_was_issued_is_refused(
    tmp_path: Path, model: tuple[Path, DirectoryDigests]
) -> None:
    """A CA that expired yesterday, a signing certificate it issued two years ago and still
    valid: the library, checking the chain at that notBefore, accepts."""
    expired_ca = _authority(tmp_path, "Model CA", (NOW - 3 * YEAR, NOW - DAY))
    bundle = _bundle(model, expired_ca, tmp_path, valid=(NOW - 2 * YEAR, NOW + YEAR))
    detail = _refusal(OpenSSFVerifier.for_certificates([expired_ca.pem]), bundle, model[1])
    assert "chain" in detail and "expired" in detail and "CN=Model CA" in detail, detail


# --------------------------------------------------------------------------- usage


def test_a_tls_server_certificate_of_the_trusted_ca_is_refused_naming_its_usage(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    """digitalSignature key usage and serverAuth only: enough for the library."""
    bundle = _bundle(model, ca, tmp_path, usages=[ExtendedKeyUsageOID.SERVER_AUTH])
    detail = _refusal(OpenSSFVerifier.for_certificates([ca.pem]), bundle, model[1])
    assert "extended key usage serverAuth" in detail and "codeSigning" in detail, detail


def test_a_certificate_without_extended_key_usage_is_refused(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    """No extended key usage means any purpose (RFC 5280): not a code-signing certificate."""
    bundle = _bundle(model, ca, tmp_path, usages=None)
    detail = _refusal(OpenSSFVerifier.for_certificates([ca.pem]), bundle, model[1])
    assert "no extended key usage" in detail and "codeSigning" in detail, detail


def test_a_code_signing_certificate_whose_key_usage_excludes_signatures_is_refused(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    """codeSigning but a key usage of keyEncipherment only: the library accepts either."""
    bundle = _bundle(model, ca, tmp_path, digital_signature=False)
    detail = _refusal(OpenSSFVerifier.for_certificates([ca.pem]), bundle, model[1])
    assert "digitalSignature" in detail, detail


# --------------------------------------------------------------------------- identity


@pytest.mark.parametrize("identity", [SIGNER_EMAIL, SIGNER_URI, SIGNER_SUBJECT])
def test_a_configured_identity_accepts_its_signer_only(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests], identity: str
) -> None:
    """An identity is an e-mail, URI or DNS name of the certificate's SANs, or its subject
    (RFC 4514); the same CA's certificate for another signer is refused."""
    ours = _bundle(model, ca, tmp_path / "ours")
    verifier = OpenSSFVerifier.for_certificates([ca.pem], identities=["someone@else.org", identity])
    verifier.verify(ours, model[1], "model.sig")
    theirs = _bundle(
        model, ca, tmp_path / "theirs",
        sans=[x509.RFC822Name("mallory@example.com"), x509.DNSName("mallory.example.com")],
    )  # fmt: skip
    only_ours = OpenSSFVerifier.for_certificates([ca.pem], identities=[identity])
    if identity == SIGNER_SUBJECT:
        # Same subject, other SANs: the subject is what this identity names.
        only_ours.verify(theirs, model[1], "model.sig")
        return
    detail = _refusal(only_ours, theirs, model[1])
    assert f"none of the trusted identities ({identity})" in detail, detail
    assert "mallory@example.com" in detail and "mallory.example.com" in detail, detail


def test_a_subject_identity_refuses_another_subject(
    tmp_path: Path, ca: Authority, model: tuple[Path, DirectoryDigests]
) -> None:
    bundle = _bundle(model, ca, tmp_path)
    verifier = OpenSSFVerifier.for_certificates([ca.pem], identities=["CN=release signer"])
    detail = _refusal(verifier, bundle, model[1])
    assert f"subject {SIGNER_SUBJECT}" in detail, detail


# --------------------------------------------------------------------------- configuration


def test_certificate_identities_need_certificate_chains() -> None:
    with pytest.raises(ValidationError, match="certificate_identities name the signer") as info:
        SignatureTrust(certificate_identities=[SIGNER_EMAIL])
    assert "certificate_chains" in str(info.value)


@pytest.mark.parametrize("bad", ["", " release@example.com", "release@example.com\n", "a\x00b"])
def test_a_malformed_certificate_identity_is_refused_by_the_contract(bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        SignatureTrust(certificate_chains=["ca.pem"], certificate_identities=[bad])
    (error,) = info.value.errors()
    assert error["loc"] == ("certificate_identities", 0), error
    assert "a certificate identity is" in error["msg"] or error["type"] == "string_too_short"


@pytest.mark.parametrize("bad", ["cn=release signer", "CN=release signer, O=Example"])
def test_a_subject_identity_that_is_not_rfc_4514_is_a_config_error_naming_it(
    ca: Authority, bad: str
) -> None:
    trust = SignatureTrust(
        certificate_chains=[str(ca.pem)], certificate_identities=[SIGNER_EMAIL, bad]
    )
    with pytest.raises(ConfigError, match="RFC 4514") as info:
        TrustPolicy(trust, field="user_config.trust")
    assert info.value.ids["field"] == "user_config.trust.certificate_identities[1]"


def test_a_trust_policy_checks_the_configured_identities(tmp_path: Path, ca: Authority) -> None:
    src = tmp_path / "src"
    write_ranker_source(src, seed=1)
    art = pack_artifact(
        src, tmp_path / "art", model="ranker", artifact_id="cert-identity",
        feature_schema="ranker-features-v3",
    )  # fmt: skip
    _sign(art.out_dir, art.out_dir / "model.sig", ca, tmp_path)
    manifest_bytes = (art.out_dir / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(manifest_bytes, art.manifest_sha256)
    signatures = {"model.sig": (art.out_dir / "model.sig").read_bytes()}

    def policy(*identities: str) -> TrustPolicy:
        return TrustPolicy(
            SignatureTrust(
                certificate_chains=[str(ca.pem)], certificate_identities=list(identities)
            )
        )

    assert policy(SIGNER_URI).verify(manifest_bytes, manifest, signatures) == (
        "openssf-certificate"
    )
    assert SIGNER_URI in policy(SIGNER_URI).describe()
    with pytest.raises(ArtifactRejected, match="none of the trusted identities"):
        policy("mallory@example.com").verify(manifest_bytes, manifest, signatures)
