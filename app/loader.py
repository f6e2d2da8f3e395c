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

import hashlib
import io
import itertools
import json
import math
import struct
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import torch
from torch import nn

from app.compatibility import PRECISION_NAMES, WEIGHTS_FILES, check_compatibility
from app.contracts import WireRequest
from app.errors import ArtifactRejected, BackboneFreed, LoadCancelled
from app.load_control import LoadControl, begin, checkpoint
from app.manifest import Architecture, BackboneRef, Manifest
from app.memory import MemoryBudget, MemoryEstimate, check_budget, estimate_peak
from app.model_family import (
    SHIPPED_FAMILIES,
    Families,
    ModelFamily,
    NetworkMemory,
    SplitForward,
    families_for,
)
from app.preprocessing import LABEL_MAPPING_FILE, LabelMapping, RankedCandidate, rank_from_logits

if TYPE_CHECKING:
    from app.cache import VerifiedArtifact

PRECISIONS: Final = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(PRECISIONS) == PRECISION_NAMES
# Largest dry-run batch in rows (candidates over all requests); sizes the warm-up workspace.
DRY_RUN_MAX_ROWS: Final = 24 * 16
# Scores of a request must not depend on what else is in its batch (beyond kernel rounding).
BATCH_INVARIANCE_ATOL: Final = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}
# What a weights file may be made of (app.loader._check_zip_records, _check_safetensors_header).
SAFETENSORS_DTYPES: Final = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
MAX_SAFETENSORS_HEADER_BYTES: Final = 100 << 20  # the safetensors format's own limit
# What a header may hold beyond its tensors' entries (safetensors_header_limit): string
# metadata, and per tensor its quoted name plus its dtype, shape and offsets spelled out
# with room for whitespace (a writer's compact entry takes about half of this).
SAFETENSORS_METADATA_ALLOWANCE: Final = 64 << 10
SAFETENSORS_ENTRY_ALLOWANCE: Final = 256
SAFETENSORS_DIMENSION_ALLOWANCE: Final = 32
# What parsing a header may build in CPython, per byte of it: an empty object in every 3
# bytes ("{},") is the worst case (25x, measured with tracemalloc); a real header's entries
# about 6x.
SAFETENSORS_PARSE_BYTES_PER_BYTE: Final = 26
MAX_ZIP_RECORDS: Final = 4096
ZIP_LOCAL_HEADER_SIGNATURE: Final = b"PK\x03\x04"
ZIP_LOCAL_HEADER_BYTES: Final = 30
ZIP_FLAG_ENCRYPTED: Final = 0x1
# Bytes read (and hashed) per call on their way into tensors: one checkpoint each,
# so a cancelled load stops within this much. The cache reads in chunks of the same size.
CHUNK_BYTES: Final = 8 << 20
# A fetch reads each file into two such buffers (app.cache), a cache hit's staged bytes
# (header, padding, a converting or GPU load) too: one is read while the other is hashed.
READ_BUFFERS: Final = 2
# What a resident backbone keeps of its dry-run outputs for the next head's dry run.
DRY_RUN_FEATURE_CACHE_BYTES: Final = 64 << 20

Shapes = dict[str, tuple[int, ...]]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def runtime_build() -> str:
    """e.g. ``torch-2.13.0+cpu`` or ``torch-2.13.0+cu130`` (the wheel's local version)."""
    return f"torch-{torch.__version__}"


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


def artifact_shapes(
    model: nn.Module, family: ModelFamily, params: Mapping[str, int], kind: str
) -> Shapes:
    """The tensors an artifact of ``kind`` holds for ``model`` (built on the meta device
    from ``params``): all of them (``model``), the family's head (``head``) or all but the
    head (``backbone``)."""
    shapes = _expected_shapes(model)
    if kind == "model":
        return shapes
    want_head = kind == "head"
    return {k: v for k, v in shapes.items() if family.is_head_key(k, params) == want_head}


def _deserialize_torch(
    data: bytes | bytearray, expected: Shapes, precision: str
) -> dict[str, torch.Tensor]:
    """The state dict in a verified ``weights.pt``, with what it declares checked against
    ``expected`` (the architecture's tensors) before a single tensor is read: its bytes can
    then cost no more than the file and the architecture say. The pickle format needs the
    whole file."""
    name = WEIGHTS_FILES["pytorch-state-dict"]
    _check_zip_records(data)
    _check_declared(_load_torch(data, "meta"), expected, precision, name)
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
    a cache entry read once (a hit). Nothing holds the file: the 8-byte length is checked
    against a bound the architecture sets (``safetensors_header_limit``), the header is kept
    and checked against the architecture, then every tensor is allocated where it will live
    (``device``, the compute dtype) and filled as its bytes pass. The header is accepted only
    where its tensors' bytes follow each other to the file's end, as the reference parser
    requires; the skipping of bytes between spans below is a guard that such a header never
    reaches.

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
        *,
        expected: Shapes | None = None,
    ) -> None:
        self._size = file_bytes
        # The tensors the file must hold (default: every tensor of ``model``).
        self._expected = expected if expected is not None else _expected_shapes(model)
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

    def destination(self, limit: int) -> memoryview | None:
        """Where the next (up to ``limit``) bytes go when they can be read straight into
        their tensor's memory (CPU, same dtype, inside a tensor): the reader reads into this
        view and calls ``placed``, with no staging copy. None: feed them instead (the
        header, padding, a converting load, a failed one)."""
        if self._error is not None or not self._direct or not self._header_read:
            return None
        if self._next_span == len(self._spans):
            return None
        start, end, key = self._spans[self._next_span]
        if self._at < start or self._at >= end:
            return None
        offset = self._at - start
        n = min(end - self._at, limit)
        flat = self._state[key].view(-1)
        return memoryview(flat.view(torch.uint8).numpy())[offset : offset + n]

    def wanted(self, left: int) -> int:
        """How many of the ``left`` next bytes to ``feed`` in one piece when ``destination``
        gives no view: the rest of the length or header, the padding before the next tensor,
        else a chunk."""
        if self._error is None and not self._header_read:
            preamble = 8 if self._header_len is None else 8 + self._header_len
            return max(1, min(preamble - len(self._preamble), left, CHUNK_BYTES))
        if self._error is None and self._direct and self._next_span < len(self._spans):
            start = self._spans[self._next_span][0]
            if self._at < start:
                return min(start - self._at, left, CHUNK_BYTES)
        return min(CHUNK_BYTES, left)

    def placed(self, n: int) -> None:
        """``n`` bytes were read into the view ``destination`` gave."""
        self.fed += n
        self._at += n
        _, end, _ = self._spans[self._next_span]
        if self._at == end:
            self._next_span += 1
            self._elements_done = 0

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
            # Bounded by the architecture before a byte of it is kept: the file's digest is
            # only known at its end, and parsing a crafted header of many MiB costs many
            # times its size in memory.
            limit = safetensors_header_limit(self._expected)
            if header_len > limit:
                raise _unreadable(
                    name,
                    f"header declares {header_len} bytes; the architecture's "
                    f"{len(self._expected)} tensors allow at most {limit} (their names, "
                    f"shapes and offsets, and {SAFETENSORS_METADATA_ALLOWANCE} bytes of "
                    "metadata)",
                )
            self._header_len = header_len
        if self._header_len is not None and len(self._preamble) == 8 + self._header_len:
            self._payload = self._size - 8 - self._header_len
            self._spans = _check_safetensors_header(
                bytes(self._preamble[8:]), self._payload, self._expected, self._precision
            )
            self._preamble = bytearray()
            self._header_read = True
            self._state = {
                key: torch.empty(shape, dtype=self._compute, device=self._device)
                for key, shape in self._expected.items()
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


def _check_declared(state: object, expected: Shapes, precision: str, name: str) -> None:
    """What a torch state dict declares (read on the meta device), before its data is read:
    the architecture's keys, shapes and dtype, and no more storage than the parameters need
    (a tensor viewing a larger storage would keep all of it alive in the model)."""
    _check_flat(state, name)
    assert isinstance(state, dict)
    _check_state(state, expected, precision)
    declared = sum(t.untyped_storage().nbytes() for t in state.values())
    needed = sum(t.numel() * t.element_size() for t in state.values())
    if declared > needed:
        raise ArtifactRejected(
            "load",
            f"{name} declares {declared} bytes of tensor storage for {needed} bytes of "
            "parameters (a tensor is a view of a larger storage); save each tensor on its own",
        )


def safetensors_header_limit(expected: Shapes) -> int:
    """The most bytes a safetensors header of the tensors ``expected`` may take: each entry's
    JSON-quoted name and an allowance for its dtype, shape and offsets, the metadata
    allowance, and the format's padding to 8 bytes."""
    entries = sum(
        len(json.dumps(key)) + SAFETENSORS_ENTRY_ALLOWANCE
        + SAFETENSORS_DIMENSION_ALLOWANCE * len(shape)
        for key, shape in expected.items()
    )  # fmt: skip
    return min(entries + SAFETENSORS_METADATA_ALLOWANCE + 8, MAX_SAFETENSORS_HEADER_BYTES)


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object with a key given twice is refused: parsers disagree on which one wins."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _check_safetensors_header(
    header_bytes: bytes, payload: int, expected: Shapes, precision: str
) -> list[tuple[int, int, str]]:
    """The safetensors header (its JSON, after the 8-byte length) against the architecture
    and the file, before a tensor is read: the right keys, dtype and shapes, string-only
    metadata, and byte ranges of exactly each tensor's size that follow each other from the
    start of the ``payload`` (the bytes after the header) to its end, as the reference parser
    requires: no gap, no overlap, no trailing bytes. Returns the ranges in file order, with
    their tensor names."""
    name = WEIGHTS_FILES["safetensors"]
    try:
        header = json.loads(header_bytes, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:
        raise _unreadable(name, f"header names {str(exc)!r} twice") from None
    except ValueError:  # UnicodeDecodeError included
        raise _unreadable(name, "header is not JSON") from None
    if not isinstance(header, dict):
        raise _unreadable(name, "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ArtifactRejected("load", f"{name} header: __metadata__ must map strings to strings")
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
        if start > end:
            raise ArtifactRejected(
                "load", f"{name} header: a gap of {start - end} bytes between {first} and {second}"
            )
    if spans and spans[0][0] != 0:
        raise ArtifactRejected(
            "load", f"{name} header: a gap of {spans[0][0]} bytes before {spans[0][2]}"
        )
    covered = spans[-1][1] if spans else 0
    if covered != payload:
        raise ArtifactRejected(
            "load",
            f"{name} header: {payload - covered} trailing bytes after the last tensor",
        )
    return spans


def _unreadable(name: str, problem: str) -> ArtifactRejected:
    return ArtifactRejected("load", f"cannot deserialize {name}: {problem}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _expected_shapes(model: nn.Module) -> Shapes:
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


def _check_state(state: dict[str, torch.Tensor], expected: Shapes, precision: str) -> None:
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
                _check_ranking(req, answer, self.labels)
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
    state = _deserialize_torch(
        artifact.read_verified(weights_file, control), load.expected, manifest.precision
    )
    _check_state(state, load.expected, manifest.precision)
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
    (app.load_control): each chunk read and hashed, each dry-run forward. ``prepared``: the
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
