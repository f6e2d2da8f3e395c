"""The cache's byte budget: what eviction keeps, and by how much it may be exceeded.

Eviction makes room before each download for the published entries plus every download in
progress (each reserves its declared bytes), so concurrent fetches of different artifacts keep
the budget together. It never removes an entry in use (leased, or locked by its fetcher):
when those leave no room, every other entry is evicted and the cache exceeds the budget by at
most the bytes it could not remove, until they are released and the next fetch evicts."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from app.cache import ArtifactCache
from app.manifest import MANIFEST_NAME
from app.packing import PackResult
from tests.file_artifacts import HeldFileServer, make_file_artifact

SIZE = 100_000


def artifacts(tmp_path: Path, count: int) -> list[PackResult]:
    return [
        make_file_artifact(tmp_path, {"w.bin": os.urandom(SIZE)}, f"art-{i}") for i in range(count)
    ]


def present(cache: ArtifactCache) -> set[str]:
    return {digest for digest, _, _ in cache.entries()}


def test_a_download_in_progress_counts_against_the_budget_of_another(tmp_path: Path) -> None:
    a0, a1, a2 = artifacts(tmp_path, 3)
    budget = int(SIZE * 2.5)
    root = tmp_path / "cache"
    cache = ArtifactCache(root, byte_budget=budget)
    cache.fetch_verified(a0.manifest_uri, a0.manifest_sha256)
    server = HeldFileServer(tmp_path, held="w.bin", held_after=4096)
    failures: list[BaseException] = []

    def fetch_a1_over_http() -> None:
        try:
            ArtifactCache(root, byte_budget=budget).fetch_verified(
                server.uri(f"{a1.out_dir.name}/{MANIFEST_NAME}"), a1.manifest_sha256
            )
        except BaseException as exc:  # reported below
            failures.append(exc)

    with server.running():
        fetching = threading.Thread(target=fetch_a1_over_http)
        fetching.start()
        try:
            assert server.holding.wait(30), "a1's download never started"
            # a0 (published) + a1 (being fetched) + a2 do not fit: a0 must go now, not be
            # found over the budget once a1 lands.
            cache.fetch_verified(a2.manifest_uri, a2.manifest_sha256)
            assert present(cache) == {a2.manifest_sha256}
        finally:
            server.release.set()
            fetching.join(60)
    assert not failures, failures
    assert present(cache) == {a1.manifest_sha256, a2.manifest_sha256}
    assert cache.total_bytes() <= budget


def test_leased_entries_exceed_the_budget_by_at_most_their_own_bytes(tmp_path: Path) -> None:
    a0, a1, a2, a3, a4 = artifacts(tmp_path, 5)
    budget = int(SIZE * 2.5)
    cache = ArtifactCache(tmp_path / "cache", byte_budget=budget)
    leases = [cache.lease(a.manifest_sha256) for a in (a0, a1)]
    for a in (a0, a1, a2):
        cache.fetch_verified(a.manifest_uri, a.manifest_sha256)
    leased_bytes = 2 * SIZE
    # a0 and a1 are in use: a2 was fetched anyway, the cache now over its budget.
    assert cache.total_bytes() == 3 * SIZE > budget
    cache.fetch_verified(a3.manifest_uri, a3.manifest_sha256)
    # Every entry not in use was evicted; the excess is within the leased bytes.
    assert present(cache) == {a0.manifest_sha256, a1.manifest_sha256, a3.manifest_sha256}
    assert 0 < cache.total_bytes() - budget <= leased_bytes
    for lease in leases:
        lease.release()
    # Released, they are evictable: the next fetch brings the cache back within its budget.
    cache.fetch_verified(a4.manifest_uri, a4.manifest_sha256)
    assert present(cache) == {a3.manifest_sha256, a4.manifest_sha256}
    assert cache.total_bytes() <= budget
