"""The ranker-features-v3 contract (pre/post-processing, artifact files) and the service-owned
ranker-mlp architecture. Request validation is the HTTP edge's: tests/unit/test_api.py."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

from app.contracts import WireRequest
from app.demo_artifacts import label_mapping_doc, normalization_doc
from app.errors import ArtifactRejected
from app.manifest import Architecture
from app.models.ranker_mlp.features import (
    CONTEXT_FIELDS,
    CONTEXT_ORDER,
    FEATURE_NAMES,
    FEATURE_SCHEMA,
    NUM_FEATURES,
    SCHEMA,
    encode_context,
)
from app.models.ranker_mlp.network import (
    KNOWN_ARCHITECTURES,
    RANKER_MLP,
    RankerMLP,
    build_ranker,
    ranker_params,
)
from app.preprocessing import LabelMapping, Normalization, RankedCandidate, rank_from_logits


def _row(value: float | None = 1.0) -> tuple[float | None, ...]:
    return (value,) * NUM_FEATURES


def _wire(
    ids: Sequence[str],
    rows: Sequence[Sequence[float | None]],
    context: Mapping[str, str | int | float],
    top_n: int,
) -> WireRequest:
    """A request as the router hands it on: None in ``rows`` is a missing feature (NaN)."""
    return WireRequest(tuple(ids), np.asarray(rows, dtype=np.float32), context, top_n)


def _norm(clip: float = 8.0) -> Normalization:
    doc = normalization_doc(7)
    doc["clip"] = clip
    return Normalization.from_json(json.dumps(doc).encode(), FEATURE_NAMES, FEATURE_SCHEMA)


LABELS = LabelMapping.from_json(json.dumps(label_mapping_doc()).encode(), FEATURE_SCHEMA)


# --------------------------------------------------------------------------- schema


def test_schema_has_80_distinct_named_features_and_typed_context_with_defaults():
    assert FEATURE_SCHEMA == "ranker-features-v3"
    assert len(FEATURE_NAMES) == NUM_FEATURES == 80
    assert len(set(FEATURE_NAMES)) == 80
    for field in CONTEXT_FIELDS.values():
        assert field.default in field.values
        assert all(isinstance(v, field.kind) for v in field.values)
    assert set(CONTEXT_ORDER) >= {"surface", "hour_of_day", "device_class", "locale_bucket"}


# --------------------------------------------------------------------------- preprocessing


def test_encode_fills_missing_normalises_clips_and_flattens_without_padding():
    norm = _norm(clip=3.0)
    big = norm.mean[0] + 100 * norm.std[0]
    req1 = _wire(("a",), ((None, *_row(None)[1:]),), {}, 1)
    req2 = _wire(
        ("b", "c"),
        ((float(big), *tuple(norm.mean[1:].tolist())), _row(None)),
        {"surface": "search", "hour_of_day": 5},
        1,
    )
    enc = SCHEMA.encode([req1, req2], norm)
    assert (
        enc.arrays["features"].shape == (3, NUM_FEATURES)
        and enc.arrays["features"].dtype == np.float32
    )
    assert enc.offsets.tolist() == [0, 1, 3]
    expected_fill = (norm.fill - norm.mean) / norm.std
    np.testing.assert_allclose(enc.arrays["features"][0], expected_fill, rtol=1e-5, atol=1e-6)
    assert enc.arrays["features"][1, 0] == pytest.approx(3.0)  # clipped from +100 std
    np.testing.assert_allclose(enc.arrays["features"][1, 1:], 0.0, atol=1e-5)
    assert np.all(np.abs(enc.arrays["features"]) <= 3.0)
    defaults = encode_context({})
    assert enc.arrays["context"][0].tolist() == list(defaults)
    assert enc.arrays["context"][1].tolist() == enc.arrays["context"][2].tolist()
    surface = CONTEXT_ORDER.index("surface")
    hour = CONTEXT_ORDER.index("hour_of_day")
    assert enc.arrays["context"][1, surface] == CONTEXT_FIELDS["surface"].values.index("search")
    assert enc.arrays["context"][1, hour] == 5


def test_every_context_value_has_its_own_index():
    for pos, (name, field) in enumerate(CONTEXT_FIELDS.items()):
        seen = {encode_context({name: v})[pos] for v in field.values}
        assert seen == set(range(len(field.values)))


# --------------------------------------------------------------------------- postprocessing


def test_top_n_sorted_by_score_ties_in_input_order_and_labels_by_band():
    reqs = [
        _wire(("a", "b", "c", "d"), (_row(),) * 4, {}, 3),
        _wire(("x", "y"), (_row(),) * 2, {}, 10),  # top_n above the candidate count
    ]
    logits = np.array([0.0, 2.0, 0.0, 2.0, -3.0, 5.0], dtype=np.float32)
    out = rank_from_logits(reqs, logits, np.array([0, 4, 6]), LABELS)
    assert [c.id for c in out[0]] == ["b", "d", "a"]  # b/d tie and a/c tie keep input order
    assert [c.id for c in out[1]] == ["y", "x"]
    top = out[0][0]
    assert top.score == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert top.label == "excellent" and out[0][2].label == "good"  # 0.88 and 0.5
    assert out[1][1].label == "poor"
    assert all(isinstance(c, RankedCandidate) for c in out[0])


# --------------------------------------------------------------------------- artifact files


def _norm_bytes(mutate) -> bytes:
    doc = normalization_doc(1)
    mutate(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["features"].pop(FEATURE_NAMES[3]),
        lambda d: d["features"].update(extra_feature={"mean": 0, "std": 1, "fill": 0}),
        lambda d: d["features"][FEATURE_NAMES[0]].update(std=0.0),
        lambda d: d["features"][FEATURE_NAMES[0]].update(mean=float("nan")),
        lambda d: d["features"][FEATURE_NAMES[0]].pop("fill"),
        lambda d: d.update(feature_schema="ranker-features-v2"),
        lambda d: d.update(clip=-1),
    ],
)
def test_bad_normalization_is_a_schema_rejection(mutate):
    with pytest.raises(ArtifactRejected) as info:
        Normalization.from_json(_norm_bytes(mutate), FEATURE_NAMES, FEATURE_SCHEMA)
    assert info.value.category == "schema"


@pytest.mark.parametrize(
    "bands",
    [
        [],
        [{"label": "a", "min_score": 0.1}],
        [{"label": "a", "min_score": 0.0}, {"label": "b", "min_score": 0.0}],
        [{"label": "a", "min_score": 0.0}, {"label": "a", "min_score": 0.5}],
        [{"label": "a", "min_score": 0.0}, {"label": "b", "min_score": 1.5}],
        [{"label": "", "min_score": 0.0}],
    ],
)
def test_bad_label_mapping_is_a_schema_rejection(bands):
    data = json.dumps({"feature_schema": FEATURE_SCHEMA, "score_bands": bands}).encode()
    with pytest.raises(ArtifactRejected) as info:
        LabelMapping.from_json(data, FEATURE_SCHEMA)
    assert info.value.category == "schema"


def test_not_json_is_a_schema_rejection():
    with pytest.raises(ArtifactRejected, match="not valid JSON"):
        Normalization.from_json(b"\xff{", FEATURE_NAMES, FEATURE_SCHEMA)


# --------------------------------------------------------------------------- architecture


def _arch(name: str = RANKER_MLP, version: int = 1, **params) -> Architecture:
    return Architecture(name=name, version=version, params=params)


def test_defaults_and_known_architectures():
    assert (RANKER_MLP, 1) in KNOWN_ARCHITECTURES
    p = ranker_params(_arch())
    assert (p.hidden_dim, p.num_layers, p.context_dim) == (64, 2, 8)


@pytest.mark.parametrize(
    "arch",
    [
        _arch(name="ranker-transformer"),
        _arch(version=2),
        _arch(hidden_dim=0),
        _arch(num_layers=257),
        _arch(num_layers=2, head_layers=2),  # a backbone keeps at least one layer
        _arch(hidden_dim=True),
        _arch(hidden_dim=8.0),
        _arch(dropout=1),
    ],
)
def test_unknown_or_invalid_architecture_is_a_runtime_rejection(arch):
    with pytest.raises(ArtifactRejected) as info:
        build_ranker(arch)
    assert info.value.category == "runtime"


@pytest.mark.parametrize(
    "params",
    [
        {"hidden_dim": 8, "num_layers": 1, "context_dim": 1},
        {"hidden_dim": 16, "num_layers": 3, "context_dim": 4},
    ],
)
def test_param_count_matches_the_built_module(params):
    model = build_ranker(_arch(**params))
    assert sum(p.numel() for p in model.parameters()) == ranker_params(_arch(**params)).param_count
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated


def test_each_candidate_is_scored_independently_of_the_others():
    torch.manual_seed(0)
    model = build_ranker(_arch(hidden_dim=8, num_layers=2, context_dim=2), device="cpu")
    assert isinstance(model, RankerMLP)
    x = torch.randn(5, NUM_FEATURES)
    ctx = torch.tensor([list(encode_context({"surface": "search"}))] * 5)
    with torch.inference_mode():
        full = model(x, ctx)
        perm = torch.tensor([4, 2, 0, 1, 3])
        permuted = model(x[perm], ctx[perm])
        other_ctx = model(x, torch.tensor([list(encode_context({"surface": "cart"}))] * 5))
    assert full.shape == (5,)
    torch.testing.assert_close(permuted, full[perm])
    assert not torch.equal(other_ctx, full)  # the context reaches the score


def test_encode_takes_nan_in_the_wire_rows_as_missing():
    """The replica hands the router's float32 rows to the model as they are: NaN there means
    missing, and is filled exactly like the fill value given outright."""
    norm = _norm()
    given = tuple(float(i) for i in range(NUM_FEATURES))
    missing = _wire(("a", "b"), (_row(None), given), {"surface": "cart"}, 1)
    filled = _wire(("a", "b"), (tuple(norm.fill.tolist()), given), {"surface": "cart"}, 1)
    assert np.isnan(missing.features[0]).all()
    a, b = SCHEMA.encode([missing], norm), SCHEMA.encode([filled], norm)
    np.testing.assert_array_equal(a.arrays["features"], b.arrays["features"])
    np.testing.assert_array_equal(a.arrays["context"], b.arrays["context"])
