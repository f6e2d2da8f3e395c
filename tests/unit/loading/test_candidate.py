"""The loader on real artifacts on disk: strictness, dry-run validation, precisions and
runtimes, the memory budget, and the batched request path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from app.compatibility import WEIGHTS_FILES, check_compatibility
from app.contracts import WireRequest
from app.errors import ArtifactRejected
from app.loading.candidate import load_verified
from app.loading.formats import (
    CHUNK_BYTES,
    READ_BUFFERS,
    SAFETENSORS_PARSE_BYTES_PER_BYTE,
    _expected_shapes,
    safetensors_header_limit,
)
from app.loading.memory import MemoryBudget, MiB
from app.loading.model import LoadedModel
from app.models.ranker_mlp.features import CONTEXT_FIELDS, NUM_FEATURES
from app.packing import PackResult
from app.preprocessing import LabelMapping, RankedCandidate
from app.tasks.rank import check_ranking
from tests.artifacts import (
    bad_architecture_params_artifact,
    bad_normalization_artifact,
    fetch_verified,
    flip_byte,
    garbage_weights_artifact,
    good_artifact,
    half_artifact,
    mislabeled_precision_artifact,
    missing_key_artifact,
    nan_weights_artifact,
    open_verified,
    pickle_exploit_artifact,
    state_dict_artifact,
    torch_too_new_requirement_artifact,
    truncate_file,
    unexpected_key_artifact,
    unknown_architecture_artifact,
    unknown_precision_artifact,
    unknown_runtime_artifact,
    wrong_schema_artifact,
    wrong_shape_artifact,
)

CPU = torch.device("cpu")


def _wire(ids, rows, context, top_n) -> WireRequest:
    """A request as the router hands it on: None in ``rows`` is a missing feature (NaN)."""
    return WireRequest(tuple(ids), np.asarray(rows, dtype=np.float32), context, top_n)


def _requests() -> list[WireRequest]:
    row = tuple(float(i % 7) for i in range(NUM_FEATURES))
    sparse = tuple(None if i % 3 else 2.0 for i in range(NUM_FEATURES))
    return [
        _wire(("a", "b", "c"), (row, sparse, (None,) * NUM_FEATURES), {}, 2),
        _wire(("x",), (row,), {"surface": "search", "hour_of_day": 3}, 5),
        _wire(
            tuple(f"m{i}" for i in range(20)), (row,) * 10 + (sparse,) * 10, {"surface": "cart"}, 4
        ),
    ]


def _load(result: PackResult, **kw) -> LoadedModel:
    return load_verified(open_verified(result), device=CPU, **kw)


def _scores(model: LoadedModel) -> list[list[tuple[str, float]]]:
    return [[(c.id, c.score) for c in r] for r in model.rank_batch(_requests())]


# --------------------------------------------------------------------------- good artifacts


def test_good_artifact_loads_dry_runs_and_ranks(tmp_path: Path):
    model = _load(good_artifact(tmp_path))
    assert model.artifact_id == "ranker-test"
    assert model.device == CPU and model.precision == "fp32"
    assert model.compute_dtype is torch.float32
    assert model.runtime_build == f"torch-{torch.__version__}"
    assert model.param_bytes == model.family.network.memory(model.params).param_count * 4
    assert set(model.timings) == {"load", "dry_run"}
    assert model.release_event() is None  # CPU: nothing asynchronous to wait for

    answers = model.rank_batch(_requests())
    assert [len(a) for a in answers] == [2, 1, 4]
    for req, answer in zip(_requests(), answers, strict=True):
        assert all(isinstance(c, RankedCandidate) for c in answer)
        assert {c.id for c in answer} <= set(req.candidate_ids)
        assert [c.score for c in answer] == sorted((c.score for c in answer), reverse=True)
    # The batch is one forward: each request alone gives the same answer.
    alone = [model.rank_batch([r])[0] for r in _requests()]
    assert [[c.id for c in a] for a in alone] == [[c.id for c in a] for a in answers]
    for a, b in zip(alone, answers, strict=True):
        assert [c.score for c in a] == pytest.approx([c.score for c in b], abs=1e-6)
    assert model.rank_batch([]) == []

    model.close()
    assert model.closed
    with pytest.raises(RuntimeError, match="closed"):
        model.rank_batch(_requests())


def test_different_seeds_give_different_models(tmp_path: Path):
    a = _load(good_artifact(tmp_path, artifact_id="ranker-a", seed=1))
    b = _load(good_artifact(tmp_path, artifact_id="ranker-b", seed=2))
    assert _scores(a) != _scores(b)


def test_state_dict_runtime_gives_the_same_scores_as_safetensors(tmp_path: Path):
    st = _load(good_artifact(tmp_path, seed=5))
    pt = _load(state_dict_artifact(tmp_path, seed=5))
    assert pt.manifest.runtime == "pytorch-state-dict"
    assert _scores(pt) == _scores(st)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_loads_honestly_and_computes_in_fp32_on_cpu(tmp_path: Path, precision):
    full = _load(good_artifact(tmp_path, seed=3))
    half = _load(half_artifact(tmp_path, precision=precision, seed=3))
    assert half.precision == precision  # what the artifact holds, reported as such
    assert half.compute_dtype is torch.float32  # what runs on this CPU
    tol = 0.02 if precision == "fp16" else 0.05
    for a, b in zip(_scores(full), _scores(half), strict=True):
        assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=tol)


def test_loads_through_the_real_cache(tmp_path: Path):
    result = good_artifact(tmp_path / "src")
    artifact = fetch_verified(result, tmp_path / "cache")
    assert artifact.path != result.out_dir
    model = load_verified(artifact, device=CPU)
    assert model.manifest.artifact_id == "ranker-test"


# --------------------------------------------------------------------------- rejections


REJECTIONS: list[tuple[Callable[[Path], PackResult], str, str]] = [
    (wrong_schema_artifact, "schema", "ranker-features-v2"),
    (bad_normalization_artifact, "schema", "normalization.json"),
    (unknown_runtime_artifact, "runtime", "onnx"),
    (unknown_precision_artifact, "runtime", "int8"),
    (unknown_architecture_artifact, "runtime", "ranker-transformer"),
    (bad_architecture_params_artifact, "runtime", "hidden_dim=0"),
    (lambda root: bad_architecture_params_artifact(root, depth=3), "runtime", "depth"),
    (torch_too_new_requirement_artifact, "runtime", ">=99"),
    (missing_key_artifact, "load", "missing keys ['head.bias']"),
    (unexpected_key_artifact, "load", "unexpected keys ['blocks.9.weight']"),
    (wrong_shape_artifact, "load", "shape mismatch"),
    (mislabeled_precision_artifact, "load", "precision fp16"),
    (garbage_weights_artifact, "load", "cannot deserialize"),
    (nan_weights_artifact, "dry_run", "not finite"),
    (lambda root: nan_weights_artifact(root, float("inf")), "dry_run", "not finite"),
]


@pytest.mark.parametrize(
    ("build", "category", "detail"),
    REJECTIONS,
    ids=[f"{c}-{d}" for _, c, d in REJECTIONS],
)
def test_bad_artifact_is_rejected_with_its_category(tmp_path: Path, build, category, detail):
    result = build(tmp_path)
    with pytest.raises(ArtifactRejected) as info:
        _load(result)
    assert info.value.category == category
    assert detail in info.value.detail
    assert info.value.artifact_id == result.artifact_id


def test_pickled_code_in_a_state_dict_is_never_executed(tmp_path: Path):
    marker = tmp_path / "executed"
    result = pickle_exploit_artifact(tmp_path, marker)
    with pytest.raises(ArtifactRejected) as info:
        _load(result)
    assert info.value.category == "load"
    assert not marker.exists()


def test_compatibility_is_decided_from_the_manifest_alone(tmp_path: Path):
    check_compatibility(open_verified(good_artifact(tmp_path / "g")).manifest)
    with pytest.raises(ArtifactRejected) as info:
        check_compatibility(open_verified(unknown_runtime_artifact(tmp_path / "u")).manifest)
    assert info.value.category == "runtime"


def test_bytes_are_rechecked_when_loaded(tmp_path: Path):
    flipped = good_artifact(tmp_path / "f")
    artifact = open_verified(flipped)  # verified, then the copy on disk changes
    flip_byte(flipped, WEIGHTS_FILES["safetensors"])
    with pytest.raises(ArtifactRejected) as info:
        load_verified(artifact, device=CPU)
    assert info.value.category == "digest"

    cut = good_artifact(tmp_path / "t")
    artifact = open_verified(cut)
    truncate_file(cut, "normalization.json")
    with pytest.raises(ArtifactRejected) as info:
        load_verified(artifact, device=CPU)
    assert info.value.category == "size"


# --------------------------------------------------------------------------- memory budget


def test_budget_reports_the_estimate_when_it_fits(tmp_path: Path):
    model = _load(good_artifact(tmp_path), budget=MemoryBudget(capacity_bytes=1 << 30))
    est = model.memory
    assert est is not None and est.fits and est.fits_alone
    assert est.candidate_weight_bytes == model.param_bytes
    # Safetensors stream into their tensors: no copy of the file, only the reader's two
    # chunk buffers and the header at the most the architecture allows, with what parsing it
    # may build (see test_streamed_load for what a load really holds).
    header = safetensors_header_limit(_expected_shapes(model._model))
    assert est.load_temporary_bytes == READ_BUFFERS * CHUNK_BYTES + header * (
        1 + SAFETENSORS_PARSE_BYTES_PER_BYTE
    )
    assert header < 128 << 10  # ten tensors: the 64 KiB metadata allowance dominates
    assert est.peak_bytes == sum(
        (
            est.resident_bytes,
            est.candidate_weight_bytes,
            est.load_temporary_bytes,
            est.warmup_workspace_bytes,
            est.margin_bytes,
        )
    )


def test_budget_rejects_when_double_buffering_does_not_fit(tmp_path: Path):
    result = good_artifact(tmp_path)
    budget = MemoryBudget(capacity_bytes=64 * MiB, margin_bytes=1 * MiB)
    assert _load(result, budget=budget, resident_bytes=0).memory.fits
    with pytest.raises(ArtifactRejected) as info:
        _load(result, budget=budget, resident_bytes=63 * MiB)
    assert info.value.category == "budget"
    assert "cross-pool" in info.value.detail  # it would fit with nothing resident

    with pytest.raises(ArtifactRejected) as info:
        _load(result, budget=MemoryBudget(capacity_bytes=4096, margin_bytes=0))
    assert info.value.category == "budget"
    assert "does not fit even" in info.value.detail


def test_budget_uses_device_capacity_when_not_configured(tmp_path: Path):
    est = _load(good_artifact(tmp_path), budget=MemoryBudget()).memory
    assert est is not None and est.capacity_bytes is not None and est.capacity_bytes > 0


# --------------------------------------------------------------------------- dry run


def test_representative_requests_cover_the_contract(tmp_path: Path):
    model = _load(good_artifact(tmp_path))
    batches = model.family.network.representative_batches(model.preprocessing)
    assert len({len(b) for b in batches}) >= 3  # several batch sizes
    reqs = [r for b in batches for r in b]
    assert any(r.top_n < len(r.candidate_ids) for r in reqs)
    assert any(r.top_n > len(r.candidate_ids) for r in reqs)
    assert all(r.features.dtype == np.float32 for r in reqs)  # what the router sends
    assert any(np.isnan(row).all() for r in reqs for row in r.features)
    assert any(0 < np.isnan(row).sum() < NUM_FEATURES for r in reqs for row in r.features)
    assert any(not r.context for r in reqs)
    for name, field in CONTEXT_FIELDS.items():
        assert {r.context.get(name) for r in reqs} >= set(field.values), name
    # Service-owned and deterministic: the same requests for every artifact.
    again = model.family.network.representative_batches(model.preprocessing)
    assert [[r.candidate_ids for r in b] for b in again] == [
        [r.candidate_ids for r in b] for b in batches
    ]


LABELS = LabelMapping(("low", "high"), np.array([0.0, 0.5]))
REQ = _wire(("a", "b", "c"), ((1.0,) * NUM_FEATURES,) * 3, {}, 2)


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        ([RankedCandidate("a", 0.9, "high")], "1 results for top_n=2"),
        ([RankedCandidate("a", 0.9, "high"), RankedCandidate("a", 0.8, "high")], "distinct"),
        ([RankedCandidate("a", 0.9, "high"), RankedCandidate("z", 0.8, "high")], "distinct"),
        ([RankedCandidate("a", 0.4, "low"), RankedCandidate("b", 0.8, "high")], "sorted"),
        ([RankedCandidate("a", 1.5, "high"), RankedCandidate("b", 0.8, "high")], "outside"),
        ([RankedCandidate("a", 0.9, "high"), RankedCandidate("b", 0.8, "mid")], "label"),
    ],
)
def test_output_validation_catches_broken_invariants(answer, detail):
    with pytest.raises(ArtifactRejected) as info:
        check_ranking(REQ, answer, LABELS)
    assert info.value.category == "dry_run"
    assert detail in info.value.detail
    check_ranking(
        REQ, [RankedCandidate("b", 0.9, "high"), RankedCandidate("a", 0.2, "low")], LABELS
    )


def test_dry_run_rejects_a_model_whose_forward_breaks(tmp_path: Path, monkeypatch):
    """A forward that raises or returns the wrong shape is a dry_run rejection, not a crash."""
    from app.models.ranker_mlp import network as ranker

    def wrong_shape(self, features, context):
        return torch.zeros(features.shape[0], 2)

    monkeypatch.setattr(ranker.RankerMLP, "forward", wrong_shape)
    with pytest.raises(ArtifactRejected) as info:
        _load(good_artifact(tmp_path / "a"))
    assert (info.value.category, "output shape" in info.value.detail) == ("dry_run", True)

    def raises(self, features, context):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(ranker.RankerMLP, "forward", raises)
    with pytest.raises(ArtifactRejected) as info:
        _load(good_artifact(tmp_path / "b"))
    assert info.value.category == "dry_run" and "CUBLAS" in info.value.detail
