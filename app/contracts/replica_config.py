"""A ranker deployment's ``user_config`` (``ReplicaConfig``) and its parts: batching,
memory, how artifacts are fetched and loaded, retries, where reports go, test faults, and which
signatures make an artifact acceptable (``SignatureTrust``, shared with ``AppArgs``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Self

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from app.contracts.targets import Target
from app.contracts.vocabulary import (
    DEFAULT_FAMILIES,
    DEFAULT_FEATURE_SCHEMA,
    MAX_BATCH_SIZE,
    MAX_BYTES,
    Bytes,
    Contract,
    MiB,
    ModelFamilies,
    Name,
    PathText,
    Role,
)


class BatchingConfig(Contract):
    max_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] = 32
    batch_wait_timeout_s: Annotated[float, Field(ge=0, le=1)] = 0.002


class MemoryConfig(Contract):
    capacity_bytes: Annotated[int, Field(gt=0, le=MAX_BYTES)] | None = None  # None: the device's
    margin_bytes: Bytes = 256 * MiB
    margin_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.05


# A URI scheme as RFC 3986 spells it, lower case (fsspec protocol names).
UriScheme = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9+.-]{0,31}$")]
DEFAULT_URI_SCHEMES: Final = ("file", "http", "https", "s3", "gs")
# What an object-store file being read may hold in ranges read ahead (FetchConfig).
MAX_READ_AHEAD_BYTES: Final = 512 << 20


class FetchConfig(Contract):
    """How artifact stores are read (app.artifact_store).

    ``schemes``: the URI schemes a ``manifest_uri`` may use (a plain path counts as ``file``);
    any other is refused before anything is opened, and a redirect is followed only within
    the origin the URI names (same scheme, host and port).
    The timeouts bound a stall, not a download: connecting, and each wait for more bytes. A
    large artifact streams for as long as bytes keep coming.

    Object stores (``s3://``, ``gs://``) are read in ranges of ``part_bytes``,
    ``parallel_parts`` at a time per file; a range that fails on a transient error (a stall
    past the read timeout, a connection dropped mid-body, a 5xx) is read again, up to
    ``part_retries`` times with a backoff doubling from ``retry_initial_s``, while the parts
    already read are kept: a partly fetched file resumes where it broke off.
    ``s3_endpoint_url``: an S3-compatible store (MinIO, Ceph, a test server) instead of AWS;
    credentials come from the environment as for any AWS client."""

    schemes: Annotated[tuple[UriScheme, ...], Field(min_length=1, max_length=32)] = (
        DEFAULT_URI_SCHEMES
    )
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    read_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    part_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 30)] = 16 << 20
    parallel_parts: Annotated[int, Field(ge=1, le=64)] = 4
    part_retries: Annotated[int, Field(ge=0, le=100)] = 5
    retry_initial_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    s3_endpoint_url: (
        Annotated[str, StringConstraints(pattern=r"^https?://[^\s]{1,500}$")] | None
    ) = None

    @model_validator(mode="after")
    def _bounded_read_ahead(self) -> FetchConfig:
        if self.part_bytes * self.parallel_parts > MAX_READ_AHEAD_BYTES:
            raise ValueError(
                f"part_bytes x parallel_parts is the memory each file being read holds: "
                f"{self.part_bytes * self.parallel_parts} bytes, at most {MAX_READ_AHEAD_BYTES}"
            )
        return self


class LoadingConfig(Contract):
    """How a replica loads its targets, and how a background load shares the host with the
    requests being served."""

    # The CPU share of one core each loading thread may take (app.loading.control): hashing and
    # dry-run forwards run in bursts of a few ms with pauses between them. 1 = unpaced. The
    # startup load is never paced: the replica serves nothing until it is done.
    cpu_share: Annotated[float, Field(gt=0, le=1)] = 0.25
    # The model this deployment serves: a manifest naming another model is refused.
    model: Name = "ranker"
    fetch: FetchConfig = FetchConfig()


class RetryConfig(Contract):
    initial_s: Annotated[float, Field(gt=0, le=3600)] = 0.5
    cap_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    max_attempts: Annotated[int, Field(ge=1, le=1000)] = 6


class ControllerRef(Contract):
    """The named Ray actor that replicas report to."""

    name: Name
    namespace: Name = "rollout"


class FaultInjection(Contract):
    """Test-only faults of a replica's rank calls, honoured only in a process whose
    environment has ``ROLLOUT_FAULT_INJECTION=allow`` (elsewhere ignored and reported).

    ``extra_latency_ms`` delays every rank call's answer (other calls keep running);
    ``error_rate`` is the fraction of rank calls that fail.
    """

    extra_latency_ms: Annotated[float, Field(ge=0, le=600_000)] = 0.0
    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.0


MAX_TRUST_ANCHORS: Final = 16
# Names the manifest, the project's signature and the cache's marker already take.
_RESERVED_SIGNATURE_FILES: Final = frozenset(
    {"manifest.json", "manifest.json.sig", ".complete.json"}
)


def _signature_file_name(value: str) -> str:
    if value in _RESERVED_SIGNATURE_FILES or value.startswith("."):
        raise ValueError(f"{value!r} is a name the artifact format reserves")
    return value


_CONTROL_CHARACTERS: Final = frozenset(map(chr, [*range(0x20), 0x7F]))


def _certificate_identity(value: str) -> str:
    # Compared exactly with what a certificate names: a space or control character at either
    # end would never match, and a control character has no place in a name or message.
    if value != value.strip() or _CONTROL_CHARACTERS.intersection(value):
        raise ValueError(
            "a certificate identity is an e-mail, URI or DNS name, or an RFC 4514 subject "
            "(CN=...,O=...), without surrounding spaces or control characters"
        )
    return value


class KeylessSigner(Contract):
    """A Sigstore keyless signer: the identity its short-lived certificate names (an e-mail,
    or a CI workflow's URI) and the OIDC issuer that vouched for it."""

    identity: Annotated[str, StringConstraints(min_length=1, max_length=1000)]
    oidc_issuer: Annotated[
        str, StringConstraints(min_length=9, max_length=1000, pattern=r"^https://")
    ]


class SignatureTrust(Contract):
    """Which signatures make an artifact acceptable.

    With any anchor named, an artifact must carry a signature that verifies with one of them
    (modes side by side: during a move from the project's ed25519 signatures to OpenSSF ones,
    name both keys); with none, signatures are not checked.

    - ``keys``: PEM public keys. An ed25519 key accepts the project's signature over the
      manifest bytes (``manifest.json.sig``); an EC P-256/P-384/P-521 key accepts an OpenSSF
      model signature made with its private key (key mode).
    - ``certificate_chains``: PEM files of CA certificates; an OpenSSF signature whose signing
      certificate chains to them (certificate mode) is accepted.
    - ``certificate_identities``: when any, the signing certificate of certificate mode must
      name one: an e-mail, URI or DNS name among its SANs, or its subject in RFC 4514 form
      (``CN=release,O=Example``), compared exactly (app.openssf_signing).
    - ``keyless``: Sigstore identities whose keyless OpenSSF signatures are accepted, checked
      against ``sigstore_trust_config`` (a Sigstore ClientTrustConfig JSON file: offline), or
      without one against Sigstore's public-good instance (its trust root fetched online).
    - ``signature_file``: where an OpenSSF signature lies in the artifact directory.
    """

    keys: Annotated[list[PathText], Field(max_length=MAX_TRUST_ANCHORS)] = []
    certificate_chains: Annotated[list[PathText], Field(max_length=MAX_TRUST_ANCHORS)] = []
    certificate_identities: Annotated[
        list[
            Annotated[
                str,
                StringConstraints(min_length=1, max_length=1000),
                AfterValidator(_certificate_identity),
            ]
        ],
        Field(max_length=MAX_TRUST_ANCHORS),
    ] = []
    keyless: Annotated[list[KeylessSigner], Field(max_length=MAX_TRUST_ANCHORS)] = []
    sigstore_trust_config: PathText | None = None
    signature_file: Annotated[
        str,
        StringConstraints(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$"),
        AfterValidator(_signature_file_name),
    ] = "model.sig"

    @model_validator(mode="after")
    def _identities_have_chains(self) -> Self:
        if self.certificate_identities and not self.certificate_chains:
            raise ValueError(
                "certificate_identities name the signer of certificate_chains: "
                "set certificate_chains too"
            )
        return self

    @property
    def has_anchors(self) -> bool:
        return bool(self.keys or self.certificate_chains or self.keyless)

    def with_key(self, key: str | None) -> SignatureTrust:
        """This trust with ``key`` (the ``trust_key`` shorthand) among its keys."""
        if key is None or key in self.keys:
            return self
        return self.model_copy(update={"keys": [key, *self.keys]})


class ReplicaConfig(Contract):
    """A ranker deployment's ``user_config``. ``target`` None: an idle pool (no model)."""

    cohort: Role
    target: Target | None = None
    batching: BatchingConfig = BatchingConfig()
    memory: MemoryConfig = MemoryConfig()
    loading: LoadingConfig = LoadingConfig()
    retry: RetryConfig = RetryConfig()
    # The public key artifacts must be signed with (ed25519: the project's signature; EC: an
    # OpenSSF one): shorthand for one entry of ``trust.keys``.
    trust_key: PathText | None = None
    trust: SignatureTrust = SignatureTrust()
    controller: ControllerRef | None = None
    cache_dir: PathText = "var/cache"
    cache_byte_budget: Annotated[int, Field(gt=0, le=MAX_BYTES)] | None = None
    report_interval_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    faults: FaultInjection | None = None  # tests only; see FaultInjection
    # The model families this replica can build (``AppArgs.models``) and the request schema
    # it serves: a target of another schema is refused before anything is fetched.
    models: ModelFamilies = list(DEFAULT_FAMILIES)
    feature_schema: Name = DEFAULT_FEATURE_SCHEMA

    @classmethod
    def from_user_config(cls, raw: Mapping[str, Any] | ReplicaConfig) -> ReplicaConfig:
        return cls.parse(raw, where="user_config")

    @property
    def signature_trust(self) -> SignatureTrust:
        """``trust`` with the ``trust_key`` shorthand folded in."""
        return self.trust.with_key(self.trust_key)

    def with_target(self, target: Target | None) -> ReplicaConfig:
        """This config with ``target``. The target counts as given in full (defaults
        included), so a dump of only the fields given (``exclude_unset``) still spells it
        whole: a replica reads a target as the writer meant it, whatever its defaults."""
        whole = None if target is None else Target.model_validate(target.model_dump())
        return self.model_copy(update={"target": whole})
