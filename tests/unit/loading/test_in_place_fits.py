"""The controller's pre-check for an in-place promotion, from the replicas' own reports."""

from __future__ import annotations

from app.contracts import Capacity, InstanceReport, MemoryFigures, ReplicaPhase
from rollout.reports import in_place_fits

MiB = 1 << 20
V42 = "ranker-v42"


def report(
    artifact: str | None, backbone: str | None = None, **memory: int | None
) -> InstanceReport:
    return InstanceReport(
        replica_id="r",
        cohort="canary",
        pid=1,
        phase=ReplicaPhase.READY,
        actual_artifact=artifact,
        actual_backbone=backbone,
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


def test_a_head_needs_its_backbone_too_where_stable_runs_on_another() -> None:
    # The canary loaded the head alone (20 MiB peak) on its resident 300 MiB backbone.
    canary = [report(V42, "rb-1", load_peak_bytes=20 * MiB, backbone_bytes=300 * MiB)]
    same = [report("head-1", "rb-1", resident_bytes=310 * MiB, capacity_bytes=400 * MiB)]
    assert in_place_fits(canary, same, V42) is True
    other = [report("head-0", "rb-0", resident_bytes=310 * MiB, capacity_bytes=400 * MiB)]
    assert in_place_fits(canary, other, V42) is False
    whole = [report("ranker-v41", resident_bytes=10 * MiB, capacity_bytes=400 * MiB)]
    assert in_place_fits(canary, whole, V42) is True  # 10 + 20 + 300 fits in 400


# --------------------------------------------------------------------------- cgroup limits


def cgroup_tree(tmp_path, v2: bool, limit: str, usage: int, inactive: int = 0):
    from pathlib import Path

    root = Path(tmp_path)
    root.mkdir(parents=True)
    proc = root / "proc-self-cgroup"
    mount = root / "fs"
    if v2:
        proc.write_text("0::/kubepods/pod1/ctr\n")
        base = mount / "kubepods/pod1/ctr"
        base.mkdir(parents=True)
        (base / "memory.max").write_text(limit + "\n")
        (base / "memory.current").write_text(f"{usage}\n")
    else:
        proc.write_text("12:cpu,cpuacct:/docker/x\n9:memory:/docker/x\n")
        base = mount / "memory/docker/x"
        base.mkdir(parents=True)
        (base / "memory.limit_in_bytes").write_text(limit + "\n")
        (base / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (base / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    return proc, mount


def test_the_host_budget_counts_a_cgroup_limit(tmp_path) -> None:
    from app.loading.memory import cgroup_headroom

    gib = 1 << 30
    proc, mount = cgroup_tree(tmp_path / "v2", True, str(12 * gib), 9 * gib, inactive=gib)
    assert cgroup_headroom(proc, mount) == 4 * gib  # 12 - 9 + reclaimable page cache
    proc, mount = cgroup_tree(tmp_path / "v1", False, str(8 * gib), 7 * gib)
    assert cgroup_headroom(proc, mount) == gib
    proc, mount = cgroup_tree(tmp_path / "nolimit", True, "max", 9 * gib)
    assert cgroup_headroom(proc, mount) is None
    proc, mount = cgroup_tree(tmp_path / "v1-nolimit", False, str((1 << 63) - 4096), gib)
    assert cgroup_headroom(proc, mount) is None
    proc, mount = cgroup_tree(tmp_path / "over", True, str(gib), 2 * gib)
    assert cgroup_headroom(proc, mount) == 0
    # No limit on the container itself, one on its pod: the pod's counts.
    proc, mount = cgroup_tree(tmp_path / "pod", True, "max", 9 * gib)
    (mount / "kubepods/pod1/memory.max").write_text(f"{10 * gib}\n")
    (mount / "kubepods/pod1/memory.current").write_text(f"{9 * gib}\n")
    assert cgroup_headroom(proc, mount) == gib
    assert cgroup_headroom(tmp_path / "absent", mount) is None
