"""Turn a verified artifact into a servable model, or reject it with a category.

    compatibility -> memory budget -> build from service code (meta device) -> what the
    weights file declares (stored zip records / safetensors header: keys, shapes, dtypes,
    sizes) checked before any tensor is read -> strict load of the verified bytes ->
    placement -> eval -> dry run on service-owned requests -> output validation -> CUDA
    synchronize

The model is service code: the family registered for the manifest's architecture
(``app.model_family``) builds it, preprocesses requests, runs its forward and supplies its dry
run; nothing here knows one family from another.

Rejections (ArtifactRejected): ``runtime`` (runtime, precision, architecture or torch version
not supported), ``schema`` (feature schema, the family's preprocessing files, label files),
``load`` (bytes that do not deserialize, missing/unexpected keys, shapes, dtypes), ``dry_run``
(failed or invalid output on representative requests, the family's invariants), ``budget``
(would not fit next to the resident model), and ``size``/``digest`` from re-checking the
bytes read.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import struct
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from torch import nn

from app.contracts import WireRequest
from app.errors import ArtifactRejected
from app.load_control import LoadCancelled, LoadControl, begin, checkpoint
from app.manifest import Manifest
from app.memory import MemoryBudget, MemoryEstimate, check_budget, estimate_peak
from app.model_family import SHIPPED_FAMILIES, Families, ModelFamily, NetworkMemory, families_for
from app.preprocessing import LABEL_MAPPING_FILE, LabelMapping, RankedCandidate, rank_from_logits

if TYPE_CHECKING:
    from app.cache import VerifiedArtifact

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
# Bytes read (and hashed) per call on their way into tensors: one checkpoint each,
# so a cancelled load stops within this much. The cache reads in chunks of the same size.
CHUNK_BYTES: Final = 8 << 20
# A fetch reads each file into two such buffers (app.cache), a cache hit into one.
READ_BUFFERS: Final = 2


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


def check_compatibility(manifest: Manifest, families: Families | None = None) -> ModelFamily:
    """Can this service run the artifact at all? Its family (of ``families``, default every
    family the service ships); ArtifactRejected ``runtime`` / ``schema``."""
    aid = manifest.artifact_id
    families = families or families_for(SHIPPED_FAMILIES)
    if manifest.runtime not in WEIGHTS_FILES:
        raise ArtifactRejected(
            "runtime",
            f"unknown runtime {manifest.runtime!r} (supported: {sorted(WEIGHTS_FILES)})",
            artifact_id=aid,
        )
    if manifest.precision not in PRECISIONS:
        raise ArtifactRejected(
            "runtime",
            f"unknown precision {manifest.precision!r} (supported: {sorted(PRECISIONS)})",
            artifact_id=aid,
        )
    try:
        family, spec = families.resolve(manifest.architecture)
        spec.validate(manifest.architecture)
        if manifest.feature_schema != family.schema.name:
            raise ArtifactRejected(
                "schema",
                f"feature schema {manifest.feature_schema!r}; architecture {spec.name} "
                f"(family {family.name}) reads {family.schema.name!r}",
            )
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
    for needed in (WEIGHTS_FILES[manifest.runtime], LABEL_MAPPING_FILE):
        if needed not in listed:
            raise ArtifactRejected(
                "schema",
                f"runtime {manifest.runtime} needs {needed!r} in the artifact",
                artifact_id=aid,
            )
    for needed in family.schema.preprocessing_files:
        if needed not in listed:
            raise ArtifactRejected(
                "schema",
                f"feature schema {family.schema.name} needs {needed!r} in the artifact",
                artifact_id=aid,
            )
    return family


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


def _deserialize_torch(
    data: bytes | bytearray, model: nn.Module, precision: str
) -> dict[str, torch.Tensor]:
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


class SafetensorsAssembler:
    """Builds the state dict of ``weights.safetensors`` from its bytes fed in file order, in
    chunks of any size: from the cache's download as it hashes them (a cold fetch), or from
    a cache entry read once (a hit). Nothing holds the file: the 8-byte length and the header
    are kept, checked against the architecture, then every tensor is allocated where it will
    live (``device``, the compute dtype) and filled as its bytes pass; padding between
    tensors is passed over (the reader hashes it like every other byte).

    The bytes are not trusted yet when they arrive: the caller's digest check over the same
    bytes decides, and on a mismatch everything built is dropped. So a malformed header is
    not raised at once: the error is kept, the rest is ignored, and ``state()`` raises it
    only once the caller has found the bytes to be the verified ones (a byte flipped in
    transit is then a retryable ``digest``, not a final ``load``)."""

    def __init__(
        self,
        file_bytes: int,
        model: nn.Module,
        precision: str,
        device: torch.device,
        compute_dtype: torch.dtype,
    ) -> None:
        self._size = file_bytes
        self._model = model
        self._precision = precision
        self._stored = PRECISIONS[precision]
        self._device = device
        self._compute = compute_dtype
        # Same dtype on the CPU: bytes are copied straight into the tensor's memory.
        self._direct = device.type == "cpu" and self._stored == compute_dtype
        self._preamble = bytearray()
        self._header_len: int | None = None
        self._header_read = False  # the header was checked and the tensors allocated
        self._spans: list[tuple[int, int, str]] = []
        self._next_span = 0
        self._at = 0  # payload bytes passed so far
        self._payload = 0
        self._state: dict[str, torch.Tensor] = {}
        self._carry = bytearray()  # the start of an element a chunk boundary split
        self._elements_done = 0  # of the current tensor (converted path)
        self._error: ArtifactRejected | None = None
        self.fed = 0

    def feed(self, chunk: memoryview) -> None:
        """The next bytes of the file (any size). Never raises for what the bytes hold."""
        self.fed += len(chunk)
        if self._error is not None:
            return
        try:
            self._feed(chunk.cast("B") if chunk.format != "B" else chunk)
        except ArtifactRejected as exc:
            self._fail(exc)
        except torch.OutOfMemoryError as exc:
            # The budget said it would fit and it did not (another process took the memory):
            # worth another attempt, like any budget refusal.
            self._fail(ArtifactRejected("budget", f"out of memory while loading: {exc}"))
        except Exception as exc:  # e.g. a header nested past the parser's recursion limit
            name = WEIGHTS_FILES["safetensors"]
            self._fail(_unreadable(name, f"{type(exc).__name__}: {exc}"))

    def _fail(self, error: ArtifactRejected) -> None:
        self._error = error
        self._state = {}  # the tensors go now, not when the reader is done

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors, once all bytes were fed and found to be the verified ones."""
        if self._error is not None:
            raise self._error
        name = WEIGHTS_FILES["safetensors"]
        if self.fed != self._size or not self._header_read:
            raise _unreadable(name, f"{self.fed} of {self._size} bytes were read")
        while self._next_span < len(self._spans) and self._spans[self._next_span][:2] == (
            self._at,
            self._at,
        ):
            self._next_span += 1  # empty tensors at the very end take no bytes
        if self._next_span != len(self._spans) or self._carry:
            raise _unreadable(name, "the file ended inside a tensor")
        state, self._state = self._state, {}
        return state

    def _feed(self, chunk: memoryview) -> None:
        name = WEIGHTS_FILES["safetensors"]
        while chunk:
            if not self._header_read:
                chunk = self._take_preamble(chunk, name)
                continue
            if self._next_span == len(self._spans):
                self._at += len(chunk)  # padding after the last tensor
                return
            start, end, key = self._spans[self._next_span]
            if self._at < start:
                n = min(start - self._at, len(chunk))  # padding before this tensor
            else:
                n = min(end - self._at, len(chunk))
                self._write(key, self._at - start, chunk[:n])
            self._at += n
            chunk = chunk[n:]
            if self._at == end:
                self._next_span += 1
                self._elements_done = 0

    def _take_preamble(self, chunk: memoryview, name: str) -> memoryview:
        wanted = 8 if self._header_len is None else 8 + self._header_len
        n = min(wanted - len(self._preamble), len(chunk))
        self._preamble += chunk[:n]
        if len(self._preamble) == 8 and self._header_len is None:
            if self._size < 8:
                raise _unreadable(name, f"header: the file is {self._size} bytes")
            (header_len,) = struct.unpack("<Q", self._preamble)
            if header_len > min(self._size - 8, MAX_SAFETENSORS_HEADER_BYTES):
                raise _unreadable(
                    name,
                    f"header declares {header_len} bytes; the file has {self._size - 8} after "
                    f"the length (max {MAX_SAFETENSORS_HEADER_BYTES})",
                )
            self._header_len = header_len
        if self._header_len is not None and len(self._preamble) == 8 + self._header_len:
            self._payload = self._size - 8 - self._header_len
            self._spans = _check_safetensors_header(
                bytes(self._preamble[8:]), self._payload, self._model, self._precision
            )
            self._preamble = bytearray()
            self._header_read = True
            shapes = _expected_shapes(self._model)
            self._state = {
                key: torch.empty(shapes[key], dtype=self._compute, device=self._device)
                for key in shapes
            }
        return chunk[n:]

    def _write(self, key: str, offset: int, piece: memoryview) -> None:
        flat = self._state[key].view(-1)
        if self._direct:
            memoryview(flat.view(torch.uint8).numpy())[offset : offset + len(piece)] = piece
            return
        itemsize = self._stored.itemsize
        if self._carry:  # complete the element a chunk boundary split
            n = min(itemsize - len(self._carry), len(piece))
            self._carry += piece[:n]
            piece = piece[n:]
            if len(self._carry) < itemsize:
                return
            self._convert(flat, memoryview(self._carry))
            self._carry = bytearray()
        whole = len(piece) - len(piece) % itemsize
        if whole:
            self._convert(flat, piece[:whole])
        self._carry += piece[whole:]

    def _convert(self, flat: torch.Tensor, raw: memoryview) -> None:
        """Whole elements of the stored dtype into the next places of ``flat`` (upcast on
        the CPU, or a copy to the GPU)."""
        count = len(raw) // self._stored.itemsize
        source = torch.frombuffer(raw, dtype=self._stored)
        flat[self._elements_done : self._elements_done + count].copy_(source)
        self._elements_done += count


def _load_torch(data: bytes | bytearray, map_location: str) -> Any:
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


def _check_zip_records(data: bytes | bytearray) -> None:
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


def _check_declared(state: object, model: nn.Module, precision: str, name: str) -> None:
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
    header_bytes: bytes, payload: int, model: nn.Module, precision: str
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


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
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


def _check_state(state: dict[str, torch.Tensor], model: nn.Module, precision: str) -> None:
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
    ) -> None:
        self.manifest = manifest
        self.artifact_id = manifest.artifact_id
        self.precision = manifest.precision  # what the artifact holds
        self.compute_dtype = compute_dtype  # what runs (fp32 on CPU, see compute_dtype_for)
        self.device = device
        self.runtime_build = runtime_build()
        self.family = family
        self.params: Mapping[str, int] = dict(params)
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
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
        network = self.family.network

        def score(requests: Sequence[WireRequest]) -> list[np.ndarray]:
            checkpoint(control)
            logits, offsets = self._logits(requests)
            scores = _sigmoid(logits.float().cpu().numpy())
            return [scores[offsets[i] : offsets[i + 1]] for i in range(len(requests))]

        for batch in network.representative_batches(self.preprocessing):
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


class CandidateLoad:
    """One candidate's load, from its manifest to a model: what the service can serve and
    the memory budget are checked before a single weights byte is read (``start``), then
    the weights are assembled as they pass, once.

    It is the cache's fetch sink (``app.cache.FetchSink``): on a cold fetch the cache calls
    ``start`` once the manifest is verified and feeds the weights file's bytes as it hashes
    them on their way into the cache, so they are read and hashed once in all; on a hit
    nothing is fed, and ``load_verified`` reads the entry once instead."""

    def __init__(
        self,
        *,
        device: torch.device | None = None,
        budget: MemoryBudget | None = None,
        resident_bytes: int = 0,
        expect: Callable[[Manifest], None] | None = None,
        families: Families | None = None,
    ) -> None:
        self.device = device or default_device()
        self.families = families or families_for(SHIPPED_FAMILIES)
        self.expect = expect  # the caller's own checks of the manifest, run first
        self.budget = budget
        self.resident_bytes = resident_bytes
        self.manifest: Manifest | None = None
        self.memory: MemoryEstimate | None = None
        self.compute_dtype = torch.float32
        self.model: nn.Module | None = None
        self.family: ModelFamily | None = None
        self.params: dict[str, int] = {}
        self.assembler: SafetensorsAssembler | None = None

    def start(self, manifest: Manifest) -> dict[str, Callable[[memoryview], None]]:
        """Checks, budget, the model on the meta device; the consumer of the weights' bytes
        (none for the pickle format, which needs the whole file)."""
        if self.expect is not None:
            self.expect(manifest)
        family = check_compatibility(manifest, self.families)
        _, spec = self.families.resolve(manifest.architecture)
        params = spec.validate(manifest.architecture)
        self.compute_dtype = compute_dtype_for(manifest.precision, self.device)
        if self.budget is not None:
            self.memory = _memory_estimate(
                manifest, family.network.memory(params), self.device, self.compute_dtype,
                self.budget, self.resident_bytes,
            )  # fmt: skip
            check_budget(self.memory)
        self.manifest = manifest
        self.family, self.params = family, params
        with torch.device("meta"):  # nothing allocated, nothing initialised
            self.model = family.network.build(params)
        if manifest.runtime != "safetensors":
            return {}
        weights = WEIGHTS_FILES["safetensors"]
        self.assembler = SafetensorsAssembler(
            manifest.file(weights).bytes,
            self.model,
            manifest.precision,
            self.device,
            self.compute_dtype,
        )
        return {weights: self.assembler.feed}

    @property
    def fed(self) -> bool:
        """The weights arrived with the fetch (all of them: the fetch verified them)."""
        return self.assembler is not None and self.assembler.fed > 0


def _memory_estimate(
    manifest: Manifest,
    network: NetworkMemory,
    device: torch.device,
    compute_dtype: torch.dtype,
    budget: MemoryBudget,
    resident_bytes: int,
) -> MemoryEstimate:
    stored = PRECISIONS[manifest.precision]
    n = network.param_count
    weight_bytes = n * compute_dtype.itemsize
    file_bytes = manifest.file(WEIGHTS_FILES[manifest.runtime]).bytes
    if manifest.runtime == "safetensors":
        # Streamed (SafetensorsAssembler): tensors are allocated where they live and filled
        # as the bytes pass, so beside them only the reader's chunk buffers, on the host (on
        # a GPU a converting copy converts a chunk on the host too: nothing on the device).
        temporaries = READ_BUFFERS * CHUNK_BYTES if device.type == "cpu" else 0
    elif device.type == "cpu":
        # The verified file bytes, plus the deserialized tensors when they are upcast. The
        # file bounds what deserializing costs: compressed records are refused and declared
        # storage may not exceed the parameters (_check_zip_records, _check_declared).
        temporaries = file_bytes + (n * stored.itemsize if stored != compute_dtype else 0)
    else:
        # Tensors move to the device one at a time; the largest is the transient excess.
        temporaries = network.largest_tensor * compute_dtype.itemsize
    workspace = DRY_RUN_MAX_ROWS * network.workspace_per_row * compute_dtype.itemsize
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
    (app.cache.VerifiedStream) and handed to ``assembler``; the digest decides at the end."""
    # Pinned for a GPU: the copy to the device is a DMA from it. The assembler has copied a
    # chunk out before the next is read into the same buffer.
    buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
    whole = memoryview(buffer.numpy())
    with artifact.open_stream(rel, control) as stream:
        while stream.position < stream.size:
            view = whole[: min(CHUNK_BYTES, stream.size - stream.position)]
            stream.readinto(view)
            assembler.feed(view)
        stream.finish()


def load_verified(
    artifact: VerifiedArtifact,
    *,
    device: torch.device | None = None,
    budget: MemoryBudget | None = None,
    resident_bytes: int = 0,
    control: LoadControl | None = None,
    prepared: CandidateLoad | None = None,
    families: Families | None = None,
) -> LoadedModel:
    """Build, strictly load and dry-run the artifact; ArtifactRejected on any failure.
    ``control`` paces, counts (stage ``load``) and can cancel a background load
    (app.load_control): each chunk read and hashed, each dry-run forward. ``prepared``: the
    load that was the fetch's sink (its checks done; its weights fed if the fetch was cold);
    without it one is made here, with ``device``, ``budget``, ``resident_bytes`` and
    ``families`` (default: every family the service ships)."""
    manifest = artifact.manifest
    aid = manifest.artifact_id
    t0 = time.perf_counter()
    try:
        load = prepared or CandidateLoad(
            device=device, budget=budget, resident_bytes=resident_bytes, families=families
        )
        if load.manifest is None:
            load.start(manifest)
        elif load.manifest != manifest:
            raise ValueError("the prepared load is for another manifest")
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
        if load.assembler is not None:
            if read_here > small:
                _read_into(artifact, weights_file, load.assembler, device, control)
            state = load.assembler.state()
        else:
            state = _deserialize_torch(
                artifact.read_verified(weights_file, control), model, manifest.precision
            )
            _check_state(state, model, manifest.precision)
        checkpoint(control)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ArtifactRejected("load", f"load_state_dict: {exc}") from None
        del state
        # A no-op for streamed tensors (already on ``device`` in the compute dtype).
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
        )
        load.model = None  # the loaded model owns it now
        t1 = time.perf_counter()
        try:
            loaded.dry_run(control)
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
        if exc.artifact_id is None:
            raise ArtifactRejected(exc.category, exc.detail, artifact_id=aid) from None
        raise
