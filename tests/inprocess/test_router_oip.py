"""The router's Open Inference Protocol routes (/v2/...), spoken to over real HTTP by the
protocol's own client library (tritonclient, with its defaults: binary tensors both ways).
The router is the deployment's own object outside Serve (tests/inprocess/doubles), its
cohorts fakes of a deployment handle, served by uvicorn on a free port.

What is checked: the metadata and readiness routes; an infer request is answered, tagged
with the model that answered, and bucketed by its user exactly as /v1/rank buckets the same
user (so its cohort follows the weights); mistakes come back as 4xx naming the tensor or
parameter, in the protocol's error shape."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import uvicorn
from starlette.requests import Request
from tritonclient.utils import InferenceServerException

from app.models.ranker_mlp.features import NUM_FEATURES
from tests.inprocess.doubles import LiveCohort, RouterClass

MODEL = "ranker-mlp"  # the served family's name
USERS = 60  # at 50% each cohort gets some with near certainty (2 * 0.5^60 to miss one)


class Asgi:
    """The router as Serve's proxy calls it: a Starlette request in, a response out."""

    def __init__(self, router: Any) -> None:
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        response = await self.router(Request(scope, receive))
        await response(scope, receive, send)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    router = RouterClass(LiveCohort("stable"), LiveCohort("canary"))
    router.reconfigure({"probe_interval_s": 0.05, "canary_bp": 5000, "reveal_cohort": True})
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            Asgi(router), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    # The probes start with the first request; /readyz says when stable is seen serving.
    while httpx.get(f"http://127.0.0.1:{port}/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the router never became ready"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def features(rows: int) -> triton.InferInput:
    data = np.random.default_rng(rows).normal(size=(rows, NUM_FEATURES)).astype(np.float32)
    data[0, 3] = np.nan  # a missing feature
    tensor = triton.InferInput("features", [rows, NUM_FEATURES], "FP32")
    tensor.set_data_from_numpy(data)  # binary, the library's default
    return tensor


def test_metadata_and_readiness_as_the_client_library_asks_for_them(url: str) -> None:
    client = triton.InferenceServerClient(url=url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert not client.is_model_ready("resnet50")
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL
    assert {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]} == {
        "features": ("FP32", [-1, NUM_FEATURES]),
        "candidate_ids": ("BYTES", [-1]),
    }
    assert [o["name"] for o in meta["outputs"]] == ["candidate_ids", "scores", "labels"]
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


def test_an_infer_request_is_answered_tagged_and_bucketed_as_v1_rank_buckets_its_user(
    url: str,
) -> None:
    client = triton.InferenceServerClient(url=url)
    ids = triton.InferInput("candidate_ids", [3], "BYTES")
    ids.set_data_from_numpy(np.array([b"a", b"b", b"c"], dtype=object))
    by_protocol: dict[str, str] = {}
    for i in range(USERS):
        user = f"user-{i}"
        result = client.infer(
            MODEL, [features(3), ids], parameters={"user_id": user, "surface": "search"}
        )
        response = result.get_response()
        tags = response["parameters"]
        cohort = tags["cohort"]
        assert response["model_name"] == MODEL
        assert response["model_version"] == tags["artifact_id"] == f"{cohort}-model"
        assert tags["revision"] == 3 and tags["failover"] is False
        # The fakes answer every request with one candidate "a".
        assert list(result.as_numpy("candidate_ids")) == [b"a"]
        np.testing.assert_array_equal(result.as_numpy("scores"), np.array([0.5], np.float32))
        by_protocol[user] = cohort
    with httpx.Client(base_url=f"http://{url}") as http:
        by_rank = {
            user: http.post(
                "/v1/rank",
                json={"user_id": user, "top_n": 1,
                      "candidates": [{"id": "a", "features": [0.1] * NUM_FEATURES}]},
            ).headers["X-Model-Cohort"]
            for user in by_protocol
        }  # fmt: skip
    assert by_protocol == by_rank  # one bucketing, whatever the protocol
    assert set(by_protocol.values()) == {"stable", "canary"}  # by the 50% weight


def test_mistakes_are_4xx_naming_the_tensor_or_parameter_in_the_protocols_shape(
    url: str,
) -> None:
    client = triton.InferenceServerClient(url=url)

    def refused(model: str, inputs: list, **parameters: Any) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, inputs, parameters=parameters or None)
        return info.value

    unknown = refused("resnet50", [features(2)])
    assert unknown.status() == "404" and "serves 'ranker-mlp'" in unknown.message()
    narrow = triton.InferInput("features", [2, 5], "FP32")
    narrow.set_data_from_numpy(np.zeros((2, 5), np.float32))
    shape = refused(MODEL, [narrow])
    assert shape.status() == "422" and "inputs.features" in shape.message()
    assert "expected [-1, 80]" in shape.message()
    surface = refused(MODEL, [features(2)], surface="moon")
    assert surface.status() == "422" and "moon" in surface.message()
    raw = httpx.post(f"http://{url}/v2/models/{MODEL}/infer", content=b"{not json")
    assert raw.status_code == 422
    assert raw.json()["error"].startswith("invalid_request: body: not a JSON document")
    assert raw.json()["field"] == "body"
    top_n = refused(MODEL, [features(2)], top_n=0)
    assert top_n.status() == "422"
    assert httpx.post(f"http://{url}/v2/models/{MODEL}/infer",
                      json={"inputs": []}).json()["field"] == "inputs"  # fmt: skip
