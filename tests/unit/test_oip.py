"""The Open Inference Protocol codec (app/ingress/oip.py) and the rank task's tensors
(app/tasks/rank.py ``RankTensors``): bodies made by the protocol's own client library
(tritonclient builds them without a server) decode to the arrays it was given, answers encode
to what it reads back, and every malformed body is a 4xx naming its field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tritonclient.http as triton

from app.errors import RequestInvalid
from app.ingress.oip import OutputTensor, decode_infer, encode_infer, model_metadata
from app.models.ranker_mlp.features import NUM_FEATURES, SCHEMA
from app.models.two_tower.features import SCHEMA as TWO_TOWER
from app.tasks.rank import OIP_OUTPUTS, oip_outputs

RANKER = SCHEMA.oip


def client_body(inputs, outputs=None, **kwargs) -> tuple[bytes, str | None]:
    body, json_size = triton.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, **kwargs
    )
    return body, (None if json_size is None else str(json_size))


def tensor(name: str, array: np.ndarray, datatype: str, binary: bool = True) -> triton.InferInput:
    one = triton.InferInput(name, list(array.shape), datatype)
    one.set_data_from_numpy(array, binary_data=binary)
    return one


def invalid(body: bytes, header: str | None = None) -> RequestInvalid:
    with pytest.raises(RequestInvalid) as info:
        decode_infer(body, header)
    return info.value


FEATURES = np.arange(3 * NUM_FEATURES, dtype=np.float32).reshape(3, NUM_FEATURES) / 100
FEATURES[1, 4] = np.nan  # a missing feature
IDS = np.array([b"item-a", b"item-b", "item-\u00e9".encode()], dtype=object)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_what_the_client_library_sends_decodes_to_its_arrays(binary: bool) -> None:
    body, header = client_body(
        [
            tensor("features", FEATURES, "FP32", binary),
            tensor("candidate_ids", IDS, "BYTES", binary),
        ],
        request_id="r-7",
        parameters={"user_id": "u-1", "top_n": 2, "surface": "search"},
    )
    assert (header is not None) == binary
    request = decode_infer(body, header)
    assert request.id == "r-7"
    assert request.parameters == {"user_id": "u-1", "top_n": 2, "surface": "search",
                                  **({"binary_data_output": True})}  # fmt: skip
    np.testing.assert_array_equal(request.inputs["features"], FEATURES)  # NaN where it was
    assert request.inputs["features"].dtype == np.float32
    assert list(request.inputs["candidate_ids"]) == list(IDS)
    assert request.outputs is None and request.binary_default  # the library's default


def test_json_data_may_be_nested_and_null_is_a_missing_value() -> None:
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
                       "data": [[1.5, None], [3, 4]]}],
           "outputs": [{"name": "scores"},
                       {"name": "labels", "parameters": {"binary_data": True}}]}  # fmt: skip
    request = decode_infer(json.dumps(doc).encode(), None)
    x = request.inputs["x"]
    assert x.shape == (2, 2) and x[0, 0] == 1.5 and math.isnan(x[0, 1]) and x[1, 1] == 4
    assert request.outputs == {"scores": False, "labels": True}


@pytest.mark.parametrize(
    ("doc", "field", "detail"),
    [
        ({"inputs": []}, "inputs", "1 to 64 tensors"),
        ({"inputs": [{"name": "x", "datatype": "FP128", "shape": [1], "data": [1]}],},
         "inputs[0].datatype", "'FP128' is not one of"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]},
         "inputs[0].data", "1 elements for shape [2] (2)"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": []}]},
         "inputs[0].shape", "integers >= 0"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1 << 12, 1 << 12], "data": []}]},
         "inputs[0].shape", "over the limit"),
        ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1.5]}]},
         "inputs[0].data", "INT64 elements must be integers"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["1"]}]},
         "inputs[0].data", "must be numbers"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]},
                     {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]},
         "inputs[1].name", "given twice"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]},
         "inputs[0]", "no data"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
          "parameters": {"user_id": ["a"]}}, "parameters.user_id", "boolean, number or string"),
    ],
)  # fmt: skip
def test_a_malformed_json_request_names_its_field(doc: dict, field: str, detail: str) -> None:
    error = invalid(json.dumps(doc).encode())
    assert error.field == field and detail in error.detail, (error.field, error.detail)
    assert error.status == 422


def test_a_malformed_binary_request_names_its_field() -> None:
    body, header = client_body([tensor("features", FEATURES, "FP32")])
    assert header is not None
    assert invalid(body, "x").field == "Inference-Header-Content-Length"
    assert "not within" in invalid(body, str(len(body) + 1)).detail
    cut = invalid(body[:-4], header)  # the tensor's bytes run past the body
    assert cut.field == "inputs[0].parameters.binary_data_size" and "past the body" in cut.detail
    extra = invalid(body + b"\0\0", header)
    assert extra.field == "body" and "2 bytes after the last binary tensor" in extra.detail
    # A BYTES tensor whose element claims more bytes than there are.
    ids, ids_header = client_body([tensor("candidate_ids", IDS[:1], "BYTES")])
    doc_length = int(ids_header or 0)
    broken = ids[:doc_length] + (99).to_bytes(4, "little") + ids[doc_length + 4 :]
    assert "runs past the tensor" in invalid(broken, ids_header).detail


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_an_answer_reads_back_in_the_client_library(binary: bool) -> None:
    body, header = client_body(
        [tensor("features", FEATURES, "FP32")],
        outputs=[
            triton.InferRequestedOutput(n, binary_data=binary) for n in ("candidate_ids", "scores")
        ],
        request_id="r-9",
    )
    request = decode_infer(body, header)
    ranking = [("item-b", 0.75, "high"), ("item-\u00e9", 0.25, "low")]
    answer = encode_infer(
        model_name="ranker-mlp",
        model_version="ranker-v42",
        request=request,
        outputs=oip_outputs(ranking),
        parameters={"artifact_id": "ranker-v42", "revision": 3, "failover": False},
    )
    length = answer.headers.get("Inference-Header-Content-Length")
    assert (length is not None) == binary
    result = triton.InferResult.from_response_body(
        answer.body, header_length=None if length is None else int(length)
    )
    response = result.get_response()
    assert response["model_name"] == "ranker-mlp" and response["model_version"] == "ranker-v42"
    assert response["id"] == "r-9" and response["parameters"]["revision"] == 3
    assert [o["name"] for o in response["outputs"]] == ["candidate_ids", "scores"]  # as asked
    # The library gives BYTES as bytes from binary data, as str from JSON.
    ids = [x if isinstance(x, bytes) else x.encode() for x in result.as_numpy("candidate_ids")]
    assert ids == [b"item-b", "item-\u00e9".encode()]
    np.testing.assert_array_equal(result.as_numpy("scores"), np.array([0.75, 0.25], np.float32))
    assert result.as_numpy("labels") is None


def test_without_outputs_named_every_output_comes_as_the_request_asked() -> None:
    one = {"name": "features", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}
    request = decode_infer(json.dumps({"inputs": [one]}).encode(), None)
    outputs = [OutputTensor("scores", "FP32", np.array([0.5, math.nan], np.float32))]
    answer = encode_infer(model_name="m", model_version=None, request=request, outputs=outputs,
                          parameters={})  # fmt: skip
    doc = json.loads(answer.body)
    assert answer.media_type == "application/json" and "model_version" not in doc
    assert doc["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [2],
                               "data": [0.5, None]}]  # fmt: skip


def test_the_metadata_lists_the_familys_tensors() -> None:
    meta = model_metadata("ranker-mlp", (), RANKER.inputs, OIP_OUTPUTS)
    assert meta["inputs"] == [
        {"name": "features", "datatype": "FP32", "shape": [-1, NUM_FEATURES]},
        {"name": "candidate_ids", "datatype": "BYTES", "shape": [-1], "optional": True},
    ]
    assert [o["name"] for o in meta["outputs"]] == ["candidate_ids", "scores", "labels"]
    two_tower = [t.name for t in TWO_TOWER.oip.inputs]
    assert two_tower == ["features", "candidate_ids", "user_features"]


# ------------------------------------------------------------------ the rank task's tensors


def test_tensors_and_parameters_build_the_familys_body_and_it_parses() -> None:
    request = decode_infer(*client_body(
        [tensor("features", FEATURES, "FP32"), tensor("candidate_ids", IDS, "BYTES")],
        parameters={"user_id": "u-1", "top_n": 2, "surface": "search", "hour_of_day": 7},
    ))  # fmt: skip
    body = RANKER.body(request.inputs, request.parameters)
    assert body["top_n"] == 2 and body["user_id"] == "u-1"
    assert body["context"] == {"surface": "search", "hour_of_day": 7}
    assert [c["id"] for c in body["candidates"]] == ["item-a", "item-b", "item-\u00e9"]
    assert body["candidates"][1]["features"][4] is None  # NaN: missing
    parsed = SCHEMA.parse(json.dumps(body).encode())
    assert parsed.user_id == "u-1" and parsed.wire.top_n == 2
    np.testing.assert_array_equal(parsed.wire.features, FEATURES)
    # Without ids or top_n: rows are "0", "1", ... and every row is ranked.
    plain = RANKER.body({"features": FEATURES}, {})
    assert [c["id"] for c in plain["candidates"]] == ["0", "1", "2"] and plain["top_n"] == 3


@pytest.mark.parametrize(
    ("tensors", "parameters", "field", "detail"),
    [
        ({}, {}, "inputs.features", "missing"),
        (
            {"features": FEATURES.astype(np.float64)},
            {},
            "inputs.features",
            "expected datatype FP32",
        ),
        ({"features": FEATURES[:, :5]}, {}, "inputs.features", "shape [3, 5], expected [-1, 80]"),
        ({"features": FEATURES, "extra": FEATURES}, {}, "inputs", "unknown inputs ['extra']"),
        ({"features": FEATURES}, {"colour": "red"}, "parameters", "unknown parameters ['colour']"),
        ({"features": FEATURES, "candidate_ids": IDS[:2]}, {}, "inputs.candidate_ids", "shape [3]"),
    ],
)
def test_a_request_the_family_cannot_read_names_the_tensor_or_parameter(
    tensors: dict, parameters: dict, field: str, detail: str
) -> None:
    with pytest.raises(RequestInvalid) as info:
        RANKER.body(tensors, parameters)
    assert info.value.field == field and detail in info.value.detail, info.value


def test_the_familys_own_refusals_are_named_by_tensor_and_parameter() -> None:
    def refused(tensors: dict, parameters: dict) -> tuple[str, str]:
        with pytest.raises(RequestInvalid) as info:
            SCHEMA.parse(json.dumps(RANKER.body(tensors, parameters)).encode())
        return RANKER.field(info.value.field), info.value.detail

    field, detail = refused({"features": FEATURES}, {"surface": "moon"})
    assert field == "parameters.surface" and "moon" in detail
    field, _ = refused({"features": FEATURES}, {"top_n": 0})
    assert field == "parameters.top_n"
    huge = FEATURES.copy()
    huge[2, 0] = np.inf
    with pytest.raises(RequestInvalid) as info:
        RANKER.body({"features": huge}, {})
    assert info.value.field == "inputs.features[2]" and "not finite" in info.value.detail
    same = np.array([b"x", b"x", b"y"], dtype=object)
    field, detail = refused({"features": FEATURES, "candidate_ids": same}, {})
    assert field == "inputs.candidate_ids[1]" and "duplicate" in detail


def test_a_family_with_a_per_request_vector_reads_it_from_its_own_tensor() -> None:
    from app.models.two_tower.features import NUM_ITEM_FEATURES, NUM_USER_FEATURES

    items = np.zeros((2, NUM_ITEM_FEATURES), np.float32)
    user = np.linspace(-1, 1, NUM_USER_FEATURES, dtype=np.float32)
    mapping = TWO_TOWER.oip
    body = mapping.body({"features": items, "user_features": user}, {"surface": "feed"})
    parsed = TWO_TOWER.parse(json.dumps(body).encode())
    np.testing.assert_array_equal(parsed.wire.query, user)
    assert parsed.wire.candidate_ids == ("0", "1") and parsed.wire.context == {"surface": "feed"}
    with pytest.raises(RequestInvalid) as info:
        mapping.body({"features": items}, {})
    assert info.value.field == "inputs.user_features" and info.value.detail == "missing"
    assert mapping.field("user.features") == "inputs.user_features"
    assert mapping.field("items[1].id") == "inputs.candidate_ids[1]"
