"""What a replica tells the rollout controller (``InstanceReport``): its phase and
targets, the last error, load timings and progress, and its memory and capacity."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from app.contracts.replica_config import FaultInjection
from app.contracts.vocabulary import (
    MAX_BATCH_SIZE,
    MAX_EVALUATION_ENTRIES,
    MAX_FIELD_PATH,
    MAX_REPORTED_REVISIONS,
    MAX_REVISION,
    Bytes,
    Contract,
    Name,
    ReplicaPhase,
    Revision,
    Role,
    Seconds,
    Text,
    WallClock,
)


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
