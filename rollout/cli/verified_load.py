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
    from app.loading.candidate import CandidateLoad
    from app.loading.model import LoadedModel
    from app.loading.pipeline import FetchedModel
    from rollout.cli.progress import Bars


def servable_check(model: str) -> Callable[[Manifest], None]:
    """What the manifest says decides whether the service could ever serve it
    (``app.compatibility.check_servable``): no weights need loading to refuse another model,
    an unknown runtime, schema, precision or architecture."""
    from app.compatibility import check_servable

    def servable(manifest: Manifest) -> None:
        check_servable(manifest, model, "--model")

    return servable


def candidate_load(
    memory_budget: int | None,
    servable: Callable[[Manifest], None],
    cache: ArtifactCache,
    manifest_uri: str,
) -> CandidateLoad:
    """The load of ``verify --load``; a head's pinned backbone is fetched from beside it,
    every byte re-hashed like the head's, and loaded first (within the budget)."""
    from app.loading.backbones import ResidentBackbone
    from app.loading.candidate import CandidateLoad
    from app.loading.device import default_device
    from app.loading.memory import MemoryBudget
    from app.loading.pipeline import load_pinned_backbone
    from app.model_family import SHIPPED_FAMILIES, families_for

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
    bars: Bars,
) -> VerifiedArtifact:
    """``verify``'s fetch without ``--load``: into the verified cache, a hit re-hashed (every
    byte checked), the manifest checked servable."""
    from app.loading.control import LoadControl
    from rollout.cli.progress import watching

    with watching(LoadControl(), bars) as control:
        artifact = cache.fetch_verified(
            manifest_uri, manifest_sha256, recheck="digests", control=control
        )
    servable(artifact.manifest)
    return artifact


def fetch_and_load_strictly(
    cache: ArtifactCache,
    manifest_uri: str,
    manifest_sha256: str,
    prepared: CandidateLoad,
    bars: Bars,
) -> FetchedModel:
    """``verify --load``: the pipeline a replica's load takes
    (``app.loading.pipeline.fetch_and_load``), every byte of a hit re-hashed, with a bar per
    stage: fetched and verified (a cold fetch feeds the weights into ``prepared`` as it hashes
    them), then strictly loaded and dry-run. The caller closes the model and releases the
    lease."""
    from app.loading.control import LoadControl
    from app.loading.pipeline import fetch_and_load
    from rollout.cli.progress import watching

    with watching(LoadControl(), bars) as control:
        return fetch_and_load(
            cache, manifest_uri, manifest_sha256, prepared, control=control, recheck="digests"
        )


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
    fetched = fetch_and_load_strictly(cache, uri, manifest_sha256, prepared, bars)
    # A replay is over when the command ends: nothing evicts the entry meanwhile.
    fetched.lease.release()
    return fetched.model
