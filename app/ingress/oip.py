"""The Open Inference Protocol (KServe v2 / Triton HTTP) on the router: the codec.

KServe and Triton clients speak it: ``GET /v2/models/{name}`` (metadata),
``GET /v2/models/{name}/ready``, ``POST /v2/models/{name}/infer`` with named tensors. A
tensor is a name, a shape, a datatype and its elements, either in the JSON document
(``data``, row-major, flat or nested) or, with Triton's binary tensor extension (what the
``tritonclient`` library sends by default), as raw bytes after the JSON document: the
request's ``Inference-Header-Content-Length`` header gives the JSON's length and each such
input's ``parameters.binary_data_size`` its bytes, in input order. ``BYTES`` elements are
strings, in binary each a 4-byte little-endian length and the bytes.

This module turns a request body into named numpy arrays (``decode_infer``) and named
arrays into an answer (``encode_infer``); what the tensors mean is the family's
(``RequestSchema.oip``) and the task's. Pure: numpy and the standard library.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from app.errors import RequestInvalid
from app.ingress.answers import HttpAnswer

# The header that splits a body into its JSON document and the binary tensors after it.
HEADER_LENGTH: Final = "inference-header-content-length"
OCTET_STREAM: Final = "application/octet-stream"
# Element counts beyond any request the families accept (2048 candidates x a few hundred
# features); the body cap bounds bytes, this bounds what a shape may claim.
MAX_ELEMENTS: Final = 1 << 22
MAX_TENSORS: Final = 64
MAX_RANK: Final = 8

DATATYPES: Final[Mapping[str, np.dtype[Any]]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
Parameter = bool | int | float | str


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a model's metadata: ``-1`` in ``shape`` is any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "datatype": self.datatype,
                               "shape": list(self.shape)}  # fmt: skip
        if self.optional:
            out["optional"] = True
        return out


@dataclass(frozen=True)
class InferRequest:
    """A decoded ``/infer`` body."""

    id: str | None
    parameters: Mapping[str, Parameter]
    inputs: Mapping[str, np.ndarray]
    # The outputs asked for, each with whether it goes binary; None: every output, binary
    # when ``binary_default`` (the request's ``binary_data_output``).
    outputs: Mapping[str, bool] | None = None
    binary_default: bool = False


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    array: np.ndarray


def _invalid(where: str, detail: str) -> RequestInvalid:
    return RequestInvalid(where, detail)


def _parameters(raw: Any, where: str) -> dict[str, Parameter]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _invalid(where, f"expected an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if not isinstance(value, bool | int | float | str):
            raise _invalid(f"{where}.{key}", f"expected a boolean, number or string, got "
                                             f"{type(value).__name__}")  # fmt: skip
    return dict(raw)


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_RANK:
        raise _invalid(where, f"expected a list of at most {MAX_RANK} sizes")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise _invalid(where, f"sizes must be integers >= 0, got {raw}")
    count = math.prod(raw)
    if count > MAX_ELEMENTS:
        raise _invalid(where, f"{count} elements is over the limit of {MAX_ELEMENTS}")
    return tuple(raw)


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _from_json(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    flat = _flatten(data)
    count = math.prod(shape)
    if len(flat) != count:
        raise _invalid(where, f"{len(flat)} elements for shape {list(shape)} ({count})")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise _invalid(where, "BYTES elements in JSON must be strings")
        return np.array([v.encode() for v in flat], dtype=object).reshape(shape)
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise _invalid(where, "BOOL elements must be true or false")
    elif datatype.startswith(("INT", "UINT")):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise _invalid(where, f"{datatype} elements must be integers")
    else:
        # null is a missing value (NaN): JSON has no NaN.
        if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                   for v in flat):  # fmt: skip
            raise _invalid(where, f"{datatype} elements must be numbers (or null: missing)")
        flat = [math.nan if v is None else v for v in flat]
    try:
        return np.array(flat, dtype=DATATYPES[datatype]).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise _invalid(where, f"an element does not fit {datatype}: {exc}") from None


def _bytes_elements(raw: bytes, count: int, where: str) -> np.ndarray:
    out: list[bytes] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise _invalid(where, "a BYTES element's 4-byte length is cut off")
        (size,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + size > len(raw):
            raise _invalid(where, f"a BYTES element of {size} bytes runs past the tensor")
        out.append(raw[at : at + size])
        at += size
    if len(out) != count:
        raise _invalid(where, f"{len(out)} BYTES elements for {count}")
    return np.array(out, dtype=object)


def _from_binary(raw: bytes, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        return _bytes_elements(raw, count, where).reshape(shape)
    dtype = DATATYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise _invalid(where, f"{len(raw)} bytes for {count} {datatype} elements "
                              f"({count * dtype.itemsize})")  # fmt: skip
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def decode_infer(body: bytes, header_length: str | None) -> InferRequest:
    """An ``/infer`` body (JSON, or JSON then binary tensors); RequestInvalid names the
    field (``inputs[1].shape``) and the rule."""
    if header_length is None:
        document, rest = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise _invalid("Inference-Header-Content-Length", "not an integer") from None
        if not 0 < length <= len(body):
            raise _invalid("Inference-Header-Content-Length",
                           f"{length} is not within the body's {len(body)} bytes")  # fmt: skip
        document, rest = body[:length], body[length:]
    try:
        doc = json.loads(document)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _invalid("body", f"not a JSON document: {exc}") from None
    if not isinstance(doc, dict):
        raise _invalid("body", "expected a JSON object")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _invalid("id", "expected a string")
    parameters = _parameters(doc.get("parameters"), "parameters")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not 1 <= len(raw_inputs) <= MAX_TENSORS:
        raise _invalid("inputs", f"expected a list of 1 to {MAX_TENSORS} tensors")
    inputs: dict[str, np.ndarray] = {}
    at = 0
    for i, tensor in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise _invalid(where, "expected an object")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{where}.name", "expected a non-empty string")
        if name in inputs:
            raise _invalid(f"{where}.name", f"input {name!r} given twice")
        datatype = tensor.get("datatype")
        if datatype not in DATATYPES:
            raise _invalid(
                f"{where}.datatype", f"{datatype!r} is not one of {', '.join(DATATYPES)}"
            )
        shape = _shape(tensor.get("shape"), f"{where}.shape")
        tensor_parameters = _parameters(tensor.get("parameters"), f"{where}.parameters")
        size = tensor_parameters.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise _invalid(f"{where}.parameters.binary_data_size", "expected an integer >= 0")
            if "data" in tensor:
                raise _invalid(where, "both data and binary_data_size given")
            if at + size > len(rest):
                raise _invalid(f"{where}.parameters.binary_data_size",
                               f"{size} bytes past the body's end")  # fmt: skip
            inputs[name] = _from_binary(rest[at : at + size], datatype, shape, f"{where}.data")
            at += size
        elif "data" in tensor:
            inputs[name] = _from_json(tensor["data"], datatype, shape, f"{where}.data")
        else:
            raise _invalid(where, "no data (nor binary_data_size)")
    if at != len(rest):
        raise _invalid("body", f"{len(rest) - at} bytes after the last binary tensor")
    outputs: dict[str, bool] | None = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list) or len(raw_outputs) > MAX_TENSORS:
            raise _invalid("outputs", f"expected a list of at most {MAX_TENSORS} outputs")
        outputs = {}
        for i, wanted in enumerate(raw_outputs):
            if not isinstance(wanted, dict) or not isinstance(wanted.get("name"), str):
                raise _invalid(f"outputs[{i}]", "expected an object with a name")
            params = _parameters(wanted.get("parameters"), f"outputs[{i}].parameters")
            outputs[wanted["name"]] = bool(params.get("binary_data", False))
    return InferRequest(
        id=request_id,
        parameters=parameters,
        inputs=inputs,
        outputs=outputs,
        binary_default=bool(parameters.get("binary_data_output", False)),
    )


def _serialize_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def _json_data(array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in flat]
    values = flat.tolist()
    if datatype.startswith("FP"):
        return [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
    return values


def encode_infer(
    *,
    model_name: str,
    model_version: str | None,
    request: InferRequest,
    outputs: Sequence[OutputTensor],
    parameters: Mapping[str, Parameter],
    headers: Mapping[str, str] | None = None,
) -> HttpAnswer:
    """The answer to ``request`` (200, with ``headers``): the outputs it asked for (all when
    it named none), each in JSON or binary as it asked. RequestInvalid names an output the
    model does not have."""
    known = {o.name: o for o in outputs}
    if request.outputs is None:
        chosen = [(o, request.binary_default) for o in outputs]
    else:
        unknown = sorted(set(request.outputs) - set(known))
        if unknown:
            raise _invalid("outputs", f"unknown outputs {unknown} (known: {', '.join(known)})")
        chosen = [(known[name], binary) for name, binary in request.outputs.items()]
    tensors: list[dict[str, Any]] = []
    binary_parts: list[bytes] = []
    for output, binary in chosen:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.array.shape),
        }
        if binary:
            raw = (
                _serialize_bytes(output.array)
                if output.datatype == "BYTES"
                else np.ascontiguousarray(output.array, dtype=DATATYPES[output.datatype]).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(raw)}
            binary_parts.append(raw)
        else:
            entry["data"] = _json_data(output.array, output.datatype)
        tensors.append(entry)
    document: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        document["model_version"] = model_version
    if request.id is not None:
        document["id"] = request.id
    document["parameters"] = dict(parameters)
    document["outputs"] = tensors
    text = json.dumps(document).encode()
    if not binary_parts:
        return HttpAnswer(200, text, dict(headers or {}))
    return HttpAnswer(
        200,
        text + b"".join(binary_parts),
        {**(headers or {}), "Inference-Header-Content-Length": str(len(text))},
        media_type=OCTET_STREAM,
    )


def model_metadata(
    name: str, versions: Iterable[str], inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> dict[str, Any]:
    """``GET /v2/models/{name}``."""
    return {
        "name": name,
        "versions": list(versions),
        "platform": "ray-serve-rollout",
        "inputs": [t.metadata() for t in inputs],
        "outputs": [t.metadata() for t in outputs],
    }
