"""Weights files crafted to cost more than they declare, on real artifacts packed on disk.

torch's zip reader inflates DEFLATE records, so a small ``weights.pt`` can expand to any size
(a 523 KB file became 512 MiB resident), and tensors used to be materialised before their
shapes were compared with the architecture. The loader refuses compressed records, checks the
shapes, dtypes and storage sizes the file declares before it reads a single tensor, and turns a
meta tensor (no data) into a ``load`` rejection. For safetensors the header is checked against
the architecture and the file before the library reads it."""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from app.compatibility import WEIGHTS_FILES
from app.errors import ArtifactRejected
from app.loading.candidate import load_verified
from app.packing import PackResult
from tests.artifacts import open_verified, pack_ranker, tiny_weights

CPU = torch.device("cpu")
PT = WEIGHTS_FILES["pytorch-state-dict"]
ST = WEIGHTS_FILES["safetensors"]


def rejected(result: PackResult) -> ArtifactRejected:
    with pytest.raises(ArtifactRejected) as info:
        load_verified(open_verified(result), device=CPU)
    return info.value


def state_dict_artifact_with(root: Path, artifact_id: str, write: Callable[[Path], None]):
    """A pytorch-state-dict artifact whose weights.pt is what ``write(path)`` puts there."""

    def edit(src: Path) -> None:
        write(src / PT)

    return pack_ranker(
        root, artifact_id=artifact_id, runtime="pytorch-state-dict", edit_source=edit
    )


def rezip(data: bytes, compression: int, replace: dict[str, bytes] | None = None) -> bytes:
    """The same archive records, written again with ``compression``; ``replace`` maps record
    names (without the archive's top directory) to new contents, and adds them if new."""
    replace = dict(replace or {})
    src = zipfile.ZipFile(io.BytesIO(data))
    top = src.infolist()[0].filename.split("/", 1)[0]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as dst:
        for info in src.infolist():
            rel = info.filename.split("/", 1)[1]
            dst.writestr(info.filename, replace.pop(rel, None) or src.read(info.filename))
        for rel, content in replace.items():
            dst.writestr(f"{top}/{rel}", content)
    return out.getvalue()


def saved(state: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


# ------------------------------------------------------------------ forged pickles of torch.save


class _StorageRef:
    """Pickled as torch.save's persistent id of a storage, with whatever numel we declare."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _TensorOn:
    """Pickled as torch.save pickles a tensor: _rebuild_tensor_v2(storage, offset, size, ...)."""

    def __init__(self, storage: _StorageRef, size: tuple[int, ...]) -> None:
        self.storage, self.size = storage, size

    def __reduce__(self):
        stride, acc = [], 1
        for dim in reversed(self.size):
            stride.insert(0, acc)
            acc *= dim
        args = (self.storage, 0, self.size, tuple(stride), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _ForgingPickler(pickle.Pickler):
    def persistent_id(self, obj: object):
        if isinstance(obj, _StorageRef):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def forged_pt(state: dict[str, object], records: dict[str, bytes]) -> bytes:
    """A torch.save archive whose data.pkl says what ``state`` says (real tensors, or
    _TensorOn views of forged storages) and whose data/<key> records are ``records``."""
    real = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    template = saved(real)
    names = zipfile.ZipFile(io.BytesIO(template)).namelist()
    top = names[0].split("/", 1)[0]
    pkl = io.BytesIO()
    # Real tensors keep torch's own pickling; forged ones get our persistent ids. Keys of
    # real tensors' storages are "0".."n-1" in save order; forged records use other keys.
    pickler = _ForgingPickler(pkl, protocol=2)
    real_refs = {}
    for index, (key, value) in enumerate(real.items()):
        real_refs[key] = _TensorOn(_StorageRef(str(index), value.numel()), tuple(value.shape))
    pickler.dump({k: real_refs.get(k, v) for k, v in state.items()})
    src = zipfile.ZipFile(io.BytesIO(template))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name in names:
            rel = name.split("/", 1)[1]
            dst.writestr(name, pkl.getvalue() if rel == "data.pkl" else src.read(name))
        for key, content in records.items():
            dst.writestr(f"{top}/data/{key}", content)
    return out.getvalue()


# ------------------------------------------------------------------ torch.save archives


def test_a_forged_archive_of_honest_tensors_loads(tmp_path):
    # The forging helper itself: with honest declarations the artifact is good.
    weights = {k: v.contiguous() for k, v in tiny_weights().items()}
    data = forged_pt(dict(weights), {})
    result = state_dict_artifact_with(tmp_path, "ranker-forged-ok", lambda p: p.write_bytes(data))
    model = load_verified(open_verified(result), device=CPU)
    assert model.artifact_id == "ranker-forged-ok"


def test_deflate_compressed_records_are_refused(tmp_path):
    def write(path: Path) -> None:
        path.write_bytes(rezip(saved(tiny_weights()), zipfile.ZIP_DEFLATED))

    err = rejected(state_dict_artifact_with(tmp_path, "ranker-deflated", write))
    assert err.category == "load", err
    assert "compressed" in err.detail and "data.pkl" in err.detail


def test_a_decompression_bomb_is_refused_before_it_is_inflated(tmp_path):
    # An extra tensor of 64 MiB of zeros: a few tens of KB once deflated. Before the fix it
    # was inflated and materialised, then refused as an unexpected key.
    state: dict[str, object] = dict(tiny_weights())
    state["blocks.9.weight"] = _TensorOn(_StorageRef("bomb", 1 << 24), (1 << 12, 1 << 12))
    stored = forged_pt(state, {"bomb": bytes(64 << 20)})

    def write(path: Path) -> None:
        path.write_bytes(rezip(stored, zipfile.ZIP_DEFLATED))

    result = state_dict_artifact_with(tmp_path, "ranker-bomb", write)
    assert (result.out_dir / PT).stat().st_size < 1 << 20
    err = rejected(result)
    assert err.category == "load" and "compressed" in err.detail, err


def test_records_that_overlap_or_overrun_the_file_are_refused(tmp_path):
    def write(path: Path) -> None:
        data = bytearray(saved(tiny_weights()))
        # Point the first central-directory entry's size past the end of the file.
        cd = data.rindex(b"PK\x01\x02")
        first = data.index(b"PK\x01\x02")
        assert first <= cd
        struct.pack_into("<II", data, first + 20, len(data) * 2, len(data) * 2)
        path.write_bytes(bytes(data))

    err = rejected(state_dict_artifact_with(tmp_path, "ranker-overrun", write))
    assert err.category == "load", err
    assert "runs past the end" in err.detail, err


def test_a_huge_declared_tensor_is_refused_from_its_declaration(tmp_path):
    # head.weight declares 2**30 elements (4 GiB): rejected for its shape, never allocated.
    weights = tiny_weights()
    state: dict[str, object] = dict(weights)
    state["head.weight"] = _TensorOn(_StorageRef("huge", 1 << 30), (1, 1 << 30))
    data = forged_pt(state, {"huge": bytes(16)})
    err = rejected(state_dict_artifact_with(tmp_path, "ranker-huge", lambda p: p.write_bytes(data)))
    assert err.category == "load", err
    assert "head.weight" in err.detail and "shape" in err.detail, err


def test_a_tensor_viewing_a_larger_storage_is_refused(tmp_path):
    # Right shape, but a view into a 4 MiB storage the model would keep alive.
    weights = tiny_weights()
    state: dict[str, object] = dict(weights)
    shape = tuple(weights["head.bias"].shape)
    state["head.bias"] = _TensorOn(_StorageRef("wide", 1 << 20), shape)
    data = forged_pt(state, {"wide": bytes(4 << 20)})
    err = rejected(state_dict_artifact_with(tmp_path, "ranker-wide", lambda p: p.write_bytes(data)))
    assert err.category == "load", err
    assert "storage" in err.detail, err


def test_an_unexpected_key_is_refused_from_its_declaration(tmp_path):
    state: dict[str, object] = dict(tiny_weights())
    state["blocks.9.weight"] = _TensorOn(_StorageRef("x", 1 << 30), (1 << 15, 1 << 15))
    data = forged_pt(state, {"x": bytes(16)})
    err = rejected(
        state_dict_artifact_with(tmp_path, "ranker-extra", lambda p: p.write_bytes(data))
    )
    assert err.category == "load" and "blocks.9.weight" in err.detail, err


def test_a_meta_tensor_is_a_load_rejection(tmp_path):
    weights = tiny_weights()
    weights["head.bias"] = torch.empty(weights["head.bias"].shape, device="meta")

    def write(path: Path) -> None:
        torch.save(weights, path)

    err = rejected(state_dict_artifact_with(tmp_path, "ranker-meta", write))
    assert err.category == "load", err
    assert "head.bias" in err.detail and "meta" in err.detail


def test_a_legacy_non_zip_torch_file_is_refused(tmp_path):
    def write(path: Path) -> None:
        torch.save(tiny_weights(), path, _use_new_zipfile_serialization=False)

    err = rejected(state_dict_artifact_with(tmp_path, "ranker-legacy", write))
    assert err.category == "load" and "zip" in err.detail, err


# ------------------------------------------------------------------ safetensors


def safetensors_with_header(header: dict[str, object], payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def safetensors_artifact_with(root: Path, artifact_id: str, data: bytes) -> PackResult:
    def edit(src: Path) -> None:
        (src / ST).write_bytes(data)

    return pack_ranker(root, artifact_id=artifact_id, edit_source=edit)


def honest_header() -> tuple[dict[str, object], bytes]:
    header: dict[str, object] = {}
    payload = b""
    for key, value in sorted(tiny_weights().items()):
        raw = value.contiguous().numpy().tobytes()
        header[key] = {
            "dtype": "F32",
            "shape": list(value.shape),
            "data_offsets": [len(payload), len(payload) + len(raw)],
        }
        payload += raw
    return header, payload


def test_safetensors_header_declaring_a_wrong_shape_is_refused_from_the_header(tmp_path):
    header, payload = honest_header()
    header["head.bias"] = dict(header["head.bias"], shape=[1 << 20])  # type: ignore[arg-type]
    result = safetensors_artifact_with(
        tmp_path, "ranker-st-shape", safetensors_with_header(header, payload)
    )
    err = rejected(result)
    assert err.category == "load", err
    assert "header" in err.detail and "head.bias" in err.detail, err


def test_safetensors_header_declaring_more_bytes_than_the_file_is_refused(tmp_path):
    header, payload = honest_header()
    begin, _end = header["head.bias"]["data_offsets"]  # type: ignore[index]
    header["head.bias"] = dict(header["head.bias"], data_offsets=[begin, begin + (1 << 30)])  # type: ignore[arg-type]
    result = safetensors_artifact_with(
        tmp_path, "ranker-st-span", safetensors_with_header(header, payload)
    )
    err = rejected(result)
    assert err.category == "load", err
    assert "header" in err.detail and "head.bias" in err.detail, err


def test_safetensors_header_longer_than_the_file_is_refused(tmp_path):
    data = struct.pack("<Q", 1 << 40) + b"{}"
    err = rejected(safetensors_artifact_with(tmp_path, "ranker-st-len", data))
    assert err.category == "load" and "header declares" in err.detail, err


def test_honest_safetensors_header_written_by_hand_loads(tmp_path):
    header, payload = honest_header()
    result = safetensors_artifact_with(
        tmp_path, "ranker-st-ok", safetensors_with_header(header, payload)
    )
    assert load_verified(open_verified(result), device=CPU).artifact_id == "ranker-st-ok"


def test_a_header_larger_than_the_architecture_allows_is_refused_before_it_is_parsed(tmp_path):
    # A genuine header padded with metadata to 4 MiB (an audit's was 65 MiB and grew the
    # process by 1.86 GiB as JSON): refused from its declared length, before a byte of it is
    # kept or parsed, with the bound and where it comes from.
    header, payload = honest_header()
    header["__metadata__"] = {"padding": "x" * (4 << 20)}
    err = rejected(
        safetensors_artifact_with(
            tmp_path, "ranker-st-big", safetensors_with_header(header, payload)
        )
    )
    assert err.category == "load", err
    assert "header declares" in err.detail and "allow at most" in err.detail, err
    assert "tensors" in err.detail and "metadata" in err.detail, err


def test_string_metadata_within_the_allowance_loads(tmp_path):
    header, payload = honest_header()
    header["__metadata__"] = {"format": "pt", "note": "n" * 4096}
    result = safetensors_artifact_with(
        tmp_path, "ranker-st-meta", safetensors_with_header(header, payload)
    )
    assert load_verified(open_verified(result), device=CPU).artifact_id == "ranker-st-meta"


def shifted(header: dict[str, object], key: str, by: int) -> dict[str, object]:
    """``header`` with ``key``'s bytes and every later tensor's ``by`` bytes further on."""
    start = header[key]["data_offsets"][0]  # type: ignore[index]
    out: dict[str, object] = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]  # type: ignore[index]
        if begin >= start:
            info = dict(info, data_offsets=[begin + by, end + by])  # type: ignore[arg-type]
        out[name] = info
    return out


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("gap", "gap"),
        ("trailing", "trailing"),
        ("late-start", "gap"),
        ("metadata-not-strings", "__metadata__"),
        ("metadata-not-object", "__metadata__"),
        ("duplicate-key", "twice"),
    ],
)
def test_what_the_reference_parser_refuses_is_refused(tmp_path, case: str, expected: str):
    """The reference safetensors parser accepts only tensors whose bytes follow each other
    from the payload's start to its end, and string-to-string metadata; so does the loader
    (and it refuses a tensor named twice, which JSON parsers resolve each their own way)."""
    header, payload = honest_header()
    last = max(header, key=lambda k: header[k]["data_offsets"][0])  # type: ignore[index]
    raw: bytes | None = None
    if case == "gap":
        header = shifted(header, last, 8)
        payload = (
            payload[: header[last]["data_offsets"][0] - 8]
            + bytes(8)
            + payload[header[last]["data_offsets"][0] - 8 :]
        )  # type: ignore[index]
    elif case == "trailing":
        payload += bytes(8)
    elif case == "late-start":
        header = shifted(header, min(header, key=lambda k: header[k]["data_offsets"][0]), 8)  # type: ignore[index]
        payload = bytes(8) + payload
    elif case == "metadata-not-strings":
        header["__metadata__"] = {"format": "pt", "epoch": 3}
    elif case == "metadata-not-object":
        header["__metadata__"] = ["format", "pt"]
    elif case == "duplicate-key":
        text = json.dumps(header)
        entry = json.dumps({last: header[last]})[1:-1]
        raw = ("{" + entry + ", " + text[1:]).encode()
    data = (
        safetensors_with_header(header, payload)
        if raw is None
        else struct.pack("<Q", len(raw)) + raw + payload
    )
    err = rejected(safetensors_artifact_with(tmp_path, f"ranker-st-{case}", data))
    assert err.category == "load", err
    assert "header" in err.detail and expected in err.detail, err
