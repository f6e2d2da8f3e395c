"""A loaded model (``LoadedModel``): the family's network on its device, its forward and the dry
run on service-owned requests whose output must be valid before the model may serve."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from torch import nn

from app.contracts import WireRequest
from app.errors import ArtifactRejected
from app.loading.control import LoadControl, checkpoint
from app.loading.device import runtime_build
from app.loading.memory import MemoryEstimate
from app.manifest import Manifest
from app.model_family import (
    ModelFamily,
    SplitForward,
)
from app.preprocessing import LabelMapping, RankedCandidate, rank_from_logits
from app.tasks.rank import check_ranking

if TYPE_CHECKING:
    from app.loading.backbones import ResidentBackbone


# Largest dry-run batch in rows (candidates over all requests); sizes the warm-up workspace.
DRY_RUN_MAX_ROWS: Final = 24 * 16


# Scores of a request must not depend on what else is in its batch (beyond kernel rounding).
BATCH_INVARIANCE_ATOL: Final = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


class LoadedModel:
    """A strictly loaded, dry-run-validated model of one family on its device. Immutable
    once built."""

    def __init__(
        self,
        *,
        manifest: Manifest,
        family: ModelFamily,
        params: Mapping[str, int],
        model: nn.Module,
        device: torch.device,
        compute_dtype: torch.dtype,
        preprocessing: Any,
        labels: LabelMapping,
        memory: MemoryEstimate | None,
        backbone: ResidentBackbone | None = None,
    ) -> None:
        self.manifest = manifest
        self.artifact_id = manifest.artifact_id
        self.precision = manifest.precision  # what the artifact holds
        self.compute_dtype = compute_dtype  # what runs (fp32 on CPU, see compute_dtype_for)
        self.device = device
        self.runtime_build = runtime_build()
        self.family = family
        self.params: Mapping[str, int] = dict(params)
        # Everything the model reads, its backbone included (counted once, however many
        # heads share it); ``own_bytes`` is what this model alone added.
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # A head's backbone: a use of it held until ``close``.
        self.backbone = backbone
        self.own_bytes = self.param_bytes - (backbone.nbytes if backbone is not None else 0)
        self.preprocessing = preprocessing  # the family's, from the artifact's files
        self.labels = labels
        self.memory = memory
        self.timings: dict[str, float] = {}
        self.loaded_bytes = 0  # read from the cache, hashed and placed by the load
        self._model: nn.Module | None = model

    def _logits(self, requests: Sequence[WireRequest]) -> tuple[torch.Tensor, np.ndarray]:
        model = self._model
        if model is None:
            raise RuntimeError(f"model {self.artifact_id} is closed")
        enc = self.family.schema.encode(requests, self.preprocessing)
        with torch.inference_mode():
            batch = {
                name: torch.from_numpy(array).to(self.device, non_blocking=True)
                for name, array in enc.arrays.items()
            }
            return self.family.network.forward(model, batch), enc.offsets

    def _dry_run_logits(self, requests: Sequence[WireRequest]) -> tuple[torch.Tensor, np.ndarray]:
        """``_logits`` for the dry run: a head on a resident backbone computes only its own
        half over what the backbone computed for the same inputs (the first head on it
        computes both; ``ResidentBackbone.features``)."""
        backbone, model = self.backbone, self._model
        network = self.family.network
        if backbone is None or model is None or not isinstance(network, SplitForward):
            return self._logits(requests)
        enc = self.family.schema.encode(requests, self.preprocessing)
        key = _inputs_key(enc.arrays)
        with torch.inference_mode():
            batch = {
                name: torch.from_numpy(array).to(self.device, non_blocking=True)
                for name, array in enc.arrays.items()
            }
            features = backbone.features(key, lambda: network.backbone_forward(model, batch))
            return network.head_forward(model, features), enc.offsets

    def rank_batch(self, requests: Sequence[WireRequest]) -> list[list[RankedCandidate]]:
        """One forward for all candidates of all (already validated) requests."""
        if not requests:
            return []
        logits, offsets = self._logits(requests)
        host = logits.float().cpu().numpy()  # the one device sync of the request path
        return rank_from_logits(requests, host, offsets, self.labels)

    def release_event(self) -> object | None:
        """A CUDA event recorded after the kernels queued so far on the current stream; the
        generation holder waits on it before freeing this model. None on CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def close(self) -> None:
        self._model = None
        backbone, self.backbone = self.backbone, None
        if backbone is not None:
            backbone.release()  # freed with its last user
        if self.device.type == "cuda":
            # Hands the freed blocks back so a following candidate (and mem_get_info) sees them.
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._model is None

    # ------------------------------------------------------------------ dry run

    def dry_run(self, control: LoadControl | None = None) -> None:
        """Run the service's representative requests and validate every output."""
        tol = BATCH_INVARIANCE_ATOL[self.compute_dtype]
        network = self.family.network

        def score(requests: Sequence[WireRequest]) -> list[np.ndarray]:
            checkpoint(control)
            logits, offsets = self._dry_run_logits(requests)
            scores = _sigmoid(logits.float().cpu().numpy())
            return [scores[offsets[i] : offsets[i + 1]] for i in range(len(requests))]

        batches = network.representative_batches(self.preprocessing)
        if self.backbone is not None and batches:
            # The dry run of a head computes the family's two halves; what serves requests is
            # its forward. They must agree (``SplitForward``): checked on the smallest batch.
            smallest = min(batches, key=len)
            split = _sigmoid(self._dry_run_logits(smallest)[0].float().cpu().numpy())
            whole = _sigmoid(self._logits(smallest)[0].float().cpu().numpy())
            gap = float(np.max(np.abs(split - whole))) if split.size else 0.0
            if split.shape != whole.shape or not gap <= tol:
                raise ArtifactRejected(
                    "dry_run",
                    f"the family's backbone and head halves score {gap:.3g} apart from its "
                    f"forward (tol {tol})",
                )
        for batch in batches:
            checkpoint(control)
            logits, offsets = self._dry_run_logits(batch)
            rows = int(offsets[-1])
            if tuple(logits.shape) != (rows,):
                raise ArtifactRejected(
                    "dry_run", f"output shape {tuple(logits.shape)}, expected ({rows},)"
                )
            if logits.dtype != self.compute_dtype:
                raise ArtifactRejected(
                    "dry_run", f"output dtype {logits.dtype}, expected {self.compute_dtype}"
                )
            host = logits.float().cpu().numpy()
            bad = np.flatnonzero(~np.isfinite(host))
            if bad.size:
                raise ArtifactRejected(
                    "dry_run", f"{bad.size} of {rows} scores are not finite (NaN/Inf)"
                )
            ranked = rank_from_logits(batch, host, offsets, self.labels)
            for req, answer in zip(batch, ranked, strict=True):
                check_ranking(req, answer, self.labels)
            if 1 < len(batch) <= 8:
                # Batch invariance: each request alone scores as it did inside the batch.
                in_batch = _sigmoid(host)
                for i, req in enumerate(batch):
                    checkpoint(control)
                    alone_logits, _ = self._dry_run_logits([req])
                    alone = _sigmoid(alone_logits.float().cpu().numpy())
                    diff = float(np.max(np.abs(alone - in_batch[offsets[i] : offsets[i + 1]])))
                    if not diff <= tol:
                        raise ArtifactRejected(
                            "dry_run", f"scores change by {diff:.3g} with the batch (tol {tol})"
                        )
            in_batch = _sigmoid(host)
            network.check_invariants(
                score,
                batch,
                [in_batch[offsets[i] : offsets[i + 1]] for i in range(len(batch))],
                tol,
            )
        if self.device.type == "cuda":
            # Warm-up is complete only when the queued kernels have run; not on the request path.
            torch.cuda.synchronize(self.device)


def _inputs_key(arrays: Mapping[str, np.ndarray]) -> bytes:
    """A digest of a forward's encoded inputs: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.digest()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
