"""Resident backbones: a backbone loaded once and shared by the heads that pin it, kept while a
head uses it, with the features its dry runs computed (``ResidentBackbone``); loading one is
``app.loading.candidate.load_backbone``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Final

import torch

from app.errors import ArtifactRejected, BackboneFreed
from app.manifest import BackboneRef, Manifest

# What a resident backbone keeps of its dry-run outputs for the next head's dry run.
DRY_RUN_FEATURE_CACHE_BYTES: Final = 64 << 20


class ResidentBackbone:
    """A backbone artifact's tensors on a device, shared read-only by every head model built
    on it: their parameters *are* these tensors (the same storage), so a head swap adds only
    the head's bytes and requests on the old head finish on the same backbone.

    Counted: each model built on it holds one use (``acquire``/``release``); when the last
    use is released the tensors are dropped and ``on_free`` runs (the holder's bookkeeping:
    forgetting it, releasing the cache lease of its bytes). A backbone that was freed is
    never handed out again (``acquire`` raises ``BackboneFreed``). Nothing may write it: each
    tensor's version counter is recorded when it is loaded and ``check_untouched`` refuses a
    head whose dry run changed one."""

    def __init__(
        self,
        manifest: Manifest,
        manifest_sha256: str,
        tensors: dict[str, torch.Tensor],
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        on_free: Callable[[ResidentBackbone], None] | None = None,
    ) -> None:
        self.manifest = manifest
        self.artifact_id = manifest.artifact_id
        self.manifest_sha256 = manifest_sha256
        self.device = device
        self.compute_dtype = compute_dtype
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.timings: dict[str, float] = {}
        self.loaded_bytes = 0
        self._tensors = tensors
        self._versions = {k: t._version for k, t in tensors.items()}
        self._on_free = on_free
        self._uses = 0
        self._lock = threading.Lock()
        self.freed = False
        # What the backbone computed for dry-run inputs (by their digest), so the next head's
        # dry run computes only its own half: the inputs and these tensors decide the output
        # alone, and the tensors are never written (check_untouched).
        self._features: dict[bytes, torch.Tensor] = {}
        self.feature_bytes = 0

    def matches(self, ref: BackboneRef) -> bool:
        return (self.artifact_id, self.manifest_sha256) == (ref.artifact_id, ref.manifest_sha256)

    @property
    def uses(self) -> int:
        with self._lock:
            return self._uses

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self.freed:
            raise BackboneFreed(self.artifact_id)
        return self._tensors

    def acquire(self) -> ResidentBackbone:
        with self._lock:
            if self.freed:
                raise BackboneFreed(self.artifact_id)
            self._uses += 1
        return self

    def release(self) -> None:
        with self._lock:
            if self._uses <= 0:
                raise AssertionError(f"backbone {self.artifact_id} released more than acquired")
            self._uses -= 1
            if self._uses or self.freed:
                return
            self.freed = True
            self._tensors = {}
            self._features = {}
            self.feature_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self._on_free is not None:
            self._on_free(self)

    def features(self, key: bytes, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The backbone's output for the dry-run input ``key`` names, computed once and
        kept while it fits in ``DRY_RUN_FEATURE_CACHE_BYTES``."""
        with self._lock:
            found = self._features.get(key)
        if found is not None:
            return found
        computed = compute()
        size = computed.numel() * computed.element_size()
        with self._lock:
            if not self.freed and self.feature_bytes + size <= DRY_RUN_FEATURE_CACHE_BYTES:
                self._features[key] = computed
                self.feature_bytes += size
        return computed

    def check_untouched(self) -> None:
        for key, tensor in self.tensors.items():
            if tensor._version != self._versions[key]:
                raise ArtifactRejected(
                    "dry_run",
                    f"the forward wrote {key} of the shared backbone {self.artifact_id} "
                    "(backbone tensors are read-only: every head and in-flight request "
                    "reads them)",
                )


# A head's backbone: an acquired ResidentBackbone for the head's manifest (its pinned
# ``backbone``), or ArtifactRejected("backbone").
BackboneSource = Callable[[Manifest], ResidentBackbone]
