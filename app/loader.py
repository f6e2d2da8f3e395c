"""Turn a verified artifact into a servable model, or reject it with a category.

    compatibility -> memory budget -> build from service code (meta device) -> what the
    weights file declares (stored zip records / safetensors header: keys, shapes, dtypes,
    sizes) checked before any tensor is read -> strict load of the verified bytes ->
    placement -> eval -> dry run on service-owned requests -> output validation -> CUDA
    synchronize

Rejections (ArtifactRejected): ``runtime`` (runtime, precision, architecture or torch version
not supported), ``schema`` (feature schema, normalization/label files), ``load`` (bytes that do
not deserialize, missing/unexpected keys, shapes, dtypes), ``dry_run`` (failed or invalid
output on representative requests), ``budget`` (would not fit next to the resident model), and
``size``/``digest`` from re-checking the bytes read.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import struct
import time
import zipfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from app.contracts import WireRequest
from app.errors import ArtifactRejected
from app.features import (
    CONTEXT_FIELDS,
    FEATURE_SCHEMA,
    LABEL_MAPPING_FILE,
    NORMALIZATION_FILE,
    NUM_FEATURES,
    LabelMapping,
    Normalization,
    RankedCandidate,
    encode_batch,
    rank_from_logits,
)
from app.load_control import LoadControl, begin, checkpoint
from app.manifest import Manifest
from app.memory import MemoryBudget, MemoryEstimate, check_budget, estimate_peak
from app.ranker import RankerMLP, RankerParams, architecture_spec, build_ranker, ranker_params

if TYPE_CHECKING:
    from app.cache import VerifiedArtifact, VerifiedStream

WEIGHTS_FILES: Final = {"safetensors": "weights.safetensors", "pytorch-state-dict": "weights.pt"}
PRECISIONS: Final = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# manifest.metadata["requires"]["torch"]: a PEP 440 specifier such as ">=2.10,<3".
TORCH_REQUIREMENT_KEY: Final = ("requires", "torch")
# Largest dry-run batch in rows (candidates over all requests); sizes the warm-up workspace.
DRY_RUN_MAX_ROWS: Final = 24 * 16
# Scores of a request must not depend on what else is in its batch (beyond kernel rounding).
BATCH_INVARIANCE_ATOL: Final = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}
# What a weights file may be made of (app.loader._check_zip_records, _check_safetensors_header).
SAFETENSORS_DTYPES: Final = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
MAX_SAFETENSORS_HEADER_BYTES: Final = 100 << 20  # the safetensors format's own limit
MAX_ZIP_RECORDS: Final = 4096
ZIP_LOCAL_HEADER_SIGNATURE: Final = b"PK\x03\x04"
ZIP_LOCAL_HEADER_BYTES: Final = 30
ZIP_FLAG_ENCRYPTED: Final = 0x1
# Bytes read (and hashed) per call when they go straight into a tensor: one checkpoint each,
# so a cancelled load stops within this much. The cache reads in chunks of the same size.
CHUNK_BYTES: Final = 8 << 20
# Each of the two staging buffers bytes pass through when they cannot go straight into their
# tensor (a GPU, or an upcast on the CPU): the host memory a GPU load takes beside the file's
# page cache, whatever the model's size.
STAGING_CHUNK_BYTES: Final = 16 << 20


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def runtime_build() -> str:
    """e.g. ``torch-2.13.0+cpu`` or ``torch-2.13.0+cu130`` (the wheel's local version)."""
    return f"torch-{torch.__version__}"


def _torch_requirement(manifest: Manifest) -> str | None:
    node: Any = manifest.metadata
    for key in TORCH_REQUIREMENT_KEY:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if not isinstance(node, str):
        raise ArtifactRejected("runtime", f"metadata.requires.torch must be a string, got {node!r}")
    return node


def check_compatibility(manifest: Manifest) -> None:
    """Can this service run the artifact at all? ArtifactRejected ``runtime`` / ``schema``."""
    aid = manifest.artifact_id
    if manifest.runtime not in WEIGHTS_FILES:
        raise ArtifactRejected(
            "runtime",
            f"unknown runtime {manifest.runtime!r} (supported: {sorted(WEIGHTS_FILES)})",
            artifact_id=aid,
        )
    if manifest.feature_schema != FEATURE_SCHEMA:
        raise ArtifactRejected(
            "schema",
            f"feature schema {manifest.feature_schema!r}, this service serves {FEATURE_SCHEMA!r}",
            artifact_id=aid,
        )
    if manifest.precision not in PRECISIONS:
        raise ArtifactRejected(
            "runtime",
            f"unknown precision {manifest.precision!r} (supported: {sorted(PRECISIONS)})",
            artifact_id=aid,
        )
    try:
        spec = architecture_spec(manifest.architecture)
        ranker_params(manifest.architecture)
        running = Version(torch.__version__)
        if running.release < Version(spec.min_torch).release:
            raise ArtifactRejected(
                "runtime", f"{spec.name} v{spec.version} needs torch >= {spec.min_torch}"
            )
        requirement = _torch_requirement(manifest)
        if requirement is not None:
            try:
                allowed = SpecifierSet(requirement)
            except InvalidSpecifier:
                raise ArtifactRejected(
                    "runtime", f"metadata.requires.torch {requirement!r} is not a version range"
                ) from None
            # Compare the public version: a "+cu130" build satisfies ">=2.10" like "+cpu" does.
            if not allowed.contains(running.public, prereleases=True):
                raise ArtifactRejected(
                    "runtime", f"artifact requires torch {requirement}, this is {torch.__version__}"
                )
    except ArtifactRejected as exc:
        raise ArtifactRejected(exc.category, exc.detail, artifact_id=aid) from None
    except InvalidVersion as exc:  # a local torch build with an odd version string
        raise ArtifactRejected(
            "runtime", f"cannot read torch version: {exc}", artifact_id=aid
        ) from None
    listed = {f.path for f in manifest.files}
    for needed in (WEIGHTS_FILES[manifest.runtime], NORMALIZATION_FILE, LABEL_MAPPING_FILE):
        if needed not in listed:
            raise ArtifactRejected(
                "schema",
                f"runtime {manifest.runtime} needs {needed!r} in the artifact",
                artifact_id=aid,
            )


def compute_dtype_for(precision: str, device: torch.device) -> torch.dtype:
    stored = PRECISIONS[precision]
    if device.type == "cpu":
        # Half-precision matmul on CPU is emulated or missing on most x86 parts and is several
        # times slower than fp32 where it exists; upcasting the weights is exact. Reports keep
        # the artifact's precision; compute_dtype says what actually runs.
        return torch.float32
    if stored is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float32
    return stored


def _deserialize_torch(data: bytes, model: RankerMLP, precision: str) -> dict[str, torch.Tensor]:
    """The state dict in a verified ``weights.pt``, with what it declares checked against
    ``model`` (on the meta device) before a single tensor is read: its bytes can then cost no
    more than the file and the architecture say. The pickle format needs the whole file."""
    name = WEIGHTS_FILES["pytorch-state-dict"]
    _check_zip_records(data)
    _check_declared(_load_torch(data, "meta"), model, precision, name)
    state = _load_torch(data, "cpu")
    _check_flat(state, name)
    for key, tensor in state.items():
        if tensor.device.type != "cpu":
            # Saved from the meta device, a tensor has a shape and no data: refused here, it
            # would fail later as NotImplementedError when the model is moved.
            raise ArtifactRejected(
                "load",
                f"{key} in {name} is on the {tensor.device.type} device, not cpu"
                + (" (a meta tensor holds no data)" if tensor.is_meta else ""),
            )
    return state


class _Staging:
    """Two bounded host buffers that bytes pass through on their way into tensors that
    cannot take them directly (another device, another dtype). Pinned for a GPU, so the copy
    to the device runs asynchronously while the next chunk is read and hashed; a buffer is
    reused only once the copy out of it has finished (its CUDA event)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.nbytes = nbytes
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in "ab"]
        self._events: list[Any] = [None, None]
        self._next = 0
        self._cuda = pin

    def fill(self, stream: VerifiedStream, nbytes: int) -> tuple[torch.Tensor, int]:
        """The next ``nbytes`` of ``stream`` in a free buffer (a view of it), and its slot."""
        slot = self._next
        self._next ^= 1
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None
        view = self._buffers[slot][:nbytes]
        stream.readinto(memoryview(view.numpy()))
        return view, slot

    def copied(self, slot: int) -> None:
        """A copy out of ``slot`` was queued: remember when it is done."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event

    def drain(self) -> None:
        for event in self._events:
            if event is not None:
                event.synchronize()


def _stream_safetensors(
    stream: VerifiedStream,
    model: RankerMLP,
    precision: str,
    device: torch.device,
    compute_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One pass over ``weights.safetensors``: the header is read and checked against the
    architecture first, then every tensor is allocated where it will live (``device``, the
    compute dtype) and filled from the stream chunk by chunk, each chunk hashed as it is read.
    Host memory: the tensors (on CPU) plus at most two staging chunks; nothing holds the
    file. The result is only trusted after ``stream.finish()`` (called here): on a digest
    mismatch everything built is dropped with the exception."""
    name = WEIGHTS_FILES["safetensors"]
    if stream.size < 8:
        raise _unreadable(name, f"header: the file is {stream.size} bytes")
    (header_len,) = struct.unpack("<Q", stream.read(8))
    if header_len > min(stream.size - 8, MAX_SAFETENSORS_HEADER_BYTES):
        raise _unreadable(
            name,
            f"header declares {header_len} bytes; the file has {stream.size - 8} after "
            f"the length (max {MAX_SAFETENSORS_HEADER_BYTES})",
        )
    payload = stream.size - 8 - header_len
    spans = _check_safetensors_header(stream.read(header_len), payload, model, precision)
    stored = PRECISIONS[precision]
    shapes = _expected_shapes(model)
    state = {key: torch.empty(shapes[key], dtype=compute_dtype, device=device) for key in shapes}
    # Same dtype on the CPU: bytes go straight into the tensor's memory, no staging at all.
    direct = device.type == "cpu" and stored == compute_dtype
    staging = None if direct else _Staging(STAGING_CHUNK_BYTES, device)
    at = 0
    for start, end, key in spans:
        if start > at:
            stream.skip(start - at)  # padding: hashed like every other byte
        flat = state[key].view(-1)
        if direct:
            target = memoryview(flat.view(torch.uint8).numpy())
            for start in range(0, len(target), CHUNK_BYTES):
                stream.readinto(target[start : start + CHUNK_BYTES])
        else:
            assert staging is not None
            per_chunk = staging.nbytes // stored.itemsize
            for first in range(0, flat.numel(), per_chunk):
                count = min(per_chunk, flat.numel() - first)
                chunk, slot = staging.fill(stream, count * stored.itemsize)
                flat[first : first + count].copy_(chunk.view(stored), non_blocking=True)
                staging.copied(slot)
        at = end
    if staging is not None:
        staging.drain()
    stream.finish()
    return state


def _load_torch(data: bytes, map_location: str) -> Any:
    """``torch.load`` of untrusted bytes: ``weights_only`` (no code runs); on ``"meta"`` it
    reads only the pickle, so shapes, dtypes and storage sizes come without their data."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # any failure to parse untrusted bytes is a load rejection
        raise ArtifactRejected(
            "load",
            f"cannot deserialize {WEIGHTS_FILES['pytorch-state-dict']}: "
            f"{type(exc).__name__}: {exc}",
        ) from None


def _check_flat(state: object, name: str) -> None:
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ArtifactRejected(
            "load", f"{name}: weights are not a flat mapping of names to tensors"
        )


def _check_zip_records(data: bytes) -> None:
    """``weights.pt`` is a zip archive of stored (uncompressed) records that lie side by side
    inside the file. torch's reader inflates DEFLATE records, so one compressed record could
    expand to any size (a decompression bomb); stored records that neither overlap nor run
    past the end cannot, together, hold more bytes than the file."""
    name = WEIGHTS_FILES["pytorch-state-dict"]
    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except Exception as exc:  # zipfile raises several kinds on malformed archives
        raise _unreadable(
            name,
            f"it is not a torch.save zip archive ({type(exc).__name__}: {exc}); the legacy "
            "(pre-zip) format is not accepted",
        ) from None
    if len(infos) > MAX_ZIP_RECORDS:
        raise _unreadable(name, f"has {len(infos)} records (max {MAX_ZIP_RECORDS})")
    spans: list[tuple[int, int, str]] = []
    seen: set[str] = set()
    for info in infos:
        record = info.filename
        if record in seen:
            raise _unreadable(name, f"holds record {record!r} twice")
        seen.add(record)
        offset = info.header_offset
        local_method = None
        if 0 <= offset <= len(data) - ZIP_LOCAL_HEADER_BYTES and data[offset : offset + 4] == (
            ZIP_LOCAL_HEADER_SIGNATURE
        ):
            (local_method,) = struct.unpack_from("<H", data, offset + 8)
        if info.compress_type != zipfile.ZIP_STORED or local_method not in (None, 0):
            raise _unreadable(
                name,
                f"record {record!r} is compressed (method {info.compress_type}); only "
                "stored (uncompressed) records are accepted",
            )
        if local_method is None:
            raise _unreadable(name, f"record {record!r} has no local header")
        if info.flag_bits & ZIP_FLAG_ENCRYPTED or info.compress_size != info.file_size:
            raise _unreadable(name, f"record {record!r} is not a plain stored record")
        name_len, extra_len = struct.unpack_from("<HH", data, offset + 26)
        end = offset + ZIP_LOCAL_HEADER_BYTES + name_len + extra_len + info.file_size
        if end > len(data):
            raise _unreadable(
                name,
                f"record {record!r} declares {info.file_size} bytes and runs past the "
                f"end of the {len(data)}-byte file",
            )
        spans.append((offset, end, record))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise _unreadable(name, f"records {first!r} and {second!r} overlap")


def _check_declared(state: object, model: RankerMLP, precision: str, name: str) -> None:
    """What a torch state dict declares (read on the meta device), before its data is read:
    the architecture's keys, shapes and dtype, and no more storage than the parameters need
    (a tensor viewing a larger storage would keep all of it alive in the model)."""
    _check_flat(state, name)
    assert isinstance(state, dict)
    _check_state(state, model, precision)
    declared = sum(t.untyped_storage().nbytes() for t in state.values())
    needed = sum(t.numel() * t.element_size() for t in state.values())
    if declared > needed:
        raise ArtifactRejected(
            "load",
            f"{name} declares {declared} bytes of tensor storage for {needed} bytes of "
            "parameters (a tensor is a view of a larger storage); save each tensor on its own",
        )


def _check_safetensors_header(
    header_bytes: bytes, payload: int, model: RankerMLP, precision: str
) -> list[tuple[int, int, str]]:
    """The safetensors header (its JSON, after the 8-byte length) against the architecture
    and the file, before a tensor is read: the right keys, dtype and shapes, and byte ranges
    of the ``payload`` bytes that follow it that are exactly each tensor's size, inside the
    file and not overlapping. Returns the ranges in file order, with their tensor names."""
    name = WEIGHTS_FILES["safetensors"]
    try:
        header = json.loads(header_bytes)
    except ValueError:  # UnicodeDecodeError included
        raise _unreadable(name, "header is not JSON") from None
    if not isinstance(header, dict):
        raise _unreadable(name, "header is not a JSON object")
    header.pop("__metadata__", None)
    expected = _expected_shapes(model)
    _check_keys(expected, header, f"{name} header: ")
    dtype_tag = SAFETENSORS_DTYPES[precision]
    itemsize = PRECISIONS[precision].itemsize
    spans: list[tuple[int, int, str]] = []
    for key in sorted(header):
        info = header[key]
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ArtifactRejected("load", f"{name} header: {key} is not a tensor entry")
        shape, offsets = info["shape"], info["data_offsets"]
        if info["dtype"] != dtype_tag:
            raise ArtifactRejected(
                "load",
                f"{name} header: {key} is {info['dtype']!r} but the manifest says precision "
                f"{precision} ({dtype_tag})",
            )
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise ArtifactRejected("load", f"{name} header: {key} has shape {shape!r}")
        if tuple(shape) != expected[key]:
            raise ArtifactRejected(
                "load",
                f"{name} header: shape mismatch for {key}: declared {tuple(shape)}, "
                f"architecture {expected[key]}",
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise ArtifactRejected("load", f"{name} header: {key} has data_offsets {offsets!r}")
        begin, end = offsets
        size = math.prod(shape) * itemsize
        if not begin <= end <= payload or end - begin != size:
            raise ArtifactRejected(
                "load",
                f"{name} header: {key} declares bytes [{begin}, {end}) for {size} bytes of "
                f"data, in a payload of {payload} bytes",
            )
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise ArtifactRejected("load", f"{name} header: {first} and {second} overlap")
    return spans


def _unreadable(name: str, problem: str) -> ArtifactRejected:
    return ArtifactRejected("load", f"cannot deserialize {name}: {problem}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _expected_shapes(model: RankerMLP) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_keys(expected: Mapping[str, object], got: Mapping[str, object], where: str) -> None:
    """The tensor names ``got`` (a state dict, a safetensors header) are exactly the
    architecture's."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        raise ArtifactRejected(
            "load",
            f"{where}state dict does not match the architecture: missing keys {missing}, "
            f"unexpected keys {unexpected}",
        )


def _check_state(state: dict[str, torch.Tensor], model: RankerMLP, precision: str) -> None:
    expected = _expected_shapes(model)
    _check_keys(expected, state, "")
    dtype = PRECISIONS[precision]
    for key, shape in expected.items():
        t = state[key]
        if tuple(t.shape) != shape:
            raise ArtifactRejected(
                "load", f"shape mismatch for {key}: artifact {tuple(t.shape)}, architecture {shape}"
            )
        if t.layout != torch.strided:
            raise ArtifactRejected("load", f"{key} is not a dense tensor ({t.layout})")
        if t.dtype != dtype:
            raise ArtifactRejected(
                "load", f"{key} is {t.dtype} but the manifest says precision {precision}"
            )


class LoadedModel:
    """A strictly loaded, dry-run-validated ranker on its device. Immutable once built."""

    def __init__(
        self,
        *,
        manifest: Manifest,
        model: RankerMLP,
        device: torch.device,
        compute_dtype: torch.dtype,
        normalization: Normalization,
        labels: LabelMapping,
        memory: MemoryEstimate | None,
    ) -> None:
        self.manifest = manifest
        self.artifact_id = manifest.artifact_id
        self.precision = manifest.precision  # what the artifact holds
        self.compute_dtype = compute_dtype  # what runs (fp32 on CPU, see compute_dtype_for)
        self.device = device
        self.runtime_build = runtime_build()
        self.params: RankerParams = model.params
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.normalization = normalization
        self.labels = labels
        self.memory = memory
        self.timings: dict[str, float] = {}
        self.loaded_bytes = 0  # read from the cache, hashed and placed by the load
        self._model: RankerMLP | None = model

    def _logits(self, requests: Sequence[WireRequest]) -> tuple[torch.Tensor, np.ndarray]:
        model = self._model
        if model is None:
            raise RuntimeError(f"model {self.artifact_id} is closed")
        enc = encode_batch(requests, self.normalization)
        with torch.inference_mode():
            x = torch.from_numpy(enc.features).to(self.device, non_blocking=True)
            ctx = torch.from_numpy(enc.context).to(self.device, non_blocking=True)
            return model(x, ctx), enc.offsets

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
        for batch in representative_batches(self.normalization):
            checkpoint(control)
            logits, offsets = self._logits(batch)
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
                _check_ranking(req, answer, self.labels)
            if 1 < len(batch) <= 8:
                # Batch invariance: each request alone scores as it did inside the batch.
                in_batch = _sigmoid(host)
                for i, req in enumerate(batch):
                    checkpoint(control)
                    alone_logits, _ = self._logits([req])
                    alone = _sigmoid(alone_logits.float().cpu().numpy())
                    diff = float(np.max(np.abs(alone - in_batch[offsets[i] : offsets[i + 1]])))
                    if not diff <= tol:
                        raise ArtifactRejected(
                            "dry_run", f"scores change by {diff:.3g} with the batch (tol {tol})"
                        )
        if self.device.type == "cuda":
            # Warm-up is complete only when the queued kernels have run; not on the request path.
            torch.cuda.synchronize(self.device)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _check_ranking(req: WireRequest, answer: list[RankedCandidate], labels: LabelMapping) -> None:
    expected_len = min(req.top_n, len(req.candidate_ids))
    if len(answer) != expected_len:
        raise ArtifactRejected(
            "dry_run", f"{len(answer)} results for top_n={req.top_n} of {len(req.candidate_ids)}"
        )
    ids = [c.id for c in answer]
    if len(set(ids)) != len(ids) or not set(ids) <= set(req.candidate_ids):
        raise ArtifactRejected("dry_run", "result ids are not distinct candidates of the request")
    scores = [c.score for c in answer]
    if not all(0.0 <= s <= 1.0 for s in scores):
        raise ArtifactRejected("dry_run", "a score is outside [0, 1]")
    if any(a < b for a, b in itertools.pairwise(scores)):
        raise ArtifactRejected("dry_run", "results are not sorted by score")
    if not all(c.label in labels.labels for c in answer):
        raise ArtifactRejected("dry_run", "a result carries an unknown label")


def representative_batches(norm: Normalization, seed: int = 20261008) -> list[list[WireRequest]]:
    """Service-owned warm-up requests, of the type the router sends: several batch sizes,
    dense / sparse / all-missing / extreme features, top-N below, at and above the candidate
    count, every context value."""
    rng = np.random.default_rng(seed)

    def rows(n: int, missing: float = 0.0, scale: float = 1.0) -> np.ndarray:
        raw = norm.mean + norm.std * scale * rng.standard_normal((n, NUM_FEATURES))
        drop = rng.random((n, NUM_FEATURES)) < missing
        return np.where(drop, np.nan, raw).astype(np.float32)  # NaN = missing

    def request(
        tag: str, feats: np.ndarray, top_n: int, ctx: dict[str, str | int] | None = None
    ) -> WireRequest:
        ids = tuple(f"{tag}-{i}" for i in range(len(feats)))
        return WireRequest(ids, feats, dict(ctx or {}), top_n)

    all_missing = np.full((3, NUM_FEATURES), np.nan, dtype=np.float32)
    single = [request("single", rows(1), 1)]
    mixed = [
        request("one", rows(1), 5, {"surface": "search"}),
        request("sparse", rows(7, missing=0.7), 3, {"hour_of_day": 23, "device_class": "tablet"}),
        request("extreme", rows(33, scale=1e6), 33, {"locale_bucket": "ja"}),
        request("dense", rows(64), 100),
        request(
            "empty", np.concatenate([all_missing, rows(2, missing=0.95)]), 4, {"surface": "email"}
        ),
    ]
    widest = max(len(f.values) for f in CONTEXT_FIELDS.values())
    every_context = [
        request(
            f"ctx{j}",
            rows(16, missing=0.1),
            10,
            {name: f.values[j % len(f.values)] for name, f in CONTEXT_FIELDS.items()},
        )
        for j in range(widest)
    ]
    return [single, mixed, every_context]


def _memory_estimate(
    manifest: Manifest,
    params: RankerParams,
    device: torch.device,
    compute_dtype: torch.dtype,
    budget: MemoryBudget,
    resident_bytes: int,
) -> MemoryEstimate:
    stored = PRECISIONS[manifest.precision]
    n = params.param_count
    weight_bytes = n * compute_dtype.itemsize
    file_bytes = manifest.file(WEIGHTS_FILES[manifest.runtime]).bytes
    if manifest.runtime == "safetensors":
        # Streamed (_stream_safetensors): tensors are allocated where they live and filled
        # chunk by chunk. On the CPU the bytes go straight in, or through the two staging
        # buffers when they are upcast; on a GPU a converting copy takes one chunk of the
        # device beside the (host-side, pinned) staging.
        if device.type == "cpu":
            temporaries = 0 if stored == compute_dtype else 2 * STAGING_CHUNK_BYTES
        else:
            temporaries = 0 if stored == compute_dtype else STAGING_CHUNK_BYTES
            temporaries = temporaries * compute_dtype.itemsize // stored.itemsize
    elif device.type == "cpu":
        # The verified file bytes, plus the deserialized tensors when they are upcast. The
        # file bounds what deserializing costs: compressed records are refused and declared
        # storage may not exceed the parameters (_check_zip_records, _check_declared).
        temporaries = file_bytes + (n * stored.itemsize if stored != compute_dtype else 0)
    else:
        # Tensors move to the device one at a time; the largest is the transient excess.
        largest = max(params.input_dim, params.hidden_dim) * params.hidden_dim
        temporaries = largest * compute_dtype.itemsize
    widest = max(params.input_dim, params.hidden_dim)
    workspace = DRY_RUN_MAX_ROWS * (params.input_dim + 3 * widest) * compute_dtype.itemsize
    return estimate_peak(
        budget,
        device=device,
        resident_bytes=resident_bytes,
        candidate_weight_bytes=weight_bytes,
        load_temporary_bytes=temporaries,
        warmup_workspace_bytes=workspace,
    )


def load_verified(
    artifact: VerifiedArtifact,
    *,
    device: torch.device | None = None,
    budget: MemoryBudget | None = None,
    resident_bytes: int = 0,
    control: LoadControl | None = None,
) -> LoadedModel:
    """Build, strictly load and dry-run the artifact; ArtifactRejected on any failure.
    ``control`` paces, counts (stage ``load``) and can cancel a background load
    (app.load_control): each chunk read and hashed, each dry-run forward."""
    manifest = artifact.manifest
    aid = manifest.artifact_id
    device = device or default_device()
    t0 = time.perf_counter()
    try:
        check_compatibility(manifest)
        params = ranker_params(manifest.architecture)
        compute_dtype = compute_dtype_for(manifest.precision, device)
        memory = None
        if budget is not None:
            memory = _memory_estimate(
                manifest, params, device, compute_dtype, budget, resident_bytes
            )
            check_budget(memory)
        weights_file = WEIGHTS_FILES[manifest.runtime]
        begin(
            control,
            "load",
            sum(manifest.file(f).bytes for f in (NORMALIZATION_FILE, LABEL_MAPPING_FILE))
            + manifest.file(weights_file).bytes,
        )
        normalization = Normalization.from_json(artifact.read_verified(NORMALIZATION_FILE, control))
        labels = LabelMapping.from_json(artifact.read_verified(LABEL_MAPPING_FILE, control))
        model = build_ranker(manifest.architecture, device="meta")
        if manifest.runtime == "safetensors":
            with artifact.open_stream(weights_file, control) as stream:
                state = _stream_safetensors(
                    stream, model, manifest.precision, device, compute_dtype
                )
        else:
            state = _deserialize_torch(
                artifact.read_verified(weights_file, control), model, manifest.precision
            )
        checkpoint(control)
        if manifest.runtime != "safetensors":
            _check_state(state, model, manifest.precision)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ArtifactRejected("load", f"load_state_dict: {exc}") from None
        del state
        # A no-op for streamed tensors (already on ``device`` in the compute dtype).
        model.to(device=device, dtype=compute_dtype).eval().requires_grad_(False)
        loaded = LoadedModel(
            manifest=manifest,
            model=model,
            device=device,
            compute_dtype=compute_dtype,
            normalization=normalization,
            labels=labels,
            memory=memory,
        )
        t1 = time.perf_counter()
        try:
            loaded.dry_run(control)
        except ArtifactRejected:
            loaded.close()
            raise
        except Exception as exc:  # a forward that raises is a failed dry run, not a crash
            loaded.close()
            raise ArtifactRejected("dry_run", f"{type(exc).__name__}: {exc}") from None
        loaded.timings.update(load=t1 - t0, dry_run=time.perf_counter() - t1)
        loaded.loaded_bytes = sum(
            manifest.file(f).bytes for f in (NORMALIZATION_FILE, LABEL_MAPPING_FILE, weights_file)
        )
        return loaded
    except ArtifactRejected as exc:
        if exc.artifact_id is None:
            raise ArtifactRejected(exc.category, exc.detail, artifact_id=aid) from None
        raise
