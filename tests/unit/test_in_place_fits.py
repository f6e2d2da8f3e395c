"""The controller's pre-check for an in-place promotion, from the replicas' own reports."""

from __future__ import annotations

from app.contracts import Capacity, InstanceReport, MemoryFigures, ReplicaPhase
from rollout.reports import in_place_fits

MiB = 1 << 20
V42 = "ranker-v42"


def report(artifact: str | None, **memory: int | None) -> InstanceReport:
    return InstanceReport(
        replica_id="r",
        cohort="canary",
        pid=1,
        phase=ReplicaPhase.READY,
        actual_artifact=artifact,
        capacity=Capacity(device="cpu", memory=MemoryFigures(**memory)),
        heartbeat=1.0,
        seq=0,
    )


def test_fits_when_every_stable_replica_has_room_for_the_candidates_load() -> None:
    canary = [report(V42, resident_bytes=30 * MiB, capacity_bytes=None, load_peak_bytes=300 * MiB)]
    stable = [
        report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=400 * MiB),
        report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=401 * MiB),
    ]
    assert in_place_fits(canary, stable, V42) is True


def test_one_stable_replica_short_of_room_is_enough_to_say_no() -> None:
    canary = [report(V42, load_peak_bytes=300 * MiB)]
    stable = [
        report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=1000 * MiB),
        report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=399 * MiB),
    ]
    assert in_place_fits(canary, stable, V42) is False


def test_the_largest_canary_figure_counts() -> None:
    canary = [report(V42, load_peak_bytes=100 * MiB), report(V42, load_peak_bytes=350 * MiB)]
    stable = [report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=400 * MiB)]
    assert in_place_fits(canary, stable, V42) is False


def test_unknown_figures_say_unknown() -> None:
    stable = [report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=400 * MiB)]
    # No canary replica serves the candidate yet (or it serves something else).
    assert in_place_fits([report("ranker-v41", load_peak_bytes=1)], stable, V42) is None
    assert in_place_fits([], stable, V42) is None
    # A canary without the figure (no memory estimate made at its load).
    assert in_place_fits([report(V42, load_peak_bytes=None)], stable, V42) is None
    # A stable replica that cannot tell its capacity; no stable replica reporting at all.
    canary = [report(V42, load_peak_bytes=10 * MiB)]
    unknown = [report("ranker-v41", resident_bytes=100 * MiB, capacity_bytes=None)]
    assert in_place_fits(canary, unknown, V42) is None
    assert in_place_fits(canary, [], V42) is None
    assert in_place_fits(canary, [report("ranker-v41")], V42) is None  # no figures at all
