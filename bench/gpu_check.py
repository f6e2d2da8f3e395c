"""The GPU path on a CUDA machine, in one command (about 5 minutes on one GPU at 8 GiB).

Packs a multi-GB ranker artifact, then measures on the device:
- the disk read and host-to-device copy bandwidth (the floors a load is held against);
- a cold load (empty cache, source pages dropped from the page cache) and a warm load (a
  hit), each with peak host RSS (VmHWM) and device memory (allocated, reserved) over the
  load and dry run; the dry run is timed apart, with ``torch.cuda.synchronize``;
- a generation swap under a concurrent request loop (the old generation is freed only after
  its CUDA event): requests answered and failed, p99 before and during the swap;
- a double-buffered load the budget refuses (``budget``), the serving model untouched.

Each load runs in a process of its own, so its peak RSS is its own. Prints one JSON line.
Without CUDA it says so and exits 0, unless ``--device cpu`` asks to run the same steps on
the CPU (a smoke test of this script).

    .venv/bin/python bench/gpu_check.py [--gib 8] [--device cuda|cpu] [--swap-seconds 20]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HIDDEN = 8192  # each hidden layer: one 256 MiB fp32 tensor

PROBE = r"""
import json, os, shutil, sys, time
from pathlib import Path
import torch
from app.cache import ArtifactCache
from app.loader import CandidateLoad, load_verified

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def hwm():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM:"))

cache_root, uri, digest, device = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
device = torch.device(device)
cuda = device.type == "cuda"
if cuda:
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats(device)
before = rss()
started = time.perf_counter()
prepared = CandidateLoad(device=device)
artifact = ArtifactCache(cache_root).fetch_verified(uri, digest, sink=prepared)
model = load_verified(artifact, prepared=prepared)
if cuda:
    torch.cuda.synchronize(device)
total = time.perf_counter() - started
print(json.dumps({
    "cached": artifact.cached,
    "load_s": total - model.timings["dry_run"],
    "dry_run_s": model.timings["dry_run"],
    "host_peak_added": hwm() - before,
    "weights": model.param_bytes,
    "device_allocated_peak": torch.cuda.max_memory_allocated(device) if cuda else None,
    "device_reserved_peak": torch.cuda.max_memory_reserved(device) if cuda else None,
}))
"""


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict clean pages of ``paths`` (no root needed), so the next read comes from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_gib_s(path: Path) -> float:
    drop_from_page_cache([path])
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    started = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            total += n
    return total / (1 << 30) / (time.perf_counter() - started)


def h2d_gib_s(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(8):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 8 * 256 / 1024 / (time.perf_counter() - started)


def probe(cache_root: Path, packed, device: torch.device) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(cache_root), packed.manifest_uri,
         packed.manifest_sha256, str(device)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"load failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def swap_under_load(root: Path, first, second, device: torch.device, seconds: float) -> dict:
    """A replica serving ``first`` while a loop of requests runs; ``second`` loaded and
    installed meanwhile; then a double-buffered load the budget refuses."""
    import numpy as np

    from app.contracts import WireRequest
    from app.models.ranker_mlp.features import NUM_FEATURES
    from app.replica import RankerReplica

    replica = RankerReplica("gpu-check", device=device, loader_nice=0)
    config = {"cohort": "stable", "cache_dir": str(root / "swap-cache")}
    replica.reconfigure({**config, "target": first.target(1).model_dump(mode="json")})
    rng = np.random.default_rng(0)
    request = WireRequest(
        tuple(f"c{i}" for i in range(32)),
        rng.normal(size=(32, NUM_FEATURES)).astype(np.float32),
        {},
        10,
    )
    latencies: dict[str, list[float]] = {"before": [], "during": []}
    failures = {"before": 0, "during": 0}
    phase = ["before"]
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                replica.rank([request])
                latencies[phase[0]].append(time.perf_counter() - started)
            except Exception:  # counted: the check is that there are none
                failures[phase[0]] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(min(5.0, seconds / 4))
    phase[0] = "during"
    swap_started = time.perf_counter()
    replica.reconfigure({**config, "target": second.target(2).model_dump(mode="json")})
    deadline = time.monotonic() + max(seconds, 600)
    while replica.report().actual_revision != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    swap_s = time.perf_counter() - swap_started
    stop.set()
    thread.join()
    installed = replica.report().actual_revision == 2
    resident = replica.report().capacity.memory.resident_bytes
    # A budget that holds the resident model and half of another: double-buffering refused.
    tight = {"capacity_bytes": int(resident * 1.5), "margin_bytes": 0, "margin_fraction": 0}
    replica.reconfigure(
        {
            **config,
            "memory": tight,
            "retry": {"max_attempts": 1},  # a budget refusal is final here, not retried
            "target": first.target(3).model_dump(mode="json"),
        }
    )
    deadline = time.monotonic() + 600
    while replica.report().phase not in ("failed", "ready") and time.monotonic() < deadline:
        time.sleep(0.05)
    report = replica.report()
    refused = report.last_error.category if report.last_error is not None else None
    still_serving = replica.rank([request]).model.artifact_id
    replica.close()

    def p99(xs: list[float]) -> float | None:
        return round(1000 * sorted(xs)[int(0.99 * (len(xs) - 1))], 2) if xs else None

    return {
        "swap_installed": installed,
        "swap_s": round(swap_s, 2),
        "requests_before": len(latencies["before"]),
        "requests_during": len(latencies["during"]),
        "failed_before": failures["before"],
        "failed_during": failures["during"],
        "p99_ms_before": p99(latencies["before"]),
        "p99_ms_during": p99(latencies["during"]),
        "median_ms_before": round(1000 * statistics.median(latencies["before"]), 2)
        if latencies["before"]
        else None,
        "double_buffer_refused": refused,
        "serving_after_refusal": still_serving,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="weights size (default 8)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--swap-seconds", type=float, default=20.0)
    parser.add_argument("--tmp", default=None, help="where to write the artifacts (disk)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing done")
        print(json.dumps({"cuda": False}))
        return
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")

    from app.demo_artifacts import DEMO_MODEL, write_ranker_source
    from app.models.ranker_mlp.features import FEATURE_SCHEMA
    from app.packing import pack_artifact

    hidden = HIDDEN if args.gib >= 1 else 1024
    layers = max(1, math.ceil(args.gib * (1 << 30) / (hidden * hidden * 4))) + 1
    figures: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=args.tmp or "/var/tmp") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        packed = []
        for seed, name in ((1, "gpu-a"), (2, "gpu-b")):
            src = root / f"src-{name}"
            params = {"hidden_dim": hidden, "num_layers": layers, "context_dim": 16}
            write_ranker_source(src, seed=seed, params=params)
            packed.append(
                pack_artifact(src, root / name, model=DEMO_MODEL, artifact_id=name,
                              feature_schema=FEATURE_SCHEMA)
            )  # fmt: skip
        figures["pack_s"] = round(time.perf_counter() - started, 1)
        weights_file = packed[0].out_dir / "weights.safetensors"
        figures["weights_gib"] = round(weights_file.stat().st_size / (1 << 30), 3)
        figures["disk_read_gib_s"] = round(disk_read_gib_s(weights_file), 3)
        h2d = h2d_gib_s(device)
        figures["h2d_gib_s"] = round(h2d, 2) if h2d is not None else None

        cache_root = root / "cache"
        drop_from_page_cache(sorted(packed[0].out_dir.iterdir()))
        cold = probe(cache_root, packed[0], device)
        warm = probe(cache_root, packed[0], device)
        weights = cold["weights"]
        for name, run in (("cold", cold), ("warm", warm)):
            figures[f"{name}_load_s"] = round(run["load_s"], 2)
            figures[f"{name}_dry_run_s"] = round(run["dry_run_s"], 3)
            figures[f"{name}_host_peak_ratio"] = round(run["host_peak_added"] / weights, 3)
            for key in ("device_allocated_peak", "device_reserved_peak"):
                value = run[key]
                figures[f"{name}_{key}_ratio"] = (
                    round(value / weights, 3) if value is not None else None
                )
        disk_s = figures["weights_gib"] / figures["disk_read_gib_s"]  # type: ignore[operator]
        figures["cold_load_vs_disk_read"] = round(cold["load_s"] / disk_s, 2)
        figures.update(swap_under_load(root, packed[0], packed[1], device, args.swap_seconds))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
