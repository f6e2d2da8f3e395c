"""What a replica's loader (app.loading.pipeline) refuses before a candidate is built: a manifest
of another model than the deployment serves, and a target whose URI scheme the deployment does
not read from. Real packed artifacts, a real cache, a real replica."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.cache import ArtifactCache
from app.contracts import FetchConfig, LoadingConfig, MemoryConfig
from app.errors import ArtifactRejected
from app.generations import GenerationHolder
from app.loading.memory import MemoryBudget
from app.loading.pipeline import Candidate, ModelLoader
from app.replica import RankerReplica
from tests.artifacts import pack_for_model


@pytest.fixture
def replica() -> Iterator[RankerReplica]:
    r = RankerReplica("r-model", loader_nice=0)
    yield r
    r.close()


def test_a_replica_refuses_a_manifest_of_another_model(
    replica: RankerReplica, tmp_path: Path
) -> None:
    packed = pack_for_model(tmp_path, "fraud-scorer")
    config = {
        "cohort": "canary",
        "cache_dir": str(tmp_path / "cache"),
        "target": packed.target(1).model_dump(mode="json"),
        "retry": {"initial_s": 0.01, "cap_s": 0.02, "max_attempts": 1},
    }
    with pytest.raises(ArtifactRejected) as info:
        replica.reconfigure(config)  # the startup load raises
    assert info.value.category == "schema"
    assert "'fraud-scorer'" in info.value.detail and "'ranker'" in info.value.detail


def loader_for(tmp_path: Path, loading: LoadingConfig) -> tuple[ModelLoader, list[Candidate]]:
    installed: list[Candidate] = []
    cache = ArtifactCache(tmp_path / "cache")
    holder = GenerationHolder(cleanup=lambda generation: loader.clean_up(generation))
    loader = ModelLoader(
        cache=lambda: cache,
        holder=holder,
        budget=lambda: MemoryBudget.of(MemoryConfig()),
        device=torch.device("cpu"),
        on_installed=installed.append,
        loading=lambda: loading,
    )
    return loader, installed


def test_the_served_model_is_configured(tmp_path: Path) -> None:
    packed = pack_for_model(tmp_path, "fraud-scorer")
    loader, _ = loader_for(tmp_path, LoadingConfig(model="fraud-scorer"))
    candidate = loader.load(packed.target(1))
    try:
        assert candidate.model.runtime_build
    finally:
        loader.discard(candidate)
    loader, _ = loader_for(tmp_path, LoadingConfig())
    with pytest.raises(ArtifactRejected, match=r"'ranker' is served here \(loading\.model\)"):
        loader.load(packed.target(2))


def test_a_target_outside_the_configured_schemes_is_refused_before_anything_is_read(
    tmp_path: Path,
) -> None:
    packed = pack_for_model(tmp_path, "ranker")
    loader, _ = loader_for(tmp_path, LoadingConfig(fetch=FetchConfig(schemes=("https", "s3"))))
    with pytest.raises(ArtifactRejected) as info:
        loader.load(packed.target(1))
    assert info.value.category == "path" and info.value.artifact_id == packed.artifact_id
    assert "scheme 'file' is not allowed (allowed: https, s3)" in info.value.detail
    assert not (tmp_path / "cache" / "artifacts").exists() or not any(
        (tmp_path / "cache" / "artifacts").iterdir()
    )


def test_the_replica_serves_the_model_its_loading_config_names(tmp_path: Path) -> None:
    packed = pack_for_model(tmp_path, "fraud-scorer")
    replica = RankerReplica("r", loader_nice=0)
    try:
        assert replica.reconfigure(
            {
                "cohort": "canary",
                "cache_dir": str(tmp_path / "cache"),
                "loading": {"model": "fraud-scorer"},
                "target": packed.target(1).model_dump(mode="json"),
            }
        )
    finally:
        replica.close()
