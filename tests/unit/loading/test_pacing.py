"""Pacing of background loads (app.loading.control): the arithmetic with a stand-in CPU clock, and
that the real loading code (cache download, verified reads, dry run) stops at pacing points."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.cache import ArtifactCache
from app.loading.candidate import load_verified
from app.loading.control import LoadControl, LoadPacer
from tests.artifacts import pack_ranker


class CpuClock:
    """A thread's CPU time, advanced by hand (per thread, like time.thread_time)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return getattr(self._local, "t", 0.0)

    def run(self, seconds: float) -> None:
        self._local.t = self() + seconds


def paced(share: float, burst_s: float = 0.005) -> tuple[LoadPacer, CpuClock, list[float]]:
    clock, pauses = CpuClock(), []
    return LoadPacer(share, burst_s=burst_s, cpu_clock=clock, sleep=pauses.append), clock, pauses


def test_a_full_burst_pauses_for_the_share_it_leaves_to_others() -> None:
    pacer, cpu, pauses = paced(0.25)
    pacer.checkpoint()  # starts the account
    cpu.run(0.006)
    pacer.checkpoint()
    assert pauses == [pytest.approx(0.018)]  # 6 ms of CPU in 24 ms of wall: a 25% share
    assert pacer.paused_s == pytest.approx(0.018)


def test_short_units_add_up_to_a_burst_before_any_pause() -> None:
    pacer, cpu, pauses = paced(0.5)
    pacer.checkpoint()
    for _ in range(4):
        cpu.run(0.001)
        pacer.checkpoint()
    assert pauses == []  # 4 ms < the 5 ms burst
    cpu.run(0.002)
    pacer.checkpoint()
    assert pauses == [pytest.approx(0.006)]
    cpu.run(0.001)  # the account starts again after a pause
    pacer.checkpoint()
    assert len(pauses) == 1


def test_each_thread_is_paced_by_its_own_cpu_time() -> None:
    pacer, cpu, pauses = paced(0.5)
    pacer.checkpoint()
    cpu.run(0.004)

    def other() -> None:  # its own account: the main thread's 4 ms are not its own
        pacer.checkpoint()
        cpu.run(0.004)
        pacer.checkpoint()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert pauses == []
    cpu.run(0.002)
    pacer.checkpoint()
    assert pauses == [pytest.approx(0.006)]


def test_a_full_share_never_pauses() -> None:
    pacer, cpu, pauses = paced(1.0)
    pacer.checkpoint()
    cpu.run(10.0)
    pacer.checkpoint()
    assert pauses == [] and pacer.paused_s == 0


@pytest.mark.parametrize(("share", "burst"), [(0.0, 0.005), (1.5, 0.005), (0.5, -1.0)])
def test_a_share_or_burst_out_of_range_is_refused(share: float, burst: float) -> None:
    with pytest.raises(ValueError):
        LoadPacer(share, burst_s=burst)


class CountingPacer(LoadPacer):
    """The real pacer with no pauses: counts the pacing points each thread reached."""

    def __init__(self) -> None:
        super().__init__(0.5, burst_s=0.0, sleep=lambda _s: None)
        self.points: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def checkpoint(self) -> None:
        with self._count_lock:
            name = threading.current_thread().name
            self.points[name] = self.points.get(name, 0) + 1
        super().checkpoint()


def test_download_verified_reads_and_dry_run_all_reach_pacing_points(tmp_path: Path) -> None:
    # A weights file of several download chunks (8 MB) and hash pieces (4 MB).
    params = {"hidden_dim": 1024, "num_layers": 6, "context_dim": 16}
    packed = pack_ranker(tmp_path / "store", artifact_id="ranker-paced", seed=1, params=params)
    cache = ArtifactCache(tmp_path / "cache")

    downloading = CountingPacer()
    artifact = cache.fetch_verified(
        packed.manifest_uri, packed.manifest_sha256, control=LoadControl(downloading)
    )
    weights = max(f.bytes for f in artifact.manifest.files)
    assert weights > 16 << 20
    # The parallel file downloads run in their own threads, each reaching its own points.
    assert sum(downloading.points.values()) >= weights // (8 << 20)

    me = threading.current_thread().name
    reading = CountingPacer()
    weights_file = max(artifact.manifest.files, key=lambda f: f.bytes).path
    artifact.read_verified(weights_file, LoadControl(reading))
    assert reading.points[me] >= weights // (4 << 20)

    streaming = CountingPacer()
    model = load_verified(artifact, control=LoadControl(streaming))
    try:
        # The streamed weights: a point per 8 MB chunk, then the dry run's forwards.
        assert streaming.points[me] >= weights // (8 << 20)
        forwards = CountingPacer()
        model.dry_run(LoadControl(forwards))
        assert forwards.points[me] >= len(
            model.family.network.representative_batches(model.preprocessing)
        )
    finally:
        model.close()

    rechecking = CountingPacer()
    cache.fetch_verified(
        packed.manifest_uri,
        packed.manifest_sha256,
        recheck="digests",
        control=LoadControl(rechecking),
    )
    assert sum(rechecking.points.values()) >= weights // (8 << 20)
