"""Moved to app.loading.memory; this path is kept for one release."""

from app.loading.memory import (
    MemoryBudget,
    MemoryEstimate,
    MiB,
    cgroup_headroom,
    check_budget,
    device_capacity,
    estimate_peak,
)

__all__ = [
    "MemoryBudget",
    "MemoryEstimate",
    "MiB",
    "cgroup_headroom",
    "check_budget",
    "device_capacity",
    "estimate_peak",
]
