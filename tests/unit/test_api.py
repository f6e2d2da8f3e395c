"""Request validation at the router: one pass, 422 naming the field, compact wire form."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from app.api import (
    MAX_BODY_BYTES,
    MAX_CANDIDATES,
    AnsweringModel,
    RankResponse,
)
from app.contracts import ModelMeta, RouterConfig
from app.errors import RequestInvalid
from app.models.ranker_mlp.features import NUM_FEATURES, encode_context, parse_rank_body, to_wire


def body(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "user_id": "alice",
        "context": {"surface": "search", "hour_of_day": 9},
        "candidates": [
            {"id": f"c{i}", "features": [float(i)] * (NUM_FEATURES - 1) + [None]} for i in range(3)
        ],
        "top_n": 2,
    }
    doc.update(overrides)
    return doc


def invalid(raw: bytes | dict[str, Any]) -> RequestInvalid:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(RequestInvalid) as info:
        parse_rank_body(data)
    return info.value


def test_a_valid_body_becomes_a_compact_wire_request() -> None:
    parsed = parse_rank_body(json.dumps(body()).encode())
    wire = to_wire(parsed)
    assert wire.candidate_ids == ("c0", "c1", "c2")
    assert wire.features.dtype == np.float32 and wire.features.shape == (3, NUM_FEATURES)
    assert math.isnan(wire.features[0, -1])  # null = missing, filled by the model
    assert wire.top_n == 2 and wire.context == {"surface": "search", "hour_of_day": 9}


def test_defaults() -> None:
    doc = body()
    del doc["user_id"], doc["context"], doc["top_n"]
    parsed = parse_rank_body(json.dumps(doc).encode())
    assert parsed.user_id is None and parsed.context == {} and parsed.top_n == 10


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        (body(candidates=[]), "candidates", "at least 1"),
        (body(candidates=[{"id": "a", "features": [1.0] * 79}]), "candidates[0].features", "80"),
        (body(candidates=[{"id": "", "features": [1.0] * 80}]), "candidates[0].id", "at least 1"),
        (body(top_n=0), "top_n", "greater than or equal"),
        (body(context={"surface": "moon"}), "context.surface", "not one of"),
        (body(context={"weather": "rain"}), "context.weather", "unknown context field"),
        (body(colour="red"), "colour", "Extra inputs"),
        (
            body(candidates=[{"id": "a", "features": [1.0] * 80}] * 2),
            "candidates[1].id",
            "duplicate",
        ),
        (
            body(
                candidates=[
                    {"id": f"c{i}", "features": [0.0] * 80} for i in range(MAX_CANDIDATES + 1)
                ]
            ),
            "candidates",
            "at most",
        ),
    ],
)
def test_mistakes_name_the_field(doc: dict[str, Any], field: str, words: str) -> None:
    err = invalid(doc)
    assert err.field == field, err
    assert words in err.detail, err.detail


def test_a_missing_feature_an_integral_float_hour_and_a_large_top_n_are_valid() -> None:
    doc = body(context={"hour_of_day": 13.0, "surface": "cart"}, top_n=50)
    doc["candidates"][0]["features"] = [None] * NUM_FEATURES
    wire = to_wire(parse_rank_body(json.dumps(doc).encode()))
    assert np.isnan(wire.features[0]).all() and wire.top_n == 50
    assert encode_context(wire.context) == encode_context({"hour_of_day": 13, "surface": "cart"})


@pytest.mark.parametrize(
    ("context", "field", "words"),
    [
        ({"hour_of_day": 24}, "context.hour_of_day", "not one of"),
        ({"hour_of_day": 1.5}, "context.hour_of_day", "expected an integer"),
        ({"locale_bucket": 3}, "context.locale_bucket", "expected a string"),
    ],
)
def test_context_values_of_the_wrong_kind_or_range_name_the_field(
    context: dict[str, Any], field: str, words: str
) -> None:
    err = invalid(body(context=context))
    assert (err.field, words in err.detail) == (field, True), err


def test_a_feature_that_is_not_a_number_names_its_position() -> None:
    features: list[Any] = [1.0] * NUM_FEATURES
    features[3] = "x"
    err = invalid(body(candidates=[{"id": "a", "features": features}]))
    assert err.field == "candidates[0].features[3]", err


def _with_special(position: tuple[int, int], literal: str) -> bytes:
    """A body whose feature at ``position`` is the JSON extension ``literal`` (NaN, ...),
    after a candidate whose features are all missing."""
    candidates: list[dict[str, Any]] = [{"id": "m", "features": [None] * NUM_FEATURES}]
    candidates += [{"id": f"c{i}", "features": [1.0] * NUM_FEATURES} for i in range(2)]
    candidates[position[0]]["features"][position[1]] = "SPECIAL"
    return json.dumps(body(candidates=candidates)).replace('"SPECIAL"', literal).encode()


@pytest.mark.parametrize(
    ("position", "literal"),
    [((1, 10), "NaN"), ((2, 79), "Infinity"), ((2, 0), "-Infinity")],
)
def test_nan_and_infinity_are_told_apart_from_missing_and_named_exactly(
    position: tuple[int, int], literal: str
) -> None:
    err = invalid(_with_special(position, literal))
    assert err.field == f"candidates[{position[0]}].features[{position[1]}]", err
    assert "finite" in err.detail


def test_nan_and_infinity_are_refused_with_their_position() -> None:
    raw = json.dumps(body()).replace("2.0, 2.0", "2.0, NaN", 1).encode()
    err = invalid(raw)
    assert err.field.startswith("candidates[2].features[") and "finite" in err.detail
    raw = json.dumps(body()).replace("1.0, 1.0", "1.0, Infinity", 1).encode()
    assert "finite" in invalid(raw).detail


def test_unparseable_empty_and_oversized_bodies() -> None:
    assert invalid(b"{not json").field == "body"
    assert invalid(b"").field == "body"
    assert invalid(b" " * (MAX_BODY_BYTES + 1)).field == "body"
    assert invalid(b"[1, 2]").field == "body"


def test_router_config_bounds() -> None:
    assert RouterConfig().canary_bp == 0 and not RouterConfig().allow_cohort_header
    with pytest.raises(ValidationError, match="canary_bp"):
        RouterConfig(canary_bp=10001)
    with pytest.raises(ValidationError, match="extra"):
        RouterConfig.model_validate({"canary_weight": 5})


# --------------------------------------------------------------------------- strict numbers


def _with_feature(position: tuple[int, int], value: Any) -> dict[str, Any]:
    doc = body()
    doc["candidates"][position[0]]["features"][position[1]] = value
    return doc


@pytest.mark.parametrize(
    ("position", "value", "words"),
    [
        ((0, 5), 1e39, "float32"),
        ((2, 0), -3.5e38, "float32"),
        ((1, 79), 1.7976931348623157e308, "float32"),
        ((0, 2), "1.5", "valid number"),
        ((1, 0), True, "valid number"),
        ((2, 3), False, "valid number"),
        ((0, 1), [1.0], "valid number"),
    ],
)
def test_features_are_strict_float32_numbers(
    position: tuple[int, int], value: Any, words: str
) -> None:
    err = invalid(_with_feature(position, value))
    assert err.field == f"candidates[{position[0]}].features[{position[1]}]", err
    assert words in err.detail, err.detail


def test_the_largest_float32_and_integers_are_valid_features() -> None:
    biggest = float(np.finfo(np.float32).max)
    doc = _with_feature((0, 0), biggest)
    doc["candidates"][0]["features"][1] = -biggest
    doc["candidates"][0]["features"][2] = 7  # a JSON integer is a number
    doc["candidates"][0]["features"][3] = np.nextafter(biggest, math.inf)  # rounds to biggest
    wire = to_wire(parse_rank_body(json.dumps(doc).encode()))
    assert np.isfinite(wire.features[0, :3]).all()
    assert wire.features[0, 2] == 7.0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"context": {"hour_of_day": True}}, "context.hour_of_day"),
        ({"context": {"hour_of_day": "13"}}, "context.hour_of_day"),
        ({"context": {"surface": True}}, "context.surface"),
        ({"context": {"surface": ["search"]}}, "context.surface"),
        ({"top_n": True}, "top_n"),
        ({"top_n": "5"}, "top_n"),
        ({"top_n": 5.0}, "top_n"),
        ({"user_id": 17}, "user_id"),
        ({"candidates": [{"id": 3, "features": [0.0] * NUM_FEATURES}]}, "candidates[0].id"),
    ],
)
def test_booleans_and_strings_are_not_numbers_and_numbers_not_strings(
    overrides: dict[str, Any], field: str
) -> None:
    assert invalid(body(**overrides)).field == field


def test_request_models_are_strict() -> None:
    from app.models.ranker_mlp.features import CandidateIn, RankBody

    with pytest.raises(ValidationError):
        RankBody.model_validate({**body(), "top_n": True})
    with pytest.raises(ValidationError):
        CandidateIn.model_validate({"id": "a", "features": [True] * NUM_FEATURES})
    with pytest.raises(ValidationError):
        CandidateIn.model_validate({"id": "a", "features": [1e39] * NUM_FEATURES})


# --------------------------------------------------------------------------- the answer


def test_the_rank_answer_keeps_its_keys_order_and_bytes() -> None:
    """The bytes the router has always written: json.dumps of ranking, model (with
    backbone_artifact_id always, cohort only where revealed, last) and failover."""
    meta = ModelMeta("head-a", 3, "canary", "torch-2", "replica-1", "rb-1")
    ranking = [("x", 0.75, "good"), ("y", 1e-7, "bad")]
    shown = RankResponse.from_answer(meta, ranking, failover=True, reveal_cohort=True)
    assert shown.body() == json.dumps(
        {
            "ranking": [
                {"id": "x", "score": 0.75, "label": "good"},
                {"id": "y", "score": 1e-7, "label": "bad"},
            ],
            "model": {
                "artifact_id": "head-a",
                "revision": 3,
                "runtime_build": "torch-2",
                "replica": "replica-1",
                "backbone_artifact_id": "rb-1",
                "cohort": "canary",
            },
            "failover": True,
        }
    )
    assert list(shown.headers().items()) == [
        ("X-Model-Artifact", "head-a"),
        ("X-Model-Revision", "3"),
        ("X-Model-Cohort", "canary"),
        ("X-Model-Backbone", "rb-1"),
    ]
    hidden = RankResponse.from_answer(meta._replace(backbone=None), ranking, failover=False,
                                      reveal_cohort=False)  # fmt: skip
    model = json.loads(hidden.body())["model"]
    assert "cohort" not in model and model["backbone_artifact_id"] is None
    assert "X-Model-Cohort" not in hidden.headers() and "X-Model-Backbone" not in hidden.headers()
    assert RankResponse.model_validate_json(shown.body()) == shown


@pytest.mark.parametrize("reveal_cohort", [False, True])
@pytest.mark.parametrize("backbone", [None, "rb-1"])
def test_the_fast_encoding_is_the_models_own(reveal_cohort: bool, backbone: str | None) -> None:
    """``encode`` writes the dict by hand (the router's hot path): the same text and
    headers as the model, its keys in the model's field order."""
    meta = ModelMeta("head-a", 3, "canary", "torch-2", "replica-1", backbone)
    ranking = [("x", 0.75, "good"), ("y", 0.125, "bad")]
    text, headers = RankResponse.encode(meta, ranking, failover=False, reveal_cohort=reveal_cohort)
    model = RankResponse.from_answer(meta, ranking, failover=False, reveal_cohort=reveal_cohort)
    assert text == model.body() and headers == model.headers()
    document = json.loads(text)
    assert list(document) == list(RankResponse.model_fields)
    fields = list(AnsweringModel.model_fields)
    assert list(document["model"]) == (fields if reveal_cohort else fields[:-1])
