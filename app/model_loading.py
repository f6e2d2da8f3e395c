"""Loading a replica's target into a candidate model, and installing it as a generation.

The reconciler (``app.reconciler``) decides when; this does the work: fetch and verify the
artifact through the cache (holding a lease, so the cache does not evict bytes a model was
loaded from), check it is the artifact the target names, load and dry-run it within the memory
budget beside the model now serving (``app.loader``), and hand it to the generation holder.
A background load is paced (``app.load_pacing``) so that it leaves the CPU to the requests
served meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from app.artifact_store import check_uri_allowed
from app.cache import ArtifactCache, Lease
from app.contracts import DEFAULT_FEATURE_SCHEMA, LoadingConfig, LoadTimings, Target
from app.errors import ArtifactRejected
from app.generations import Generation, GenerationHolder
from app.load_control import LoadControl
from app.load_pacing import LoadPacer
from app.loader import CandidateLoad, LoadedModel, load_verified
from app.manifest import Manifest
from app.memory import MemoryBudget
from app.model_family import DEFAULT_FAMILIES, Families, families_for

# What a loader reading a verified cache entry finds when the entry's bytes changed since.
CACHED_BYTES_CHANGED: Final = frozenset({"size", "digest"})


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
    if manifest.model != loading.model:
        raise ArtifactRejected(
            "schema",
            f"manifest is for model {manifest.model!r}; this deployment serves "
            f"{loading.model!r} (loading.model)",
            artifact_id=target.artifact_id,
        )
    if manifest.feature_schema != target.feature_schema:
        raise ArtifactRejected(
            "schema",
            f"manifest feature_schema {manifest.feature_schema!r} differs "
            f"from the target's {target.feature_schema!r}",
            artifact_id=target.artifact_id,
        )


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
        lease = cache.lease(target.manifest_sha256)
        artifact_read = False  # the cache handed out a verified entry, now being read
        current = self._holder.current
        resident = int(getattr(current.model, "param_bytes", 0)) if current else 0
        # The fetch's sink: a cold fetch feeds the weights into the model as it hashes them
        # (read and hashed once in all); the runtime, schema and budget are checked before
        # a byte of them is fetched.
        prepared = CandidateLoad(
            device=self._device,
            budget=self._budget(),
            resident_bytes=resident,
            expect=lambda manifest: check_manifest_for(target, loading, manifest),
            families=families,
        )
        try:
            artifact = cache.fetch_verified(
                target.manifest_uri, target.manifest_sha256, control=control, sink=prepared
            )
            artifact_read = True
            model = load_verified(artifact, control=control, prepared=prepared)
        except ArtifactRejected as exc:
            lease.release()
            if exc.category in CACHED_BYTES_CHANGED and artifact_read:
                # The cached copy changed after it was verified (disk rot, a hand edit): the
                # retry must read the source, not the same bad entry.
                cache.set_aside(target.manifest_sha256)
            raise
        except BaseException:
            lease.release()
            raise
        timings = LoadTimings(
            download=float(artifact.timings.get("fetch_s", 0.0)),
            verify=float(
                artifact.timings.get("verify_s", 0.0) + artifact.timings.get("publish_s", 0.0)
            ),
            load=float(model.timings.get("load", 0.0)),
            dry_run=float(model.timings.get("dry_run", 0.0)),
            paced=control.paused_s,
            fetched_bytes=0 if artifact.cached else artifact.manifest.total_bytes,
            loaded_bytes=model.loaded_bytes,
        )
        return Candidate(target, model, lease, timings)

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
