"""Artifacts in an S3-compatible store (moto's server on loopback, behind a proxy that can
stall): the cache reads them in parallel ranges with per-read timeouts, reads a stalled
range again and keeps the others (a broken transfer resumes), refuses a truncated object
before reading it, and a replica's loader fetches and loads a 256 MiB artifact from there in
one pass (64 MiB tensors, read in many ranges). Marked ``objectstore``, so it can also run
alone."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.cache import ArtifactCache
from app.contracts import MemoryConfig
from app.errors import ArtifactRejected, FetchFailed
from app.generations import GenerationHolder
from app.loading.memory import MemoryBudget
from app.loading.pipeline import ModelLoader
from app.packing import PackResult
from tests.artifacts import pack_ranker
from tests.object_store import S3Server

pytestmark = pytest.mark.objectstore

WIDE = {"hidden_dim": 2048, "num_layers": 4, "context_dim": 16}  # ~50 MiB, 16 MiB tensors
# One pass is asserted by counters (bytes read from the store, bytes read again from the
# cache), which do not depend on the size: 256 MiB (was ~0.94 GiB, 61 s of the tier's time).
# What a GiB-scale load holds in memory is measured in tests/unit/loading/test_streamed_load.py.
LARGE = {"hidden_dim": 4096, "num_layers": 5, "context_dim": 16}  # ~0.25 GiB


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server.start(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory, s3: S3Server) -> tuple[PackResult, str]:
    packed = pack_ranker(tmp_path_factory.mktemp("wide"), artifact_id="s3-wide", params=WIDE)
    return packed, s3.upload_dir(packed.out_dir, "artifacts", "wide/v1")


def loader_for(cache: ArtifactCache) -> ModelLoader:
    holder = GenerationHolder(cleanup=lambda generation: loader.clean_up(generation))
    loader = ModelLoader(
        cache=lambda: cache,
        holder=holder,
        budget=lambda: MemoryBudget.of(MemoryConfig()),
        device=torch.device("cpu"),
        on_installed=lambda candidate: None,
    )
    return loader


def test_an_artifact_is_fetched_in_parallel_ranges_and_verified(
    s3: S3Server, wide: tuple[PackResult, str], tmp_path: Path
) -> None:
    packed, uri = wide
    fetch = s3.fetch_config(part_bytes=4 << 20, parallel_parts=4)
    cache = ArtifactCache(tmp_path / "cache", fetch=fetch)
    got = cache.fetch_verified(uri, packed.manifest_sha256)
    assert not got.cached
    for item in got.manifest.files:  # the bytes in the cache are the packed ones
        assert (got.path / item.path).read_bytes() == (packed.out_dir / item.path).read_bytes()


def test_a_range_that_stalls_is_read_again_and_the_rest_is_kept(
    s3: S3Server, wide: tuple[PackResult, str], tmp_path: Path
) -> None:
    packed, uri = wide
    # The store stops sending 3 MiB into an answer and holds the connection: after the
    # read timeout that range alone is requested again; the file completes and verifies.
    part = 8 << 20
    fetch = s3.fetch_config(read_timeout_s=2.0, part_bytes=part, retry_initial_s=0.1)
    cache = ArtifactCache(tmp_path / "cache", fetch=fetch)
    s3.proxy.stall_after(3 << 20)
    stalls, passed = s3.proxy.stalls, s3.proxy.bytes_back
    got = cache.fetch_verified(uri, packed.manifest_sha256)
    assert s3.proxy.stalls == stalls + 1
    assert not got.cached
    # Resumed, not restarted: the store sent the artifact once, plus the part of the one
    # range that stalled (and the answers' headers).
    sent = s3.proxy.bytes_back - passed
    assert got.manifest.total_bytes <= sent < got.manifest.total_bytes + part, sent


def test_a_store_that_keeps_stalling_is_a_fetch_failure_after_the_retries(
    s3: S3Server,
    wide: tuple[PackResult, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    packed, uri = wide
    fetch = s3.fetch_config(
        read_timeout_s=0.5, part_bytes=64 << 20, part_retries=1, parallel_parts=1,
        retry_initial_s=0.1,
    )  # fmt: skip
    s3.proxy.stall_after(1 << 20, times=None)  # every answer, every time
    try:
        with (
            caplog.at_level(logging.WARNING, logger="app.artifact_store"),
            pytest.raises(FetchFailed) as info,
        ):
            ArtifactCache(tmp_path / "cache", fetch=fetch).fetch_verified(
                uri, packed.manifest_sha256
            )
    finally:
        s3.proxy.stall_after(None)
    assert "read timeout" in str(info.value) or "timed out" in str(info.value), info.value
    retried = [r.getMessage() for r in caplog.records if "reading them again" in r.getMessage()]
    assert len(retried) == 1, retried  # part_retries=1: one more attempt, then the failure
    assert not list((tmp_path / "cache" / "artifacts").iterdir())  # nothing half-published


def test_a_truncated_object_is_refused_before_its_bytes_are_read(
    s3: S3Server, tmp_path: Path
) -> None:
    packed = pack_ranker(tmp_path / "src", artifact_id="s3-cut", params=WIDE, seed=3)
    uri = s3.upload_dir(packed.out_dir, "artifacts", "cut/v1")
    weights = (packed.out_dir / "weights.safetensors").read_bytes()
    s3.client().put_object(
        Bucket="artifacts", Key="cut/v1/weights.safetensors", Body=weights[: len(weights) // 2]
    )
    cache = ArtifactCache(tmp_path / "cache", fetch=s3.fetch_config())
    with pytest.raises(ArtifactRejected) as info:
        cache.fetch_verified(uri, packed.manifest_sha256)
    # The listing already shows the shorter object; either check says "size", never a hash.
    assert info.value.category == "size", info.value


def test_a_large_artifact_is_fetched_and_loaded_in_one_pass(s3: S3Server, tmp_path: Path) -> None:
    packed = pack_ranker(tmp_path / "src", artifact_id="s3-large", params=LARGE, seed=5)
    size = (packed.out_dir / "weights.safetensors").stat().st_size
    assert size > 240 << 20
    uri = s3.upload_dir(packed.out_dir, "artifacts", "large/v1")
    target = packed.target(1).model_copy(update={"manifest_uri": uri})
    cache = ArtifactCache(tmp_path / "cache", fetch=s3.fetch_config())
    loader = loader_for(cache)
    candidate = loader.load(target)
    try:
        # Read from the store once, into the cache and the model at once.
        assert candidate.timings.fetched_bytes > size
        assert candidate.timings.loaded_bytes < 1 << 20
        assert candidate.model.param_bytes > 240 << 20
    finally:
        loader.discard(candidate)
