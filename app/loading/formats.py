"""The weights files, checked before a tensor is read: a zip's stored records or a safetensors
header (keys, shapes, dtypes, sizes) against what the family's model holds, the streamed
safetensors assembler, and the strict key/shape/dtype checks of a loaded state."""

from __future__ import annotations

import io
import itertools
import json
import math
import struct
import zipfile
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn

from app.compatibility import WEIGHTS_FILES
from app.errors import ArtifactRejected
from app.loading.device import PRECISIONS
from app.model_family import (
    ModelFamily,
)

# What a weights file may be made of (_check_zip_records, _check_safetensors_header).
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


Shapes = dict[str, tuple[int, ...]]


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


def deserialize_torch(
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
    check_state(state, expected, precision)
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


def check_state(state: dict[str, torch.Tensor], expected: Shapes, precision: str) -> None:
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
