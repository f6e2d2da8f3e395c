"""Demo artifacts: deterministic bytes, two different good versions that verify and load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.cache import ArtifactCache
from app.contracts import WireRequest
from app.demo_artifacts import make_demo_artifacts, write_ranker_source
from app.errors import ConfigError
from app.loading.candidate import load_verified
from app.manifest import MANIFEST_NAME, parse_manifest
from app.models.ranker_mlp.features import FEATURE_SCHEMA, NUM_FEATURES
from tests.artifacts import TINY_PARAMS


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("runtime", ["safetensors", "pytorch-state-dict"])
def test_source_is_a_pure_function_of_seed_and_params(tmp_path: Path, runtime):
    write_ranker_source(tmp_path / "a", seed=9, params=TINY_PARAMS, runtime=runtime)
    write_ranker_source(tmp_path / "b", seed=9, params=TINY_PARAMS, runtime=runtime)
    write_ranker_source(tmp_path / "c", seed=10, params=TINY_PARAMS, runtime=runtime)
    a, b, c = (_tree(tmp_path / n) for n in "abc")
    assert set(a) == {
        "weights.safetensors" if runtime == "safetensors" else "weights.pt",
        "normalization.json",
        "label_mapping.json",
        "architecture.json",
        "metadata.json",
    }
    if runtime == "safetensors":
        assert a == b
    else:  # torch.save's zip container is not promised byte-stable; the tensors are
        assert {k: v for k, v in a.items() if k != "weights.pt"} == {
            k: v for k, v in b.items() if k != "weights.pt"
        }
        ta, tb = (torch.load(tmp_path / n / "weights.pt", weights_only=True) for n in "ab")
        assert all(torch.equal(ta[k], tb[k]) for k in ta)
    weights = next(k for k in a if k.startswith("weights."))
    assert a[weights] != c[weights]
    metadata = json.loads(a["metadata.json"])
    assert metadata["offline_evaluation"]["examples"] > 0
    assert metadata["training"] == {"seed": 9}


def test_unknown_precision_or_runtime_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="precision"):
        write_ranker_source(tmp_path / "p", seed=1, precision="int8")
    with pytest.raises(ConfigError, match="runtime"):
        write_ranker_source(tmp_path / "r", seed=1, runtime="onnx")


def test_demo_artifacts_are_deterministic_distinct_and_load(tmp_path: Path):
    first = make_demo_artifacts(tmp_path / "one")
    second = make_demo_artifacts(tmp_path / "two")
    assert [r.artifact_id for r in first] == ["ranker-v41", "ranker-v42", "ranker-lite-v1"]
    assert [r.manifest_sha256 for r in first] == [r.manifest_sha256 for r in second]
    assert first[0].manifest_sha256 != first[1].manifest_sha256

    manifests = [
        parse_manifest((r.out_dir / MANIFEST_NAME).read_bytes(), r.manifest_sha256) for r in first
    ]
    v41, v42, lite = manifests
    assert v41.feature_schema == v42.feature_schema == FEATURE_SCHEMA
    assert v41.runtime == v42.runtime == "safetensors"
    assert v41.architecture == v42.architecture
    assert v41.file("weights.safetensors").sha256 != v42.file("weights.safetensors").sha256
    assert v42.metadata["offline_evaluation"]["ndcg_at_10"] > 0
    # The fallback's model: smaller, within the guard's default 5% of v41's ndcg@10.
    assert lite.architecture.params["hidden_dim"] < v41.architecture.params["hidden_dim"]
    assert lite.offline_evaluation()["ndcg_at_10"] >= 0.95 * v41.offline_evaluation()["ndcg_at_10"]

    cache = ArtifactCache(tmp_path / "cache")
    request = WireRequest(
        tuple(f"c{i}" for i in range(5)),
        np.array([[(i * 7 + j) % 11 for j in range(NUM_FEATURES)] for i in range(5)], np.float32),
        {"surface": "search"},
        5,
    )
    answers = []
    for r in first:
        model = load_verified(
            cache.fetch_verified(r.manifest_uri, r.manifest_sha256), device=torch.device("cpu")
        )
        answers.append(model.rank_batch([request])[0])
    assert answers[0] != answers[1] != answers[2]  # different weights, different scores


def test_rerun_into_the_same_directory_is_idempotent_but_never_overwrites(tmp_path: Path):
    first = make_demo_artifacts(tmp_path)
    again = make_demo_artifacts(tmp_path)
    assert again == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ranker-lite-v1",
        "ranker-v41",
        "ranker-v42",
    ]

    manifest = tmp_path / "ranker-v42" / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes() + b" ")
    with pytest.raises(ConfigError, match="different ranker-v42"):
        make_demo_artifacts(tmp_path)
