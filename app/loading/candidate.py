"""The candidate load (``CandidateLoad``, ``load_verified``, and ``load_backbone`` for a head's
backbone): compatibility, memory budget, build on the meta device, the weights file's
declarations, a strict load of the verified bytes, placement, eval, dry run; a rejection with a
category at any step."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from app.compatibility import WEIGHTS_FILES, check_compatibility
from app.errors import ArtifactRejected
from app.loading.backbones import BackboneSource, ResidentBackbone
from app.loading.control import LoadCancelled, LoadControl, begin, checkpoint
from app.loading.device import PRECISIONS, compute_dtype_for, default_device
from app.loading.formats import (
    CHUNK_BYTES,
    READ_BUFFERS,
    SAFETENSORS_PARSE_BYTES_PER_BYTE,
    SafetensorsAssembler,
    Shapes,
    artifact_shapes,
    check_state,
    deserialize_torch,
    safetensors_header_limit,
)
from app.loading.memory import MemoryBudget, MemoryEstimate, check_budget, estimate_peak
from app.loading.model import DRY_RUN_MAX_ROWS, LoadedModel
from app.manifest import Architecture, Manifest
from app.model_family import (
    SHIPPED_FAMILIES,
    Families,
    ModelFamily,
    NetworkMemory,
    families_for,
)
from app.preprocessing import LABEL_MAPPING_FILE, LabelMapping

if TYPE_CHECKING:
    from app.cache import VerifiedArtifact


class CandidateLoad:
    """One candidate's load, from its manifest to a model: what the service can serve and
    the memory budget are checked before a single weights byte is read (``start``), then
    the weights are assembled as they pass, once.

    It is the cache's fetch sink (``app.cache.FetchSink``): on a cold fetch the cache calls
    ``start`` once the manifest is verified and feeds the weights file's bytes as it hashes
    them on their way into the cache, so they are read and hashed once in all; on a hit
    nothing is fed, and ``load_verified`` reads the entry once instead.

    ``role``: ``serve`` loads a servable artifact (a whole ``model``, or a ``head`` on the
    backbone ``backbones`` hands out); ``backbone`` loads a ``backbone`` artifact for heads
    (``load_backbone``). A candidate that will not be loaded after ``start`` must be
    ``abandon``ed (it may hold a use of a backbone)."""

    def __init__(
        self,
        *,
        device: torch.device | None = None,
        budget: MemoryBudget | None = None,
        resident_bytes: int = 0,
        expect: Callable[[Manifest], None] | None = None,
        families: Families | None = None,
        backbones: BackboneSource | None = None,
        role: Literal["serve", "backbone"] = "serve",
    ) -> None:
        self.device = device or default_device()
        self.families = families or families_for(SHIPPED_FAMILIES)
        self.expect = expect  # the caller's own checks of the manifest, run first
        self.budget = budget
        self.resident_bytes = resident_bytes
        self.backbones = backbones
        self.role = role
        self.manifest: Manifest | None = None
        self.memory: MemoryEstimate | None = None
        self.compute_dtype = torch.float32
        self.model: nn.Module | None = None
        self.family: ModelFamily | None = None
        self.params: dict[str, int] = {}
        self.expected: Shapes = {}
        self.assembler: SafetensorsAssembler | None = None
        self.backbone: ResidentBackbone | None = None  # a use held for the head's model

    def start(self, manifest: Manifest) -> dict[str, Callable[[memoryview], None]]:
        """Checks, budget, the model on the meta device; the consumer of the weights' bytes
        (none for the pickle format, which needs the whole file)."""
        if self.expect is not None:
            self.expect(manifest)
        self._check_kind(manifest)
        family = check_compatibility(manifest, self.families, torch_version=torch.__version__)
        _, spec = self.families.resolve(manifest.architecture)
        params = spec.validate(manifest.architecture)
        self.compute_dtype = compute_dtype_for(manifest.precision, self.device)
        with torch.device("meta"):  # nothing allocated, nothing initialised
            model = family.network.build(params)
        expected = artifact_shapes(model, family, params, manifest.kind)
        resident = self.resident_bytes
        if manifest.kind == "head":
            self.backbone = self._backbone_for(manifest, family)
            if self.backbone.uses == 1:
                # Loaded for this head alone (no serving model shares it): it is resident
                # beside the serving model now, and the head comes on top of both.
                resident += self.backbone.nbytes
        if self.budget is not None:
            self.memory = _memory_estimate(
                manifest, family.network.memory(params), expected, self.device,
                self.compute_dtype, self.budget, resident,
            )  # fmt: skip
            try:
                check_budget(self.memory)
            except ArtifactRejected:
                self.abandon()
                raise
        self.manifest = manifest
        self.family, self.params, self.model, self.expected = family, params, model, expected
        if manifest.runtime != "safetensors":
            return {}
        weights = WEIGHTS_FILES["safetensors"]
        self.assembler = SafetensorsAssembler(
            manifest.file(weights).bytes,
            model,
            manifest.precision,
            self.device,
            self.compute_dtype,
            expected=expected,
        )
        return {weights: self.assembler.feed}

    def _check_kind(self, manifest: Manifest) -> None:
        aid = manifest.artifact_id
        if self.role == "backbone" and manifest.kind != "backbone":
            raise ArtifactRejected(
                "backbone", f"a backbone was expected, the artifact is a {manifest.kind}",
                artifact_id=aid,
            )  # fmt: skip
        if self.role == "serve" and manifest.kind == "backbone":
            raise ArtifactRejected(
                "backbone",
                "a backbone is never served alone: target one of its heads",
                artifact_id=aid,
            )

    def _backbone_for(self, manifest: Manifest, family: ModelFamily) -> ResidentBackbone:
        ref = manifest.backbone
        assert ref is not None  # a head's manifest names its backbone
        aid = manifest.artifact_id
        if self.backbones is None:
            raise ArtifactRejected(
                "backbone",
                f"head needs backbone {ref.artifact_id} ({ref.manifest_sha256[:12]}); none "
                "can be loaded here",
                artifact_id=aid,
            )
        backbone = self.backbones(manifest)
        try:
            if not backbone.matches(ref):
                raise ArtifactRejected(
                    "backbone",
                    f"head pins backbone {ref.artifact_id} ({ref.manifest_sha256[:12]}), "
                    f"got {backbone.artifact_id} ({backbone.manifest_sha256[:12]})",
                    artifact_id=aid,
                )
            theirs = backbone.manifest
            for what, mine, other in (
                ("architecture", manifest.architecture, theirs.architecture),
                ("precision", manifest.precision, theirs.precision),
                ("feature_schema", manifest.feature_schema, theirs.feature_schema),
            ):
                if mine != other:
                    raise ArtifactRejected(
                        "backbone",
                        f"head's {what} {_shown(mine)} differs from its backbone "
                        f"{backbone.artifact_id}'s {_shown(other)}",
                        artifact_id=aid,
                    )
            if backbone.device != self.device:
                raise ArtifactRejected(
                    "backbone",
                    f"backbone {backbone.artifact_id} is on {backbone.device}, the head "
                    f"loads on {self.device}",
                    artifact_id=aid,
                )
        except ArtifactRejected:
            backbone.release()
            raise
        return backbone

    def abandon(self) -> None:
        """Give back what ``start`` took (the head's use of its backbone)."""
        backbone, self.backbone = self.backbone, None
        if backbone is not None:
            backbone.release()

    @property
    def fed(self) -> bool:
        """The weights arrived with the fetch (all of them: the fetch verified them)."""
        return self.assembler is not None and self.assembler.fed > 0


def _shown(value: object) -> str:
    if isinstance(value, Architecture):
        return f"{value.name} v{value.version} {dict(sorted(value.params.items()))}"
    return repr(value)


def _memory_estimate(
    manifest: Manifest,
    network: NetworkMemory,
    expected: Shapes,
    device: torch.device,
    compute_dtype: torch.dtype,
    budget: MemoryBudget,
    resident_bytes: int,
) -> MemoryEstimate:
    stored = PRECISIONS[manifest.precision]
    n = network.param_count
    largest = network.largest_tensor
    if manifest.kind != "model":
        # Only the tensors this artifact holds are allocated (a head's backbone is resident).
        sizes = [math.prod(shape) for shape in expected.values()]
        n, largest = sum(sizes), max(sizes, default=0)
    weight_bytes = n * compute_dtype.itemsize
    file_bytes = manifest.file(WEIGHTS_FILES[manifest.runtime]).bytes
    if manifest.runtime == "safetensors":
        # Streamed (SafetensorsAssembler): tensors are allocated where they live and filled
        # as the bytes pass, so beside them only the reader's chunk buffers and the header
        # (its bytes and what parsing them builds, both bounded by the architecture), on the
        # host (on a GPU a converting copy converts a chunk on the host too: nothing on the
        # device).
        header = safetensors_header_limit(expected) * (1 + SAFETENSORS_PARSE_BYTES_PER_BYTE)
        temporaries = READ_BUFFERS * CHUNK_BYTES + header if device.type == "cpu" else 0
    elif device.type == "cpu":
        # The verified file bytes, plus the deserialized tensors when they are upcast. The
        # file bounds what deserializing costs: compressed records are refused and declared
        # storage may not exceed the parameters (_check_zip_records, _check_declared).
        temporaries = file_bytes + (n * stored.itemsize if stored != compute_dtype else 0)
    else:
        # Tensors move to the device one at a time; the largest is the transient excess.
        temporaries = largest * compute_dtype.itemsize
    # A backbone is not run alone: its heads' dry runs take the workspace.
    rows = 0 if manifest.kind == "backbone" else DRY_RUN_MAX_ROWS
    workspace = rows * network.workspace_per_row * compute_dtype.itemsize
    return estimate_peak(
        budget,
        device=device,
        resident_bytes=resident_bytes,
        candidate_weight_bytes=weight_bytes,
        load_temporary_bytes=temporaries,
        warmup_workspace_bytes=workspace,
    )


def _read_into(
    artifact: VerifiedArtifact,
    rel: str,
    assembler: SafetensorsAssembler,
    device: torch.device,
    control: LoadControl | None,
) -> None:
    """The cache entry's ``rel`` read once, chunk by chunk, each chunk hashed as it is read
    (app.cache.VerifiedStream) and handed to ``assembler``; the digest decides at the end.
    Where the assembler can take them in place (CPU, same dtype) the bytes are read straight
    into their tensor's memory; the rest (the header, padding, converting loads) goes
    through two staging buffers (``READ_BUFFERS``) no larger than the assembler asks for (a
    chunk at most), in turn: one is read into while the stream still hashes the other."""
    staging: list[memoryview | None] = [None] * READ_BUFFERS
    turn = 0
    with artifact.open_stream(rel, control) as stream:
        while stream.position < stream.size:
            left = stream.size - stream.position
            target = assembler.destination(min(CHUNK_BYTES, left))
            if target is not None:
                stream.readinto(target)
                assembler.placed(len(target))
                continue
            wanted = assembler.wanted(left)
            buffer = staging[turn]
            if buffer is None or len(buffer) < wanted:
                # Pinned for a GPU: the copy to the device is a DMA from it. The assembler
                # has copied a chunk out before a later one is read into the same buffer.
                pinned = device.type == "cuda"
                block = torch.empty(wanted, dtype=torch.uint8, pin_memory=pinned)
                buffer = memoryview(block.numpy())
                staging[turn] = buffer
            turn = (turn + 1) % READ_BUFFERS
            view = buffer[:wanted]
            stream.readinto(view)
            assembler.feed(view)
        stream.finish()


def _prepare(
    artifact: VerifiedArtifact, prepared: CandidateLoad | None, make: Callable[[], CandidateLoad]
) -> CandidateLoad:
    load = prepared or make()
    if load.manifest is None:
        load.start(artifact.manifest)
    elif load.manifest != artifact.manifest:
        raise ValueError("the prepared load is for another manifest")
    return load


def _read_weights(
    artifact: VerifiedArtifact, load: CandidateLoad, control: LoadControl | None
) -> dict[str, torch.Tensor]:
    """The artifact's tensors, checked against what its kind must hold (read here unless
    the fetch fed them)."""
    manifest = artifact.manifest
    weights_file = WEIGHTS_FILES[manifest.runtime]
    if load.assembler is not None:
        if not load.fed:
            _read_into(artifact, weights_file, load.assembler, load.device, control)
        return load.assembler.state()
    state = deserialize_torch(
        artifact.read_verified(weights_file, control), load.expected, manifest.precision
    )
    check_state(state, load.expected, manifest.precision)
    return state


def load_backbone(
    artifact: VerifiedArtifact,
    *,
    device: torch.device | None = None,
    budget: MemoryBudget | None = None,
    resident_bytes: int = 0,
    control: LoadControl | None = None,
    prepared: CandidateLoad | None = None,
    families: Families | None = None,
    on_free: Callable[[ResidentBackbone], None] | None = None,
) -> ResidentBackbone:
    """A ``backbone`` artifact's tensors, strictly checked against its architecture (every
    tensor but the family's head) and placed on the device in the compute dtype, with no use
    yet. It is not dry-run alone: each head's dry run runs it. ArtifactRejected on failure."""
    manifest = artifact.manifest
    t0 = time.perf_counter()
    try:
        load = _prepare(
            artifact,
            prepared,
            lambda: CandidateLoad(
                device=device,
                budget=budget,
                resident_bytes=resident_bytes,
                families=families,
                role="backbone",
            ),
        )
        if load.role != "backbone":
            raise ValueError("a backbone is loaded by a CandidateLoad of role 'backbone'")
        weights_bytes = manifest.file(WEIGHTS_FILES[manifest.runtime]).bytes
        read_here = 0 if load.fed else weights_bytes
        begin(control, "load", read_here)
        state = _read_weights(artifact, load, control)
        checkpoint(control)
        tensors = {
            key: t.to(device=load.device, dtype=load.compute_dtype).requires_grad_(False)
            for key, t in state.items()
        }
        del state
        load.model = None  # only the backbone's tensors are kept, not the meta module
        backbone = ResidentBackbone(
            manifest,
            artifact.manifest_sha256,
            tensors,
            device=load.device,
            compute_dtype=load.compute_dtype,
            on_free=on_free,
        )
        backbone.timings["load"] = time.perf_counter() - t0
        backbone.loaded_bytes = read_here
        return backbone
    except ArtifactRejected as exc:
        if exc.artifact_id is None:
            raise ArtifactRejected(
                exc.category, exc.detail, artifact_id=manifest.artifact_id
            ) from None
        raise


def load_verified(
    artifact: VerifiedArtifact,
    *,
    device: torch.device | None = None,
    budget: MemoryBudget | None = None,
    resident_bytes: int = 0,
    control: LoadControl | None = None,
    prepared: CandidateLoad | None = None,
    families: Families | None = None,
    backbones: BackboneSource | None = None,
) -> LoadedModel:
    """Build, strictly load and dry-run the artifact; ArtifactRejected on any failure.
    ``control`` paces, counts (stage ``load``) and can cancel a background load
    (app.loading.control): each chunk read and hashed, each dry-run forward. ``prepared``: the
    load that was the fetch's sink (its checks done; its weights fed if the fetch was cold);
    without it one is made here, with ``device``, ``budget``, ``resident_bytes``,
    ``families`` (default: every family the service ships) and ``backbones`` (where a head
    finds its backbone).

    A ``head`` is loaded on its backbone: the model's backbone parameters are the resident
    backbone's tensors (the same storage, not a copy), only the head's tensors are read and
    placed, and the dry run runs backbone and new head together."""
    manifest = artifact.manifest
    aid = manifest.artifact_id
    t0 = time.perf_counter()
    load: CandidateLoad | None = prepared
    try:
        load = _prepare(
            artifact,
            prepared,
            lambda: CandidateLoad(
                device=device,
                budget=budget,
                resident_bytes=resident_bytes,
                families=families,
                backbones=backbones,
            ),
        )
        model, device, compute_dtype = load.model, load.device, load.compute_dtype
        family = load.family
        assert model is not None and family is not None
        weights_file = WEIGHTS_FILES[manifest.runtime]
        small_files = (*family.schema.preprocessing_files, LABEL_MAPPING_FILE)
        small = sum(manifest.file(f).bytes for f in small_files)
        weights_bytes = manifest.file(weights_file).bytes
        read_here = small + (0 if load.fed else weights_bytes)  # the fetch fed the rest
        begin(control, "load", read_here)
        preprocessing = family.schema.preprocessing(
            {f: artifact.read_verified(f, control) for f in family.schema.preprocessing_files}
        )
        labels = LabelMapping.from_json(
            artifact.read_verified(LABEL_MAPPING_FILE, control), family.schema.name
        )
        state = _read_weights(artifact, load, control)
        backbone = load.backbone
        if backbone is not None:
            state.update(backbone.tensors)  # shared, not copied: assign=True keeps storage
        checkpoint(control)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ArtifactRejected("load", f"load_state_dict: {exc}") from None
        del state
        # A no-op for streamed tensors and a backbone's (already on ``device`` in the
        # compute dtype).
        model.to(device=device, dtype=compute_dtype).eval().requires_grad_(False)
        loaded = LoadedModel(
            manifest=manifest,
            family=family,
            params=load.params,
            model=model,
            device=device,
            compute_dtype=compute_dtype,
            preprocessing=preprocessing,
            labels=labels,
            memory=load.memory,
            backbone=backbone,
        )
        load.model = None  # the loaded model owns it now
        load.backbone = None  # and the use of the backbone
        t1 = time.perf_counter()
        try:
            loaded.dry_run(control)
            if backbone is not None:
                backbone.check_untouched()
        except (ArtifactRejected, LoadCancelled):  # a cancel is not a failed dry run
            loaded.close()
            raise
        except Exception as exc:  # a forward that raises is a failed dry run, not a crash
            loaded.close()
            raise ArtifactRejected("dry_run", f"{type(exc).__name__}: {exc}") from None
        loaded.timings.update(load=t1 - t0, dry_run=time.perf_counter() - t1)
        loaded.loaded_bytes = read_here
        return loaded
    except ArtifactRejected as exc:
        if load is not None:
            load.abandon()
        if exc.artifact_id is None:
            raise ArtifactRejected(exc.category, exc.detail, artifact_id=aid) from None
        raise
    except BaseException:
        if load is not None:
            load.abandon()
        raise
