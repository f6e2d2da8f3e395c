"""Memory budget for loading a candidate next to the serving model.

    peak = resident + candidate weights + load temporaries + warm-up workspace + margin

is checked against the device's capacity *before* anything is allocated. When the candidate
does not fit next to the resident model (no double-buffering), the estimate says so and says
whether it would fit alone: the rollout then takes the cross-pool path (the other cohort
carries traffic while this one swaps with no model resident) instead of OOMing a serving
replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

from app.contracts import MemoryConfig
from app.errors import ArtifactRejected

MiB: Final = 1 << 20


@dataclass(frozen=True)
class MemoryBudget:
    """``capacity_bytes`` None: ask the device (CUDA: free + what this process's allocator
    holds; CPU: MemAvailable, or the cgroup's headroom when that is less, + resident).
    ``margin_bytes`` covers the runtime and allocator fragmentation; ``margin_fraction``
    scales with the candidate's weights."""

    capacity_bytes: int | None = None
    margin_bytes: int = 256 * MiB
    margin_fraction: float = 0.05

    @classmethod
    def of(cls, config: MemoryConfig) -> MemoryBudget:
        return cls(
            capacity_bytes=config.capacity_bytes,
            margin_bytes=config.margin_bytes,
            margin_fraction=config.margin_fraction,
        )

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if self.margin_bytes < 0 or not 0.0 <= self.margin_fraction < 1.0:
            raise ValueError("margin_bytes must be >= 0 and margin_fraction in [0, 1)")


@dataclass(frozen=True)
class MemoryEstimate:
    device: str
    resident_bytes: int
    candidate_weight_bytes: int
    load_temporary_bytes: int
    warmup_workspace_bytes: int
    margin_bytes: int
    capacity_bytes: int | None  # None: unknown, nothing checked

    @property
    def single_buffer_peak(self) -> int:
        """Peak with nothing else resident (the cross-pool path)."""
        return (
            self.candidate_weight_bytes
            + self.load_temporary_bytes
            + self.warmup_workspace_bytes
            + self.margin_bytes
        )

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.single_buffer_peak

    @property
    def fits(self) -> bool:
        """The candidate fits next to the resident model (double-buffering)."""
        return self.capacity_bytes is None or self.peak_bytes <= self.capacity_bytes

    @property
    def fits_alone(self) -> bool:
        return self.capacity_bytes is None or self.single_buffer_peak <= self.capacity_bytes

    def describe(self) -> str:
        gib = _human
        cap = "unknown" if self.capacity_bytes is None else gib(self.capacity_bytes)
        return (
            f"peak {gib(self.peak_bytes)} = resident {gib(self.resident_bytes)} + weights "
            f"{gib(self.candidate_weight_bytes)} + load temporaries "
            f"{gib(self.load_temporary_bytes)} + warm-up {gib(self.warmup_workspace_bytes)} "
            f"+ margin {gib(self.margin_bytes)}; capacity {cap} on {self.device}"
        )


def _human(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MiB:.1f} MiB"


def device_capacity(device: torch.device, resident_bytes: int = 0) -> int | None:
    """Bytes this process could hold on ``device`` including what it already holds."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Blocks cached by our allocator (including the resident model) are ours to reuse.
        return int(free) + int(torch.cuda.memory_reserved(device))
    if device.type == "cpu":
        available = _mem_available()
        return None if available is None else available + resident_bytes
    return None


def _mem_available() -> int | None:
    """What this process could still allocate on the host: the kernel's MemAvailable, or
    less when the process's cgroup (a container's limit, a Kubernetes pod's) leaves less."""
    available = _meminfo_available(Path("/proc/meminfo"))
    headroom = cgroup_headroom(Path("/proc/self/cgroup"), Path("/sys/fs/cgroup"))
    if available is None:
        return headroom
    return available if headroom is None else min(available, headroom)


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom(proc_cgroup: Path, mount: Path) -> int | None:
    """Limit minus usage of the memory cgroup the process is in (cgroup v2's ``memory.max``
    and ``memory.current``, or v1's ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``),
    counting the page cache the kernel can reclaim (``inactive_file``) as free. None when
    no limit is set or none can be read: MemAvailable decides alone."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            root, names = mount, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, names = mount / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        # A container's own mount may have its cgroup at the root (a cgroup namespace, or a
        # path that only makes sense on the host): the named path if it is there, else the
        # root. A limit may be set on any ancestor (a pod's, a slice's): the least headroom
        # of the cgroup and those above it counts.
        start = root / rel if (root / rel / names[1]).exists() else root
        levels = [start, *(p for p in start.parents if p.is_relative_to(root))]
        found = [h for h in (_headroom(level, names) for level in levels) if h is not None]
        if found:
            return min(found)
    return None


def _headroom(base: Path, names: tuple[str, str]) -> int | None:
    limit, usage = _read_int(base / names[0]), _read_int(base / names[1])
    # v1 reports "no limit" as a number near 2**63.
    if limit is None or usage is None or limit >= 1 << 60:
        return None
    reclaimable = _stat_value(base / "memory.stat", ("total_inactive_file", "inactive_file"))
    return max(0, limit - usage + (reclaimable or 0))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` (in that order of preference) that ``memory.stat`` holds."""
    try:
        values = dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
        for key in keys:
            if key in values:
                return int(values[key])
    except (OSError, ValueError):
        return None
    return None


def estimate_peak(
    budget: MemoryBudget,
    *,
    device: torch.device,
    resident_bytes: int,
    candidate_weight_bytes: int,
    load_temporary_bytes: int,
    warmup_workspace_bytes: int,
) -> MemoryEstimate:
    capacity = budget.capacity_bytes
    if capacity is None:
        capacity = device_capacity(device, resident_bytes)
    margin = budget.margin_bytes + int(budget.margin_fraction * candidate_weight_bytes)
    return MemoryEstimate(
        device=str(device),
        resident_bytes=resident_bytes,
        candidate_weight_bytes=candidate_weight_bytes,
        load_temporary_bytes=load_temporary_bytes,
        warmup_workspace_bytes=warmup_workspace_bytes,
        margin_bytes=margin,
        capacity_bytes=capacity,
    )


def check_budget(estimate: MemoryEstimate, *, artifact_id: str | None = None) -> None:
    """ArtifactRejected("budget") unless the candidate fits next to the resident model."""
    if estimate.fits:
        return
    alone = (
        "it would fit with nothing resident (use the cross-pool path)"
        if estimate.fits_alone
        else "it does not fit even with nothing resident"
    )
    raise ArtifactRejected(
        "budget",
        f"double-buffering does not fit: {estimate.describe()}; {alone}",
        artifact_id=artifact_id,
    )
