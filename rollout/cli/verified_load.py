"""Fetching an artifact into the verified cache and loading it strictly, as ``rollout verify
--load`` does it and ``rollout replay`` does it for both its artifacts: every byte hashed (a
cache hit re-hashed), the manifest checked servable before a weights byte is read, a head's
pinned backbone fetched from beside it and loaded first, then a strict load and a dry run.

Torch and the cache are imported inside the functions: the CLI starts without them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import ArtifactRejected
from app.manifest import Manifest

if TYPE_CHECKING:  # imported where used: the CLI starts without torch or the cache
    from app.cache import ArtifactCache, VerifiedArtifact
    from app.loader import CandidateLoad, LoadedModel
    from rollout.cli.progress import Bars


def servable_check(model: str) -> Callable[[Manifest], None]:
    """What the manifest says decides whether the service could ever serve it: no weights
    need loading to refuse an unknown runtime, schema, precision or architecture."""
    from app.compatibility import check_compatibility

    def servable(manifest: Manifest) -> None:
        if manifest.model != model:
            raise ArtifactRejected(
                "schema",
                f"manifest is for model {manifest.model!r}; the service serves {model!r} (--model)",
                artifact_id=manifest.artifact_id,
            )
        check_compatibility(manifest)

    return servable


def candidate_load(
    memory_budget: int | None,
    servable: Callable[[Manifest], None],
    cache: ArtifactCache,
    manifest_uri: str,
) -> CandidateLoad:
    """The load of ``verify --load``; a head's pinned backbone is fetched from beside it,
    every byte re-hashed like the head's, and loaded first (within the budget)."""
    from app.loader import CandidateLoad, ResidentBackbone, default_device
    from app.memory import MemoryBudget
    from app.model_family import SHIPPED_FAMILIES, families_for
    from app.model_loading import load_pinned_backbone

    budget = MemoryBudget(capacity_bytes=memory_budget) if memory_budget else None
    device = default_device()

    def backbones(head: Manifest) -> ResidentBackbone:
        pinned = load_pinned_backbone(
            cache,
            head,
            manifest_uri,
            device=device,
            budget=budget,
            resident_bytes=0,
            families=families_for(SHIPPED_FAMILIES),
            on_free=lambda _backbone: pinned.lease.release(),
            recheck="digests",
        )
        return pinned.backbone.acquire()

    return CandidateLoad(device=device, budget=budget, expect=servable, backbones=backbones)


def fetch_servable(
    cache: ArtifactCache,
    manifest_uri: str,
    manifest_sha256: str,
    servable: Callable[[Manifest], None],
    prepared: CandidateLoad | None,
    bars: Bars,
) -> VerifiedArtifact:
    """``verify``'s fetch: into the verified cache, a hit re-hashed (every byte checked), the
    manifest checked servable; a cold fetch feeds ``prepared`` as it hashes."""
    from app.load_control import LoadControl
    from rollout.cli.progress import watching

    try:
        with watching(LoadControl(), bars) as control:
            artifact = cache.fetch_verified(
                manifest_uri, manifest_sha256, recheck="digests", control=control, sink=prepared
            )
        servable(artifact.manifest)
    except BaseException:
        if prepared is not None:
            prepared.abandon()  # a head's use of its backbone, and that one's cache lease
        raise
    return artifact


def load_strictly(
    cache: ArtifactCache,
    artifact: VerifiedArtifact,
    manifest_sha256: str,
    prepared: CandidateLoad,
    bars: Bars,
) -> LoadedModel:
    """``verify --load``'s load: build, strictly load and dry-run, with the load's bar."""
    from app.load_control import LoadControl
    from app.loader import load_verified
    from rollout.cli.progress import watching

    with cache.lease(manifest_sha256), watching(LoadControl(), bars) as control:
        return load_verified(artifact, control=control, prepared=prepared)


def verified_model(
    cache: ArtifactCache, directory: Path, manifest_sha256: str, model: str, bars: Bars
) -> LoadedModel:
    """The artifact in ``directory`` as ``verify --load`` takes it: every byte verified into
    the cache, servable, strictly loaded and dry-run."""
    from app.artifact_store import manifest_uri_for
    from app.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, sha256_hex

    # The cache finds an entry by its digest alone: the directory must hold that manifest,
    # or a digest of another artifact would replay that one under this directory's name.
    try:
        with open(directory / MANIFEST_NAME, "rb") as handle:
            found = sha256_hex(handle.read(MAX_MANIFEST_BYTES + 1))
    except FileNotFoundError:
        raise ArtifactRejected("missing", f"{directory} holds no {MANIFEST_NAME}") from None
    if found != manifest_sha256:
        raise ArtifactRejected(
            "manifest_digest",
            f"{directory / MANIFEST_NAME} has sha256 {found}, not the given {manifest_sha256}",
        )
    servable = servable_check(model)
    uri = manifest_uri_for(directory)
    prepared = candidate_load(None, servable, cache, uri)
    artifact = fetch_servable(cache, uri, manifest_sha256, servable, prepared, bars)
    return load_strictly(cache, artifact, manifest_sha256, prepared, bars)
