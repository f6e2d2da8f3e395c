"""The shadow phase's demo candidates (app/demo_artifacts.py ``make_shadow_artifacts``),
replayed against ranker-v41 with the real loader (app/replay.py): identical models do not
diverge, the two packaging bugs diverge far, ranker-v43 carries what replay measured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.cache import ArtifactCache
from app.contracts import ExpectedDivergence
from app.demo_artifacts import (
    SHADOW_FINE_TUNED,
    SHADOW_PERMUTED,
    SHADOW_RENORM,
    SHADOW_REPLAY_REQUESTS,
    make_demo_artifacts,
    make_shadow_artifacts,
)
from app.errors import ConfigError
from app.loading.candidate import load_verified
from app.loading.model import LoadedModel
from app.manifest import MANIFEST_NAME, parse_manifest
from app.models.ranker_mlp.features import NUM_FEATURES
from app.packing import PackResult
from app.replay import generated_requests, replay
from rollout.cli import main

# Few requests: the bugs are far off, and v43's recorded figures are checked against a
# replay of the first of the requests they were measured on.
REQUESTS = 200


@dataclass
class Shadow:
    root: Path
    packed: dict[str, PackResult]  # the demo's and the shadow phase's artifacts
    models: dict[str, LoadedModel]


@pytest.fixture(scope="module")
def shadow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shadow]:
    root = tmp_path_factory.mktemp("shadow")
    demo = {p.artifact_id: p for p in make_demo_artifacts(root / "store")}
    packed = {**demo, **make_shadow_artifacts(root / "store", demo["ranker-v41"])}
    cache = ArtifactCache(root / "cache")
    models = {
        aid: load_verified(
            cache.fetch_verified(packed[aid].manifest_uri, packed[aid].manifest_sha256),
            device=torch.device("cpu"),
        )
        for aid in ("ranker-v41", SHADOW_RENORM, SHADOW_PERMUTED, SHADOW_FINE_TUNED)
    }
    yield Shadow(root, packed, models)
    for model in models.values():
        model.close()


def _manifest(result: PackResult):
    return parse_manifest((result.out_dir / MANIFEST_NAME).read_bytes(), result.manifest_sha256)


def test_identical_models_do_not_diverge(shadow: Shadow) -> None:
    v41 = shadow.models["ranker-v41"]
    totals = replay(v41, v41, generated_requests(50))
    assert totals.compared == 50
    assert totals.rbo_mean == 1.0 and totals.overlap_mean == 1.0
    assert totals.top1_change_rate == 0.0 and max(totals.score_diffs) == 0.0


@pytest.mark.parametrize("bug", [SHADOW_RENORM, SHADOW_PERMUTED])
def test_the_packaging_bugs_diverge_far_from_v41(shadow: Shadow, bug: str) -> None:
    totals = replay(shadow.models["ranker-v41"], shadow.models[bug], generated_requests(REQUESTS))
    summary = totals.summary()
    # Measured (1000 requests): renorm RBO 0.37, top-1 0.90; permuted RBO 0.44, top-1 0.85.
    assert summary["rbo_mean"] < 0.55, summary
    assert summary["top1_change_rate"] > 0.7, summary
    # Far outside ranker-v43's band too (its recorded figures +/- the default tolerance 0.05).
    v43 = ExpectedDivergence.from_metadata(_manifest(shadow.packed[SHADOW_FINE_TUNED]).metadata)
    assert v43 is not None
    assert summary["rbo_mean"] < v43.rbo_mean - 0.2
    assert summary["top1_change_rate"] > v43.top1_change_rate + 0.2


def test_v43_carries_the_divergence_replay_measures(shadow: Shadow) -> None:
    v41 = shadow.packed["ranker-v41"]
    block = ExpectedDivergence.from_metadata(_manifest(shadow.packed[SHADOW_FINE_TUNED]).metadata)
    assert block is not None
    assert block.baseline_artifact_id == "ranker-v41"
    assert block.baseline_manifest_sha256 == v41.manifest_sha256
    assert (block.requests, block.top_k, block.rbo_p) == (SHADOW_REPLAY_REQUESTS, 10, 0.9)
    assert block.source == f"generated: {SHADOW_REPLAY_REQUESTS} requests, seed 7"
    # A legitimate change that absolute limits (mean RBO >= 0.9, top-1 <= 0.1) would refuse.
    assert 0.7 <= block.rbo_mean <= 0.85 and 0.2 <= block.top1_change_rate <= 0.4
    assert block.overlap_mean > block.rbo_mean
    # The first requests of the recorded set, replayed again, measure about the same.
    totals = replay(
        shadow.models["ranker-v41"], shadow.models[SHADOW_FINE_TUNED], generated_requests(REQUESTS)
    )
    assert totals.rbo_mean == pytest.approx(block.rbo_mean, abs=0.05)
    assert totals.top1_change_rate == pytest.approx(block.top1_change_rate, abs=0.08)


def test_the_bugs_are_v41s_weights_and_the_evaluations_say_nothing(shadow: Shadow) -> None:
    v41, renorm, permuted, v43 = (
        shadow.packed[a] for a in ("ranker-v41", SHADOW_RENORM, SHADOW_PERMUTED, SHADOW_FINE_TUNED)
    )
    weights = {p.artifact_id: load_file(p.out_dir / "weights.safetensors") for p in (v41, permuted)}
    m41, mre, mperm, m43 = (_manifest(p) for p in (v41, renorm, permuted, v43))
    # renorm: the very weights, another normalization.
    assert mre.file("weights.safetensors").sha256 == m41.file("weights.safetensors").sha256
    assert mre.file("normalization.json").sha256 != m41.file("normalization.json").sha256
    # permuted: the same normalization; only the first layer's feature columns moved.
    assert mperm.file("normalization.json").sha256 == m41.file("normalization.json").sha256
    a, b = weights["ranker-v41"]["blocks.0.weight"], weights[SHADOW_PERMUTED]["blocks.0.weight"]
    assert torch.equal(a[:, NUM_FEATURES:], b[:, NUM_FEATURES:])
    assert not torch.equal(a[:, :NUM_FEATURES], b[:, :NUM_FEATURES])
    columns = {tuple(a[:, j].tolist()) for j in range(NUM_FEATURES)}
    assert columns == {tuple(b[:, j].tolist()) for j in range(NUM_FEATURES)}
    assert all(
        torch.equal(t, weights[SHADOW_PERMUTED][k])
        for k, t in weights["ranker-v41"].items()
        if k != "blocks.0.weight"
    )
    for manifest in (mre, mperm, m43):
        assert manifest.offline_evaluation()["ndcg_at_10"] > 0
        assert manifest.metadata["training"]["derived_from"] == "ranker-v41"
    assert mre.offline_evaluation() == mperm.offline_evaluation() == m41.offline_evaluation()
    assert ExpectedDivergence.from_metadata(mre.metadata) is None
    assert ExpectedDivergence.from_metadata(mperm.metadata) is None


def test_make_shadow_artifacts_is_idempotent_but_never_overwrites(shadow: Shadow, capsys) -> None:
    store = shadow.root / "store"
    # Again into the same directory, through the command (make_demo_artifacts, then
    # make_shadow_artifacts): the same artifacts, one JSON line each, nothing left over.
    assert main(["make-demo-artifacts", str(store), "--shadow"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [p.as_json() for p in shadow.packed.values()]
    assert [line["artifact_id"] for line in lines[-3:]] == [
        SHADOW_RENORM,
        SHADOW_PERMUTED,
        SHADOW_FINE_TUNED,
    ]
    assert sorted(p.name for p in store.iterdir()) == sorted(shadow.packed)

    with pytest.raises(ConfigError, match="derive from ranker-v41"):
        make_shadow_artifacts(store, shadow.packed["ranker-v42"])

    # A copy elsewhere with another ranker-v43 already there is refused, nothing replaced.
    other = shadow.root / "other"
    other.mkdir()
    (other / SHADOW_FINE_TUNED).mkdir()
    manifest = other / SHADOW_FINE_TUNED / MANIFEST_NAME
    edited = json.loads((shadow.packed[SHADOW_FINE_TUNED].out_dir / MANIFEST_NAME).read_text())
    edited["metadata"]["expected_divergence"]["rbo_mean"] = 0.99
    manifest.write_text(json.dumps(edited))
    with pytest.raises(ConfigError, match=f"different {SHADOW_FINE_TUNED}"):
        make_shadow_artifacts(other, shadow.packed["ranker-v41"])
    assert json.loads(manifest.read_text()) == edited
