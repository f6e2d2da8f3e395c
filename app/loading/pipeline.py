"""Loading a replica's target into a candidate model, and installing it as a generation.

The reconciler (``app.reconciler``) decides when; this does the work: fetch and verify the
artifact through the cache (holding a lease, so the cache does not evict bytes a model was
loaded from), check it is the artifact the target names, load and dry-run it within the memory
budget beside the model now serving (``app.loading.candidate``), and hand it to the generation
holder. A background load is paced (``app.loading.control``) so that it leaves the CPU to the
requests served meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from app.artifact_store import check_uri_allowed, shown_uri
from app.cache import ArtifactCache, Lease, VerifiedArtifact
from app.compatibility import check_model
from app.contracts import DEFAULT_FEATURE_SCHEMA, LoadingConfig, LoadTimings, Target
from app.errors import ArtifactRejected
from app.generations import Generation, GenerationHolder
from app.loading.backbones import BackboneFreed, ResidentBackbone
from app.loading.candidate import CandidateLoad, load_backbone, load_verified
from app.loading.control import LoadControl, LoadPacer
from app.loading.failures import RETRYABLE_CATEGORIES
from app.loading.memory import MemoryBudget
from app.loading.model import LoadedModel
from app.manifest import BackboneRef, Manifest, backbone_manifest_uri
from app.model_family import DEFAULT_FAMILIES, Families, families_for

# What a loader reading a verified cache entry finds when the entry's bytes changed since.
CACHED_BYTES_CHANGED: Final = frozenset({"size", "digest"})
# Refusals of a head's backbone that a later attempt may meet are what the reconciler retries
# (app.loading.failures): kept as they are rather than made a final ``backbone`` refusal.
RETRYABLE_BACKBONE_CATEGORIES: Final = RETRYABLE_CATEGORIES


@dataclass
class Candidate:
    """A loaded, dry-run-validated model that is not serving yet."""

    target: Target
    model: LoadedModel
    lease: Lease
    timings: LoadTimings
    handed_over: bool = False  # given to the generation holder, which owns its cleanup


def close_model(model: Any, lease: Lease | None) -> None:
    """Close a model that will not serve (any more) and release its cache lease."""
    try:
        model.close()
    finally:
        if lease is not None:
            lease.release()


def check_manifest_for(target: Target, loading: LoadingConfig, manifest: Manifest) -> None:
    """The manifest is the one the target names, for the model this deployment serves."""
    if manifest.artifact_id != target.artifact_id:
        raise ArtifactRejected(
            "manifest_digest",
            f"manifest names artifact {manifest.artifact_id!r}, the target "
            f"says {target.artifact_id!r}",
            artifact_id=target.artifact_id,
        )
    check_model(manifest, loading.model, "loading.model")
    if manifest.feature_schema != target.feature_schema:
        raise ArtifactRejected(
            "schema",
            f"manifest feature_schema {manifest.feature_schema!r} differs "
            f"from the target's {target.feature_schema!r}",
            artifact_id=target.artifact_id,
        )


class BackboneShelf:
    """The backbones resident in one replica, by artifact id and manifest digest: where a
    head finds the backbone it pins. A backbone stays while a model uses it (its
    ``ResidentBackbone`` counts them) and holds the cache lease of its bytes until then;
    the shelf forgets it when its last user releases it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._resident: dict[tuple[str, str], ResidentBackbone] = {}
        self._leases: dict[int, Lease] = {}  # id(backbone) -> its cache entry's lease

    def acquire(self, ref: BackboneRef) -> ResidentBackbone | None:
        with self._lock:
            found = self._resident.get((ref.artifact_id, ref.manifest_sha256))
        if found is None:
            return None
        try:
            return found.acquire()
        except BackboneFreed:  # its last user let it go meanwhile
            return None

    def add(self, backbone: ResidentBackbone, lease: Lease) -> ResidentBackbone:
        """Shelve a freshly loaded backbone; returns it with one use for the caller."""
        backbone.acquire()
        with self._lock:
            self._resident[(backbone.artifact_id, backbone.manifest_sha256)] = backbone
            self._leases[id(backbone)] = lease
        return backbone

    def freed(self, backbone: ResidentBackbone) -> None:
        """``ResidentBackbone.on_free``: its last user released it (its lease goes too,
        whether or not another load of the same backbone took its place meanwhile)."""
        key = (backbone.artifact_id, backbone.manifest_sha256)
        with self._lock:
            if self._resident.get(key) is backbone:
                del self._resident[key]
            lease = self._leases.pop(id(backbone), None)
        if lease is not None:
            lease.release()

    @property
    def resident(self) -> list[ResidentBackbone]:
        with self._lock:
            return list(self._resident.values())


class ModelLoader:
    """The reconciler's load/install/discard/retire steps (``app.reconciler.TargetLoader``)
    for real artifacts, installing into the replica's generation holder.

    ``cache``, ``budget``, ``cpu_share`` and ``loading`` are asked at each load, so a load uses
    the config in effect when it starts. ``loading`` says which model this deployment serves (a
    manifest naming another is refused) and which URI schemes a target may use. The holder's
    cleanup must call ``clean_up``: a generation keeps its cache lease (its bytes stay in the
    cache) until it is cleaned up."""

    def __init__(
        self,
        *,
        cache: Callable[[], ArtifactCache],
        holder: GenerationHolder,
        budget: Callable[[], MemoryBudget],
        device: torch.device,
        on_installed: Callable[[Candidate], None],
        cpu_share: Callable[[], float | None] = lambda: None,
        loading: Callable[[], LoadingConfig] = LoadingConfig,
        serving: Callable[[], tuple[Families, str]] = lambda: (
            families_for(DEFAULT_FAMILIES),
            DEFAULT_FEATURE_SCHEMA,
        ),
    ) -> None:
        self._on_installed = on_installed
        self._serving = serving
        self._loading = loading
        self._cpu_share = cpu_share  # None: an unpaced load
        self._cache = cache
        self._holder = holder
        self._leases: dict[int, Lease] = {}  # id(model) -> lease, while its generation lives
        self._budget = budget
        self._device = device
        self.backbones = BackboneShelf()

    def load(self, target: Target, control: LoadControl | None = None) -> Candidate:
        families, schema = self._serving()
        if target.feature_schema != schema:
            raise ArtifactRejected(
                "schema",
                f"target feature_schema {target.feature_schema!r}; this deployment serves "
                f"{schema!r} (feature_schema)",
                artifact_id=target.artifact_id,
            )
        loading = self._loading()
        # Before anything is opened: a scheme this deployment does not read from is a refusal
        # of the target, whatever the cache's own defaults allow.
        try:
            check_uri_allowed(target.manifest_uri, loading.fetch.schemes)
        except ArtifactRejected as exc:
            exc.artifact_id = target.artifact_id
            raise
        cache = self._cache()
        share = self._cpu_share()
        control = control or LoadControl()
        if share is not None:
            control.pacer = LoadPacer(share)  # a share of 1 never pauses
        current = self._holder.current
        resident = int(getattr(current.model, "param_bytes", 0)) if current else 0
        # The fetch's sink: a cold fetch feeds the weights into the model as it hashes them
        # (read and hashed once in all); the runtime, schema and budget are checked before
        # a byte of them is fetched.
        budget = self._budget()
        backbone_read: dict[str, int] = {}

        def backbone_for(head: Manifest) -> ResidentBackbone:
            return self._backbone_for(
                head, target, cache, control, budget, resident, families, backbone_read
            )

        prepared = CandidateLoad(
            device=self._device,
            budget=budget,
            resident_bytes=resident,
            expect=lambda manifest: check_manifest_for(target, loading, manifest),
            families=families,
            backbones=backbone_for,
        )
        fetched = fetch_and_load(
            cache, target.manifest_uri, target.manifest_sha256, prepared, control=control
        )
        artifact, model, lease = fetched.artifact, fetched.model, fetched.lease
        timings = LoadTimings(
            download=float(artifact.timings.get("fetch_s", 0.0)),
            verify=float(
                artifact.timings.get("verify_s", 0.0) + artifact.timings.get("publish_s", 0.0)
            ),
            load=float(model.timings.get("load", 0.0)),
            dry_run=float(model.timings.get("dry_run", 0.0)),
            paced=control.paused_s,
            fetched_bytes=(0 if artifact.cached else artifact.manifest.total_bytes)
            + backbone_read.get("fetched", 0),
            loaded_bytes=model.loaded_bytes + backbone_read.get("loaded", 0),
            backbone_loaded_bytes=backbone_read.get("placed", 0),
        )
        return Candidate(target, model, lease, timings)

    def _backbone_for(
        self,
        head: Manifest,
        target: Target,
        cache: ArtifactCache,
        control: LoadControl,
        budget: MemoryBudget,
        resident: int,
        families: Families,
        read: dict[str, int],
    ) -> ResidentBackbone:
        """The backbone ``head`` pins, with a use for it: the resident one, or else loaded
        from beside the head in its store (within the budget beside the serving model)."""
        assert head.backbone is not None
        found = self.backbones.acquire(head.backbone)
        if found is not None:
            return found
        pinned = load_pinned_backbone(
            cache,
            head,
            target.manifest_uri,
            device=self._device,
            budget=budget,
            resident_bytes=resident,
            families=families,
            control=control,
            on_free=self.backbones.freed,
        )
        read["fetched"] = pinned.fetched_bytes
        read["loaded"] = pinned.backbone.loaded_bytes
        read["placed"] = pinned.backbone.manifest.total_bytes
        return self.backbones.add(pinned.backbone, pinned.lease)

    def install(self, target: Target, loaded: Candidate) -> bool:
        started = time.perf_counter()
        self._holder.set_desired(target.revision, target.artifact_id)
        generation = Generation(
            revision=target.revision, artifact_id=target.artifact_id, model=loaded.model
        )
        # The lease is released by the holder's cleanup when this generation retires.
        self._leases[id(loaded.model)] = loaded.lease
        loaded.handed_over = True
        if not self._holder.install(generation):
            # The holder cleaned the refused generation up (model closed, lease released).
            return False
        loaded.timings = loaded.timings.model_copy(
            update={"install": time.perf_counter() - started}
        )
        self._on_installed(loaded)
        return True

    def discard(self, loaded: Candidate) -> None:
        if not loaded.handed_over:
            close_model(loaded.model, loaded.lease)

    def retire(self) -> None:
        # The holder's cleanup (model closed, lease released) runs when borrowers are done.
        self._holder.retire_current()

    def clean_up(self, generation: Generation) -> None:
        """The holder's cleanup of a retired or refused generation."""
        model = generation.model
        close_model(model, self._leases.pop(id(model), None))


@dataclass
class FetchedModel:
    """A model loaded from a verified cache entry, and the lease that keeps the entry (release
    it when the model is closed)."""

    artifact: VerifiedArtifact
    model: LoadedModel
    lease: Lease


def fetch_and_load(
    cache: ArtifactCache,
    manifest_uri: str,
    manifest_sha256: str,
    prepared: CandidateLoad,
    *,
    control: LoadControl | None = None,
    recheck: Literal["sizes", "digests"] = "sizes",
) -> FetchedModel:
    """The pipeline every load takes, a replica's (``ModelLoader``) and ``rollout verify
    --load``'s: the entry leased, fetched and verified through the cache (a cold fetch feeds
    ``prepared`` as its bytes are hashed, so they are read once), then strictly loaded and
    dry-run (``load_verified``). ``prepared`` says what the caller checks of the manifest
    (``expect``), the device, the budget and where a head finds its backbone. On failure
    ``prepared`` is abandoned and the lease released; a cached entry whose bytes changed
    after it was verified (disk rot, a hand edit) is set aside, so a retry reads the source
    instead of the same bad entry."""
    lease = cache.lease(manifest_sha256)
    artifact: VerifiedArtifact | None = None
    try:
        artifact = cache.fetch_verified(
            manifest_uri, manifest_sha256, recheck=recheck, control=control, sink=prepared
        )
        model = load_verified(artifact, control=control, prepared=prepared)
    except ArtifactRejected as exc:
        prepared.abandon()
        lease.release()
        if (
            exc.category in CACHED_BYTES_CHANGED
            and artifact is not None
            and exc.artifact_id in (None, artifact.manifest.artifact_id)  # not its backbone's
        ):
            cache.set_aside(manifest_sha256)
        raise
    except BaseException:
        prepared.abandon()
        lease.release()
        raise
    return FetchedModel(artifact, model, lease)


@dataclass
class PinnedBackbone:
    backbone: ResidentBackbone  # no use taken yet
    lease: Lease  # of its cache entry: release it when the backbone is freed
    fetched_bytes: int  # from the store (0: a cache hit)


def load_pinned_backbone(
    cache: ArtifactCache,
    head: Manifest,
    head_manifest_uri: str,
    *,
    device: torch.device,
    budget: MemoryBudget | None,
    resident_bytes: int,
    families: Families,
    control: LoadControl | None = None,
    on_free: Callable[[ResidentBackbone], None] | None = None,
    recheck: Literal["sizes", "digests"] = "sizes",
) -> PinnedBackbone:
    """Fetch, verify and load the backbone ``head`` pins from beside the head in its store
    (``app.manifest.backbone_manifest_uri``), within ``budget`` beside ``resident_bytes``.

    What a retry may cure keeps its (retryable) category, named for the backbone: ``budget``,
    ``missing``, and ``size``/``digest`` (bytes flipped in transit, or a cache entry changed
    after it was verified, which is set aside so the retry reads the source). Anything else
    is ArtifactRejected("backbone") of the head: a backbone that is not one, of another id,
    that the service cannot load."""
    ref = head.backbone
    if ref is None:
        raise ValueError(f"{head.artifact_id} is no head")
    try:
        uri = backbone_manifest_uri(head_manifest_uri, ref)
    except ArtifactRejected as exc:
        raise ArtifactRejected(exc.category, exc.detail, artifact_id=head.artifact_id) from None
    lease = cache.lease(ref.manifest_sha256)
    read_started = False

    def expect(manifest: Manifest) -> None:
        if manifest.artifact_id != ref.artifact_id:
            raise ArtifactRejected(
                "backbone",
                f"the manifest at {shown_uri(uri)} names artifact {manifest.artifact_id!r}, "
                f"the head pins {ref.artifact_id!r}",
            )

    sink = CandidateLoad(
        device=device,
        budget=budget,
        resident_bytes=resident_bytes,
        expect=expect,
        families=families,
        role="backbone",
    )
    try:
        artifact = cache.fetch_verified(
            uri, ref.manifest_sha256, recheck=recheck, control=control, sink=sink
        )
        read_started = True
        backbone = load_backbone(artifact, control=control, prepared=sink, on_free=on_free)
    except ArtifactRejected as exc:
        lease.release()
        if exc.category in CACHED_BYTES_CHANGED and read_started:
            cache.set_aside(ref.manifest_sha256)
        where = (
            f"head pins backbone {ref.artifact_id} ({ref.manifest_sha256[:12]}), which is not "
            f"resident and cannot be loaded from {shown_uri(uri)}"
        )
        if exc.category in RETRYABLE_BACKBONE_CATEGORIES:
            # The backbone's id on it: the head's own cache entry is not what changed.
            raise ArtifactRejected(
                exc.category, f"{where}: {exc.detail}", artifact_id=ref.artifact_id
            ) from None
        raise ArtifactRejected(
            "backbone", f"{where}: {exc}", artifact_id=head.artifact_id
        ) from None
    except BaseException:
        lease.release()
        raise
    fetched = 0 if artifact.cached else artifact.manifest.total_bytes
    return PinnedBackbone(backbone, lease, fetched)
