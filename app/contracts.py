"""Every model that crosses a process boundary between the service's parts, in one module.

Serve hands replicas and the router their ``user_config`` and the application builder its
``args``; replicas push instance reports to the controller actor; the router sends replicas
batches of validated requests; the controller actor answers the CLI. Each of those is one model
here, so a change to the wire is a change to one definition, seen by both sides.

Pure: pydantic and numpy only (no torch, no Ray, no database), so the torch-free controller and
CLI read the same schema the replicas validate. Every model refuses unknown fields by name, and
every number and string is bounded: a config or report that would make a process sleep for
years, allocate without limit or print megabytes is refused where it arrives.

The public HTTP API (request and response bodies of ``/v1/rank`` and ``/v1/status``) is the
other contract, with clients outside the service: ``app.api``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, NamedTuple, Self, overload

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from app.errors import ConfigError
from app.model_family import DEFAULT_FAMILIES

if TYPE_CHECKING:  # WireRequest's arrays: numpy is the replica's and the router's, not the CLI's
    import numpy as np

# --------------------------------------------------------------------------- vocabulary

Cohort = Literal["stable", "canary"]
# The request schema of the default model family (``app.models.ranker_mlp``); a test checks
# the two agree.
DEFAULT_FEATURE_SCHEMA: Final = "ranker-features-v3"
STABLE: Final = "stable"
CANARY: Final = "canary"
COHORTS: Final[tuple[Cohort, Cohort]] = (STABLE, CANARY)
# What a ranker deployment is: one of the two primary cohorts, or the hot standby the router
# answers from only while neither primary cohort can (``StandbyConfig``). The fallback has
# no registry target and takes no part in rollouts: its target comes from the Serve config.
Role = Literal["stable", "canary", "fallback"]
FALLBACK: Final = "fallback"
ROLES: Final[tuple[Role, Role, Role]] = (STABLE, CANARY, FALLBACK)

# Weights are in basis points: 10 000 = 100%.
BASIS_POINTS: Final = 10_000

MiB: Final = 1 << 20
GiB: Final = 1 << 30
# Bounds shared by many fields: generous for any real deployment, small enough that a typo
# (an extra zero group, seconds given as milliseconds) is refused rather than obeyed.
MAX_BYTES: Final = 1 << 50  # 1 PiB
MAX_REQUEST_BODY_BYTES: Final = 8 << 20  # one request's body (app.api.MAX_BODY_BYTES)
MAX_REVISION: Final = (1 << 53) - 1  # exact in JSON numbers
MAX_WALL_CLOCK: Final = 4_102_444_800.0  # 2100-01-01 in Unix seconds
MAX_DURATION_S: Final = 7 * 24 * 3600.0


MAX_TEXT: Final = 4000  # characters of a message or reason
MAX_FIELD_PATH: Final = 400  # characters of a config field path ("user_config.batching....")
MAX_REPORTED_REVISIONS: Final = 1000  # discarded revisions in one instance report
MAX_BATCH_SIZE: Final = 1024  # handle calls a replica's @serve.batch may merge into one forward
MAX_EVALUATION_ENTRIES: Final = 64  # numbers of an offline evaluation a report carries


@overload
def clip_text(text: str, limit: int = ...) -> str: ...
@overload
def clip_text(text: None, limit: int = ...) -> None: ...
def clip_text(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """``text`` cut to fit a bounded field (an exception's message can be any length: a
    state-dict mismatch lists every key), marked with "..." where it was cut."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def _lower(value: str) -> str:
    return value.lower()


Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
PathText = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
# A Python module's dotted import path (a model family: ``app.models.ranker_mlp``).
ImportPath = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
    ),
]
ModelFamilies = Annotated[list[ImportPath], Field(min_length=1, max_length=32)]
Uri = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$"), AfterValidator(_lower)]
Revision = Annotated[int, Field(ge=1, le=MAX_REVISION)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Seconds = Annotated[float, Field(ge=0, le=MAX_DURATION_S)]
WallClock = Annotated[float, Field(ge=0, le=MAX_WALL_CLOCK)]
BasisPoints = Annotated[int, Field(ge=0, le=BASIS_POINTS)]


class Contract(BaseModel):
    """Frozen, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | Self, *, where: str) -> Self:
        """Validate ``raw``; ConfigError names the first bad field as ``where.<path>``."""
        if isinstance(raw, cls):
            return raw
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            path = ".".join(str(p) for p in first.get("loc", ()))
            field = f"{where}.{path}" if path else where
            raise ConfigError(f"{field}: {first.get('msg')}", field=field) from None


class ReplicaPhase(StrEnum):
    """Where a replica stands with its desired target."""

    IDLE = "idle"  # no target at all (an idle pool, or the target was cleared)
    LOADING = "loading"  # working on its desired target (may still serve an older model)
    BACKOFF = "backoff"  # waiting to retry after a transient failure
    READY = "ready"  # serving its desired target
    FAILED = "failed"  # gave up on the desired target; the previous generation serves


class RolloutPhase(StrEnum):
    PENDING = "pending"
    """Accepted and persisted; nothing in the cluster has been changed yet."""

    PREPARING = "preparing"
    """The canary pool has been given the candidate as its target and carries no traffic;
    waiting until every canary replica reports the candidate loaded, verified and ready."""

    SHADOWING = "shadowing"
    """(A plan with a shadow phase.) The canary is ready and carries no user traffic; the
    router copies a sample of stable's requests to it, off the clients' path, and compares the
    rankings. One window per interval is judged against the expected divergence until the
    comparison shows the candidate within it (then the first step) or outside it (rolled
    back before any user was answered by it)."""

    PROGRESSING = "progressing"
    """At ``step_index``: the canary pool is scaled for the step, then the router is given the
    step's weights, then one analysis window per interval is judged until one passes."""

    PAUSED = "paused"
    """Held at a manual gate or by an operator's pause; the weights stay where they are and
    windows are still judged (a failing canary is rolled back even while paused), but nothing
    advances until ``resume`` or ``promote``. The progress deadline does not run."""

    PROMOTING = "promoting"
    """The stable pool is moving to the candidate: ``shift`` first puts the canary at 100%
    then gives stable the candidate with no traffic; ``in_place`` gives stable the candidate
    while it serves. Ends when every stable replica reports the candidate ready."""

    FINALISING = "finalising"
    """Stable serves the candidate; traffic is returned to stable 100% and, once the router
    confirms it, the canary pool is cleared and scaled to its idle size."""

    SUCCEEDED = "succeeded"
    """Terminal: the candidate is the stable model and carries all traffic."""

    ROLLED_BACK = "rolled_back"
    """Terminal: the canary had traffic and was withdrawn (failed checks at the threshold, the
    progress deadline, a canary replica failing, or an operator's rollback); stable serves the
    baseline."""

    FAILED = "failed"
    """Terminal: the rollout could not be carried out (the candidate failed to load, replicas
    never became ready, the stable pool could not take the candidate); stable serves the
    baseline."""

    ABORTED = "aborted"
    """Terminal: an operator aborted the rollout; weights went back to stable first."""

    @property
    def is_terminal(self) -> bool:
        return self.value in TERMINAL_ROLLOUT_PHASES


# The registry stores phases as text: these names finish a rollout there.
TERMINAL_ROLLOUT_PHASES: Final[frozenset[str]] = frozenset(
    {"succeeded", "rolled_back", "failed", "aborted"}
)

OperatorCommandName = Literal["pause", "resume", "promote", "abort", "rollback"]


# --------------------------------------------------------------------------- targets


class Target(Contract):
    """What a cohort should serve: everything a replica needs to fetch and verify it.

    ``revision`` grows with every change of the cohort's target (the registry's
    compare-and-set), so it orders targets: replicas ignore a lower one."""

    revision: Revision
    artifact_id: Name
    manifest_uri: Uri
    manifest_sha256: Sha256
    feature_schema: Name = DEFAULT_FEATURE_SCHEMA

    def same_artifact(self, other: Target) -> bool:
        return (
            self.artifact_id == other.artifact_id and self.manifest_sha256 == other.manifest_sha256
        )


class PublishedTarget(Target):
    """A target as the registry holds it for one (model, environment, cohort)."""

    model: Name
    environment: Name
    cohort: Cohort
    updated_at: Annotated[str, StringConstraints(max_length=64)]  # ISO-8601, UTC

    def target(self) -> Target:
        return Target.model_validate(self.model_dump(include=set(Target.model_fields)))


# --------------------------------------------------------------------------- replica user_config


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


# --------------------------------------------------------------------------- router user_config


StandbyPolicy = Literal["auto", "always", "never"]


class StandbyConfig(Contract):
    """When the router answers from the ``fallback`` deployment (when the app has one).

    Each primary cohort (stable, canary) has a breaker (``app.standby``). It opens after
    ``trip_after_failures`` handle calls in a row failed or timed out (requests coalesced
    into one call count once), or ``trip_after_probes`` status probes in a row found no
    replica answering: one slow request never trips it. While no primary cohort can take a
    request, the fallback answers it.

    Failing back: once probes find an open cohort serving again, and it has been open at
    least ``min_open_s`` (a cohort whose probes answer while its calls fail must not flap
    every probe interval), it takes
    ``half_open_share`` of its traffic (half-open); after ``fail_back_after_s`` of that
    without a failure its share ramps linearly to all of it over ``ramp_s``. A failure in
    either phase opens the breaker again and the window starts over. Which users come back
    first is decided by a hash of their key, so a user does not flip between models. The
    shares hold back traffic only while the fallback can answer and no primary cohort is
    fully available: beside a healthy primary, or with a refused or cold fallback, a
    recovering cohort takes all its traffic.

    ``policy``: ``auto`` uses the fallback only while its offline evaluation (the
    ``accuracy_metric`` of its manifest's ``offline_evaluation``) is worse than stable's by
    at most ``accuracy_margin`` times the size of stable's number, in the metric's direction;
    otherwise requests get 503 + Retry-After rather than a noticeably worse model. The
    direction is ``accuracy_higher_is_better`` when set, else the known metrics' table
    (``app.standby.METRIC_HIGHER_IS_BETTER``); a metric in neither refuses the fallback. The
    guard trusts the numbers the manifests declare: it does not measure them. ``always`` and
    ``never`` are an operator's override either way.

    A fallback that is not serving (cold: no replica up yet, or still loading) makes requests
    wait for it, at most ``cold_queue_max`` at once and each at most ``cold_wait_s``; beyond
    either, 503 + Retry-After."""

    policy: StandbyPolicy = "auto"
    trip_after_failures: Annotated[int, Field(ge=1, le=10_000)] = 5
    trip_after_probes: Annotated[int, Field(ge=1, le=10_000)] = 3
    min_open_s: Annotated[float, Field(ge=0, le=MAX_DURATION_S)] = 5.0
    fail_back_after_s: Annotated[float, Field(ge=0, le=MAX_DURATION_S)] = 120.0
    half_open_share: Annotated[float, Field(gt=0, le=1)] = 0.05
    ramp_s: Annotated[float, Field(ge=0, le=MAX_DURATION_S)] = 30.0
    accuracy_metric: Name = "ndcg_at_10"
    accuracy_margin: Annotated[float, Field(ge=0, le=1)] = 0.05
    # None: the direction comes from the table of known metrics (unknown: refused).
    accuracy_higher_is_better: bool | None = None
    cold_queue_max: Annotated[int, Field(ge=0, le=100_000)] = 64
    cold_wait_s: Annotated[float, Field(ge=0, le=3600)] = 10.0


Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class ShadowRouting(Contract):
    """Mirroring of stable's requests to the canary (a rollout's shadow phase).

    ``fraction_bp`` of the requests that stable answers are sent again to the canary once the
    client has its answer (users sampled by a hash of their key, as bucketing does, so a user
    is mirrored on every request or on none); the copy's answer goes to nobody and is only
    compared with stable's (``app.divergence``). At most ``max_in_flight`` copies are in
    flight at once: a copy that finds them all busy is dropped and counted, so a slow canary
    costs the client nothing. The bound is per router replica: the canary sees up to
    ``router_replicas x max_in_flight`` copies. ``top_k`` and ``rbo_p`` are the comparison's
    parameters."""

    fraction_bp: BasisPoints = 0
    max_in_flight: Annotated[int, Field(ge=1, le=10_000)] = 16
    top_k: Annotated[int, Field(ge=1, le=2048)] = 10
    rbo_p: Annotated[float, Field(gt=0, lt=1)] = 0.9

    @property
    def enabled(self) -> bool:
        return self.fraction_bp > 0


EXPECTED_DIVERGENCE_KEY: Final = "expected_divergence"


class ExpectedDivergence(Contract):
    """How far a candidate's rankings were measured to be from a named baseline's, offline
    (``rollout replay`` over a held-out set; kept in the manifest's
    ``metadata.expected_divergence``). The shadow phase's gate holds the live divergence to
    this band (with the plan's tolerance) when the rollout's baseline is this one, and
    compared with the same ``top_k`` and ``rbo_p``."""

    baseline_artifact_id: Name
    baseline_manifest_sha256: Sha256
    requests: Annotated[int, Field(ge=1, le=1 << 40)]
    top_k: Annotated[int, Field(ge=1, le=2048)]
    rbo_p: Annotated[float, Field(gt=0, lt=1)]
    rbo_mean: Probability
    overlap_mean: Probability
    top1_change_rate: Probability
    max_score_diff_p99: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
    source: Text = ""

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ExpectedDivergence | None:
        """The block of a manifest's metadata, None without one; ConfigError names the
        field."""
        raw = metadata.get(EXPECTED_DIVERGENCE_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"metadata.{EXPECTED_DIVERGENCE_KEY}: a mapping, got {type(raw).__name__}",
                field=f"metadata.{EXPECTED_DIVERGENCE_KEY}",
            )
        return cls.parse(raw, where=f"metadata.{EXPECTED_DIVERGENCE_KEY}")


class RouterConfig(Contract):
    """The router's ``user_config``: changed live through ``reconfigure`` (no restart)."""

    canary_bp: BasisPoints = 0
    salt: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "ranker"
    allow_cohort_header: bool = False
    # Whether an answer names the cohort that gave it (X-Model-Cohort, model.cohort). Off in
    # production: a client that knows its cohort can aim slow or bad requests at the canary,
    # the cohort being judged. Tests, the demo and tools behind the gateway turn it on.
    reveal_cohort: bool = False
    failover: bool = True
    draining: bool = False
    # Admitted work: requests whose body was read and parsed, until they are answered.
    max_in_flight: Annotated[int, Field(ge=1, le=1_000_000)] = 512
    # Bodies are read before admission, under bounds of their own (app.body_reads): a
    # deadline for the whole body (408), how many are read at once and the bytes they hold
    # together (503); the latter at least one body of the largest size (MAX_REQUEST_BODY_BYTES).
    body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    max_body_reads: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    max_body_read_bytes: Annotated[int, Field(ge=MAX_REQUEST_BODY_BYTES, le=MAX_BYTES)] = 256 << 20
    retry_after_s: Annotated[int, Field(ge=1, le=3600)] = 1
    request_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # Coalescing: at most this many handle calls in flight per replica of a cohort (replicas
    # as seen by the router's probes); requests that arrive meanwhile ride together in the
    # next call (up to coalesce_max_batch of them). A replica computes one batch at a time,
    # so a second call in flight mostly splits the next batch in two.
    coalesce_calls_per_replica: Annotated[int, Field(ge=1, le=64)] = 1
    coalesce_max_batch: Annotated[int, Field(ge=1, le=1024)] = 64
    probe_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # Only used when the app has a fallback deployment (AppArgs.fallback).
    standby: StandbyConfig = StandbyConfig()
    # Off unless a rollout's shadow phase turns it on.
    shadow: ShadowRouting = ShadowRouting()
    # False for a canary pool Serve autoscales down to no replica between rollouts: once found
    # holding no model (or gone) at weight 0 with no mirroring, the router stops probing it,
    # since a probe is a request and would start a replica (nor is it then a failover
    # destination, until it gets weight or copies again).
    probe_idle_canary: bool = True

    @classmethod
    def from_user_config(cls, raw: Mapping[str, Any] | RouterConfig) -> RouterConfig:
        return cls.parse(raw, where="user_config")


# --------------------------------------------------------------------------- application args


class CohortArgs(Contract):
    """One ranker deployment (stable, canary or fallback). Serve's ``autoscaling_config``
    for it goes in the Serve config's ``deployments`` list, where Serve changes it in place
    (README "Autoscaling"); ``num_replicas`` is then ignored."""

    num_replicas: Annotated[int, Field(ge=0, le=10_000)] = 1
    num_cpus: Annotated[float, Field(ge=0, le=1024)] = 0.25
    num_gpus: Annotated[float, Field(ge=0, le=64)] = 0.0
    memory_bytes: Annotated[int, Field(gt=0, le=MAX_BYTES)] | None = None
    target: Target | None = None
    # Local configs only: name a demo artifact (e.g. "ranker-v41") instead of a target; it is
    # created under ``demo_artifacts_dir`` when missing and served as ``demo_revision``.
    demo_artifact: Name | None = None
    demo_revision: Revision = 1
    max_ongoing_requests: Annotated[int, Field(ge=1, le=100_000)] = 256
    # Health checks do not run while reconfigure runs, and the startup load happens in
    # reconfigure, so these only need to catch faults of a running replica.
    health_check_period_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    health_check_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    graceful_shutdown_wait_loop_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    graceful_shutdown_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 20.0
    faults: FaultInjection | None = None  # tests only; see FaultInjection


class AppArgs(Contract):
    """The Serve application's ``args`` (``deployments.app:build_app``)."""

    # The model families the replicas can build, by import path (each module's ``FAMILY``,
    # an ``app.model_family.ModelFamily``); a manifest's ``architecture.name`` selects one.
    models: ModelFamilies = list(DEFAULT_FAMILIES)
    # The request schema the HTTP route speaks (one of the families'); None: the first
    # family's. Every cohort serves it: a target made for another schema is refused.
    feature_schema: Name | None = None
    stable: CohortArgs = CohortArgs()
    canary: CohortArgs = CohortArgs(num_replicas=1)
    # The hot standby (RouterConfig.standby says when it answers): typically a smaller model
    # on cheaper capacity. None: no fallback deployment.
    fallback: CohortArgs | None = None
    router: RouterConfig = RouterConfig()
    router_replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    router_num_cpus: Annotated[float, Field(ge=0, le=1024)] = 0.25
    router_max_ongoing_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    # Shared replica settings.
    cache_dir: PathText = "var/cache"
    cache_byte_budget: Annotated[int, Field(gt=0, le=MAX_BYTES)] | None = None
    batching: BatchingConfig = BatchingConfig()
    memory: MemoryConfig = MemoryConfig()
    loading: LoadingConfig = LoadingConfig()
    retry: RetryConfig = RetryConfig()
    trust_key: PathText | None = None  # see ReplicaConfig.trust_key
    trust: SignatureTrust = SignatureTrust()
    controller: ControllerRef | None = None
    report_interval_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    demo_artifacts_dir: PathText | None = None  # local only; see CohortArgs.demo_artifact
    # "router": the full graph. "ranker_only": one stable ranker deployment serving HTTP
    # itself, no router (the benchmark's baseline for the cost of the router hop).
    mode: Literal["router", "ranker_only"] = "router"
    # Serve's per-call access log line costs CPU on every request and every router probe.
    access_log: bool = False


# --------------------------------------------------------------------------- instance reports


class ErrorInfo(Contract):
    """A failure a replica reports: a refused candidate, or a refused config (``field``)."""

    category: Name
    message: Text
    artifact_id: Name | None = None
    revision: Revision | None = None
    field: Annotated[str, StringConstraints(max_length=MAX_FIELD_PATH)] | None = None

    def describe(self) -> str:
        return f"{self.category}: {self.message}"


class LoadTimings(Contract):
    """Seconds each stage of the last successful load took. The cache hashes while it
    downloads (``download``), then fsyncs and publishes (``verify``; a cache hit only
    re-checks); ``load`` reads, hashes and places the weights in one pass; ``paced`` is the
    part of the stages above spent in pacing pauses. ``fetched_bytes`` came from the store
    (0 for a cache hit), ``loaded_bytes`` were read from the cache into the model."""

    download: Seconds = 0.0
    verify: Seconds = 0.0
    load: Seconds = 0.0
    dry_run: Seconds = 0.0
    paced: Seconds = 0.0
    install: Seconds | None = None
    fetched_bytes: Bytes = 0
    loaded_bytes: Bytes = 0
    # A head's backbone that was not resident and was loaded with it (its artifact's bytes;
    # 0: the head alone, on the resident backbone).
    backbone_loaded_bytes: Bytes = 0


class LoadProgress(Contract):
    """The load in progress: its target and how far its current stage is (``fetch``: from
    the store into the cache, hashed; ``verify``: a cache hit re-hashed; ``load``: the
    weights read from the cache, hashed and placed)."""

    revision: Revision
    artifact_id: Name
    stage: Literal["fetch", "verify", "load"]
    done_bytes: Bytes
    total_bytes: Bytes
    elapsed_s: Seconds

    def describe(self) -> str:
        """e.g. ``loading 3.1/7.0 GiB``."""
        verb = {"fetch": "fetching", "verify": "verifying", "load": "loading"}[self.stage]
        return f"{verb} {_size_pair(self.done_bytes, self.total_bytes)}"


def _size_pair(done: int, total: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if total >= scale:
            return f"{done / scale:.1f}/{total / scale:.1f} {unit}"
    return f"{done}/{total} B"


class MemoryFigures(Contract):
    """What a replica holds, what it could hold, and what loading the model it serves took
    alone (its load's estimate, margin included): enough to tell whether a candidate fits
    beside the resident model (an in-place promotion)."""

    resident_bytes: Bytes = 0
    capacity_bytes: Bytes | None = None
    load_peak_bytes: Bytes | None = None
    # Of ``resident_bytes``, the backbone a serving head shares (0: a whole model): a head
    # on another backbone needs that much more beside what its load alone took.
    backbone_bytes: Bytes = 0


class Capacity(Contract):
    max_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None = None
    device: Annotated[str, StringConstraints(max_length=64)] = "cpu"
    memory: MemoryFigures = MemoryFigures()


class InstanceReport(Contract):
    """What a replica tells the rollout controller, on change and every report interval."""

    replica_id: Name
    cohort: Role | None  # None until its first user_config
    pid: Annotated[int, Field(ge=0, le=1 << 32)]
    phase: ReplicaPhase
    desired_revision: Revision | None = None
    desired_artifact: Name | None = None
    actual_revision: Revision | None = None
    actual_artifact: Name | None = None
    # The backbone artifact the serving head runs on (None: a whole model, or nothing).
    actual_backbone: Name | None = None
    # SHA-256 of the trust anchors in force (app.trust.anchors_digest; None: none): replicas
    # that disagree trust different keys (a ConfigMap update not seen by all yet).
    trust_anchors: Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")] | None = None
    runtime_build: Annotated[str, StringConstraints(max_length=200)] | None = None
    # The latest of the last load failure and the last refused (or partly ignored) config.
    last_error: ErrorInfo | None = None
    # The latest revisions loaded but never installed (superseded or refused).
    discarded_revisions: Annotated[
        tuple[Revision, ...], Field(max_length=MAX_REPORTED_REVISIONS)
    ] = ()
    # The latest revisions whose load was stopped before it finished (a newer target, or
    # none, arrived meanwhile): never installed either, and cheaper than loaded-and-dropped.
    cancelled_revisions: Annotated[
        tuple[Revision, ...], Field(max_length=MAX_REPORTED_REVISIONS)
    ] = ()
    timings: LoadTimings = LoadTimings()
    # The load in progress (None when none runs): what ``rollout status`` shows as
    # "loading 3.1/7.0 GiB" beside the replica.
    progress: LoadProgress | None = None
    # Wall clock at which the generation now serving was installed: "serving since", and
    # where a load ends when latency traces are lined up with it.
    installed_at: WallClock | None = None
    capacity: Capacity = Capacity()
    heartbeat: WallClock  # wall clock (time.time()) of the report
    seq: Annotated[int, Field(ge=0, le=MAX_REVISION)]  # grows with every report of a replica
    # Which run of the replica's reporter counted ``seq`` (a random id it picks at start): a
    # restarted replica counts from 1 again, so seq orders reports of one incarnation only.
    # None (an older sender): the pid stands in for it.
    incarnation: Name | None = None
    # Background threads (the reconciler's worker, the reporter) that died of an unexpected
    # error and were restarted, and the last such error (category "internal").
    thread_restarts: Annotated[int, Field(ge=0, le=MAX_REVISION)] = 0
    thread_crash: ErrorInfo | None = None
    # The refused or partly ignored current user_config, if any (category "config", field).
    config_error: ErrorInfo | None = None
    # Fault injection in effect (tests only; None when off or not allowed here).
    faults: FaultInjection | None = None
    # The numbers of the serving model's offline evaluation (its manifest's
    # ``metadata.offline_evaluation``): the router's accuracy guard compares the fallback's
    # with stable's.
    evaluation: Annotated[
        dict[Name, Annotated[float, Field(allow_inf_nan=False)]],
        Field(max_length=MAX_EVALUATION_ENTRIES),
    ] = {}

    @property
    def serving(self) -> bool:
        return self.actual_revision is not None


# --------------------------------------------------------------------------- hot standby

BreakerStateName = Literal["closed", "open", "half_open", "ramping"]


class BreakerView(Contract):
    """A primary cohort's standby breaker, as one router replica sees it."""

    cohort: Cohort
    state: BreakerStateName
    in_state_s: Seconds  # since the breaker entered ``state``
    # The share of the cohort's own traffic it takes now (1 closed, 0 open).
    share: Annotated[float, Field(ge=0, le=1)]
    # Until its share is back to 1 if nothing fails meanwhile (None while open: that waits
    # for the cohort to serve again; 0 when closed).
    fail_back_in_s: Seconds | None = None
    opened: Annotated[int, Field(ge=0)] = 0  # times it opened since the router started
    reason: Text | None = None  # why it last opened


class StandbyView(Contract):
    """The hot standby as one router replica sees it (``/v1/status``, ``rollout status``)."""

    policy: Name
    # No primary cohort can take all traffic (its breaker closed and a model serving), after
    # one did; since when, while it lasts.
    primaries_down: bool
    down_s: Seconds | None = None
    # Primaries down and the fallback answering (ready and allowed); else their requests
    # get 503 + Retry-After.
    serving_from_fallback: bool
    ready: bool  # a fallback replica serves a verified model
    allowed: bool  # the accuracy guard (or the operator's policy) lets the fallback answer
    allowed_reason: Text
    metric: Name
    fallback_metric: float | None = None
    stable_metric: float | None = None
    answered: Annotated[int, Field(ge=0)] = 0  # requests the fallback answered so far
    waiting: Annotated[int, Field(ge=0)] = 0  # requests waiting for a cold fallback now
    breakers: tuple[BreakerView, ...] = ()


# --------------------------------------------------------------------------- the data path


class WireRequest(NamedTuple):
    """One validated rank request as the router hands it to a replica.

    A NamedTuple, not a model: it is pickled once per request on the hot path, validated once
    at the HTTP edge (the family's ``app.model_family.RequestSchema``) and not again, and
    carries the features as float32 arrays that the model consumes as they are. Their widths
    are the family's: ``features`` per candidate, ``query`` per request (a two-tower family's
    user features; None for a family without request-level numbers)."""

    candidate_ids: tuple[str, ...]
    features: np.ndarray  # float32 [candidates, features]; NaN = missing
    context: Mapping[str, str | int | float]
    top_n: int
    query: np.ndarray | None = None  # float32 [query features]; NaN = missing


class ModelMeta(NamedTuple):
    """Which model answered: on every answer, and in its headers."""

    artifact_id: str
    revision: int
    cohort: str
    runtime_build: str
    replica: str
    backbone: str | None = None  # the backbone artifact a head runs on


class WireAnswer(NamedTuple):
    """A replica's answer to one handle call: one generation served the whole call."""

    model: ModelMeta
    rankings: list[list[tuple[str, float, str]]]  # per request: (id, score, label)


# --------------------------------------------------------------------------- the controller


class ControllerSettings(Contract):
    """Where the controller actor finds everything (given to the actor when it is created)."""

    registry_url: Uri
    dashboard_url: Uri
    model: Name = "ranker"
    environment: Name = "default"
    app_name: Name = "ranker"
    router_deployment: Name = "router"
    stable_deployment: Name = "stable"
    canary_deployment: Name = "canary"
    tick_interval_s: Annotated[float, Field(gt=0, le=300)] = 1.0
    # Reports older than this do not count as a replica's state.
    report_stale_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # The router hands its counts to Ray within a second and Ray exports them once per report
    # interval (``metrics_report_interval_ms``): the first window after a weight change starts
    # at least this long after the weights went live, so that no request answered under the
    # previous weights is counted in it. The controller raises it to what the interval it
    # observes in its cluster needs (rollout.engine.window_delay_s).
    metrics_delay_s: Annotated[float, Field(ge=0, le=600)] = 2.0
    # Empty: discover every node's metrics endpoint through Ray.
    metrics_endpoints: Annotated[tuple[Uri, ...], Field(max_length=10_000)] = ()
    prometheus_url: Uri | None = None  # set: use PromQL instead of scraping
    actor: Name = "rollout-controller"  # who the audit log says moved a target


class WeightsView(Contract):
    stable_bp: BasisPoints
    canary_bp: BasisPoints


class HoldView(Contract):
    since: WallClock
    reason: Text


EValue = Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)]


class EvidenceView(Contract):
    """One check's evidence after a window (sequential judge): its e-values against the
    canary and for it, and the bounds that fail it (``fail_at``) and pass it (``pass_at``).
    The sample-ratio guard neither fails nor passes a canary: it has ``hold_at`` instead."""

    check: Name
    against: EValue
    supporting: EValue | None = None
    fail_at: EValue | None = None
    pass_at: EValue | None = None
    hold_at: EValue | None = None


class VerdictView(Contract):
    step: Annotated[int, Field(ge=-1, le=BASIS_POINTS)]  # as RolloutSummary.step
    outcome: Name
    reasons: tuple[Text, ...] = ()
    evidence: Annotated[tuple[EvidenceView, ...], Field(max_length=32)] = ()


class RolloutEvent(Contract):
    """One entry of a rollout's event log (persisted with its state, shown by status)."""

    key: Name | None = None  # an audit record's idempotency key: replays are dropped
    event: Name
    message: Text
    at: WallClock
    canary_bp: BasisPoints | None = None  # weight events


class ShadowView(Contract):
    """The shadow phase as far as it went: how much is mirrored, what the comparisons saw
    over the phase (``max_score_diff_p99``: the last window's), and what the gate holds them
    to (``basis``)."""

    fraction_bp: BasisPoints
    live: bool  # the router was observed mirroring
    basis: Text
    compared: Annotated[int, Field(ge=0)] = 0
    dropped: Annotated[int, Field(ge=0)] = 0
    errors: Annotated[int, Field(ge=0)] = 0
    rbo_mean: Probability | None = None
    overlap_mean: Probability | None = None
    top1_change_rate: Probability | None = None
    max_score_diff_p99: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    windows: Annotated[int, Field(ge=0)] = 0

    def describe(self) -> str:
        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        top1 = None if self.top1_change_rate is None else self.top1_change_rate * 100
        if self.fraction_bp:
            live = "live" if self.live else "not confirmed"
            state = f"mirroring {self.fraction_bp / 100:g}% ({live})"
        else:
            state = "mirroring off"
        return (
            f"shadow: {state} | {self.compared} compared, "
            f"{self.dropped} dropped, {self.errors} unanswered | mean RBO "
            f"{num(self.rbo_mean, '.3f')}, top-k overlap {num(self.overlap_mean, '.3f')}, "
            f"top-1 changed {num(top1, '.1f')}%"
            f", p99 max score diff {num(self.max_score_diff_p99, '.4f')} | gate: {self.basis}"
        )


class RolloutSummary(Contract):
    """The rollout the controller drives; ``rollout`` None (and nothing else) when none."""

    rollout: Name | None = None
    model: Name | None = None
    candidate: Name | None = None
    baseline: Name | None = None
    phase: RolloutPhase | None = None
    finished: bool | None = None
    step: Annotated[int, Field(ge=-1, le=BASIS_POINTS)] | None = None  # -1: before the first
    # (a plan has at most one step per basis point of weight)
    step_percent: Annotated[float, Field(ge=0, le=100)] | None = None
    steps: tuple[float, ...] = ()
    weights: WeightsView | None = None
    failed_checks: Annotated[int, Field(ge=0)] | None = None
    reason: Text | None = None
    pending_gate: Name | None = None
    held: HoldView | None = None
    shadow: ShadowView | None = None
    verdicts: tuple[VerdictView, ...] = ()
    events: tuple[RolloutEvent, ...] = ()


class CommandAccepted(RolloutSummary):
    queued: OperatorCommandName


class ReplicaRow(Contract):
    """One replica as ``rollout status`` lists it."""

    replica: Name
    cohort: Role | None
    phase: ReplicaPhase
    desired: Name | None
    desired_revision: Revision | None = None
    actual: Name | None
    actual_revision: Revision | None
    error: Text | None
    age_s: float
    progress: LoadProgress | None = None
    backbone: Name | None = None  # the backbone the serving head runs on
    trust_anchors: Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")] | None = None


class CohortWindowView(Contract):
    requests: Annotated[int, Field(ge=0)]  # whole requests, as the judge counts them
    rps: Annotated[float, Field(ge=0)]
    error_rate: Annotated[float, Field(ge=0, le=1)] | None
    p50_ms: Annotated[float, Field(ge=0)] | None
    p99_ms: Annotated[float, Field(ge=0)] | None


class WindowView(Contract):
    start: WallClock
    end: WallClock
    canary: CohortWindowView | None
    stable: CohortWindowView | None


class ControllerStatus(RolloutSummary):
    """``rollout status``: the rollout, the registry's targets (None: the registry could not
    be read), the replicas' last reports, the last metrics window, alerts and errors."""

    targets: tuple[PublishedTarget, ...] | None = None
    replicas: tuple[ReplicaRow, ...] = ()
    last_window: WindowView | None = None
    alerts: tuple[Text, ...] = ()
    errors: tuple[Text, ...] = ()
    # Instance reports refused where they arrived (invalid, or a heartbeat too far ahead of
    # the controller's clock) since the controller started (rollout.reports.ReportStore).
    reports_refused: Annotated[int, Field(ge=0)] = 0
    # The router's hot standby (None: the app has no fallback, or the router did not answer).
    standby: StandbyView | None = None


class ControllerPing(ControllerSettings):
    """The controller actor is up: its process, ticks so far and the drift it repaired."""

    pid: Annotated[int, Field(ge=0, le=1 << 32)]
    # The Ray node it runs on (hex ID; None: a controller older than this field).
    node_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,128}$")] | None = None
    ticks: Annotated[int, Field(ge=0)]
    repaired: tuple[Text, ...] | None
    # Ray's metrics report interval as the controller's process reads it (None: unread, or a
    # controller older than these fields), and how long after a weight change its first
    # window starts because of it.
    metrics_export_interval_s: Annotated[float, Field(ge=0, le=3600)] | None = None
    window_delay_s: Annotated[float, Field(ge=0, le=7200)] | None = None
