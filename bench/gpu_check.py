"""The GPU path on a CUDA machine, in one command (at 8 GiB on one H200 host: 6 minutes, 2.3 of
them making and packing the two artifacts; `--swap-seconds 0 --batch-seconds 0`, the loads
alone from one artifact, 2 minutes at 6 GiB).

Packs a multi-GB ranker artifact, then measures on the device:
- the disk read and host-to-device copy bandwidth (the floors a load is held against);
- a cold load (empty cache, source pages dropped from the page cache) and a warm load (a
  hit), each with peak host RSS (VmHWM) and device memory (allocated, reserved) over the
  load and dry run; the dry run is timed apart, with ``torch.cuda.synchronize``;
- a generation swap under a concurrent request loop (the old generation is freed only after
  its CUDA event): requests answered and failed, p99 before and during the swap;
- a double-buffered load the budget refuses (``budget``), the serving model untouched;
- batching: the replica's throughput with ``@serve.batch``'s behaviour (concurrent calls
  merged into one forward, up to 32, 2 ms wait) against the same replica unbatched, at equal
  p99, on the default (demo) model and on the multi-GB one.

Each load runs in a process of its own, so its peak RSS is its own. Each step's figures go to
stderr as it ends (a run cut short still tells what it measured); the last line on stdout is
one JSON object of all of them.
Without CUDA it says so and exits 0, unless ``--device cpu`` asks to run the same steps on
the CPU (a smoke test of this script).

    .venv/bin/python bench/gpu_check.py [--gib 8] [--device cuda|cpu] [--swap-seconds 20]
        [--batch-seconds 3] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import shutil
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
from app.loading.candidate import CandidateLoad, load_verified

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
    "fetch_s": artifact.timings.get("fetch_s"),
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


def step(name: str, figures: dict) -> dict:
    """A step's figures on stderr as soon as it ends, so a run cut short still reports."""
    print(f"gpu_check: {name}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    return figures


def sha256_gib_s() -> float:
    """This host's single-thread SHA-256 rate: a load hashes every byte it reads with it."""
    data = os.urandom(256 << 20)
    started = time.perf_counter()
    for _ in range(4):
        hashlib.sha256(data).digest()
    return 4 * 256 / 1024 / (time.perf_counter() - started)


def rank_request(rng, candidates: int):
    import numpy as np

    from app.contracts import WireRequest
    from app.models.ranker_mlp.features import NUM_FEATURES

    return WireRequest(
        tuple(f"c{i}" for i in range(candidates)),
        rng.normal(size=(candidates, NUM_FEATURES)).astype(np.float32),
        {},
        10,
    )


def p99_ms(xs: list[float]) -> float | None:
    return round(1000 * sorted(xs)[int(0.99 * (len(xs) - 1))], 2) if xs else None


def swap_under_load(replica, config: dict, first, second, seconds: float) -> dict:
    """``replica`` serving ``first`` while a loop of requests runs; ``second`` loaded and
    installed meanwhile; then a double-buffered load the budget refuses."""
    import numpy as np

    replica.reconfigure({**config, "target": first.target(1).model_dump(mode="json")})
    request = rank_request(np.random.default_rng(0), 32)
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
    return {
        "swap_installed": installed,
        "swap_s": round(swap_s, 2),
        "requests_before": len(latencies["before"]),
        "requests_during": len(latencies["during"]),
        "failed_before": failures["before"],
        "failed_during": failures["during"],
        "p99_ms_before": p99_ms(latencies["before"]),
        "p99_ms_during": p99_ms(latencies["during"]),
        "median_ms_before": round(1000 * statistics.median(latencies["before"]), 2)
        if latencies["before"]
        else None,
        "double_buffer_refused": refused,
        "serving_after_refusal": still_serving,
    }


def serve_target(replica, config: dict, packed, revision: int) -> None:
    """``replica`` given ``packed`` as its target at ``revision``; back once it serves it (or
    after 10 minutes)."""
    replica.reconfigure({**config, "target": packed.target(revision).model_dump(mode="json")})
    deadline = time.monotonic() + 600
    while replica.report().actual_revision != revision and time.monotonic() < deadline:
        time.sleep(0.05)


class CallBatcher:
    """What ``@serve.batch`` does on a replica, in this process: one serving thread takes
    the first waiting call, then more for up to ``wait_s`` (at most ``max_batch`` calls in
    all), and runs them as one forward; ``max_batch`` 1 is the unbatched replica. (The
    deployment's ``_forward`` runs the same ``RankerReplica.rank`` over the merged calls.)"""

    def __init__(self, replica, max_batch: int, wait_s: float = 0.002) -> None:
        self._replica = replica
        self._max_batch = max_batch
        self._wait_s = wait_s
        self._calls: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def rank(self, requests: list) -> None:
        done = threading.Event()
        slot: list = [done, None]
        self._calls.put((requests, slot))
        done.wait()
        if isinstance(slot[1], BaseException):
            raise slot[1]

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                calls = [self._calls.get(timeout=0.1)]
            except queue.Empty:
                continue
            deadline = time.perf_counter() + self._wait_s
            while len(calls) < self._max_batch:
                left = deadline - time.perf_counter()
                try:
                    calls.append(
                        self._calls.get(timeout=left) if left > 0 else self._calls.get_nowait()
                    )
                except queue.Empty:
                    break
            flat = [request for requests, _ in calls for request in requests]
            try:
                self._replica.rank(flat)
                outcome = None
            except Exception as exc:  # handed to every caller of this forward
                outcome = exc
            for _, slot in calls:
                slot[1] = outcome
                slot[0].set()


def batching_at_equal_p99(replica, levels: list[int], seconds: float) -> dict:
    """Closed-loop clients (16 candidates a request) at each concurrency level against the
    replica batched (32 calls, 2 ms) and unbatched, alternating which goes first. "At equal
    p99": the unbatched replica's best throughput and its p99 there, against the batched
    replica's best throughput at a p99 no worse (as bench/bench_batching.py over Serve)."""
    import numpy as np

    rng = np.random.default_rng(1)
    requests = [rank_request(rng, 16) for _ in range(64)]
    results: dict[str, dict[int, dict]] = {"batched": {}, "unbatched": {}}

    def run_level(batcher: CallBatcher, clients: int, duration: float) -> dict:
        latencies: list[list[float]] = [[] for _ in range(clients)]
        errors = [0] * clients
        stop = threading.Event()

        def client(i: int) -> None:
            j = i
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    batcher.rank([requests[j % len(requests)]])
                    latencies[i].append(time.perf_counter() - started)
                except Exception:  # counted
                    errors[i] += 1
                j += clients

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(duration)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        flat = [x for xs in latencies for x in xs]
        return {
            "rps": round(len(flat) / elapsed, 1),
            "p50_ms": round(1000 * statistics.median(flat), 2) if flat else None,
            "p99_ms": p99_ms(flat),
            "errors": sum(errors),
        }

    batchers = {"batched": CallBatcher(replica, 32), "unbatched": CallBatcher(replica, 1)}
    try:
        for batcher in batchers.values():
            run_level(batcher, 4, min(1.0, seconds))  # warm-up
        for i, level in enumerate(levels):
            order = ("batched", "unbatched") if i % 2 == 0 else ("unbatched", "batched")
            for name in order:
                results[name][level] = run_level(batchers[name], level, seconds)
    finally:
        for batcher in batchers.values():
            batcher.close()
    unbatched_best = max(results["unbatched"].values(), key=lambda r: r["rps"])
    budget = unbatched_best["p99_ms"]
    within = [r for r in results["batched"].values() if r["p99_ms"] <= budget]
    batched_best = max(within, key=lambda r: r["rps"]) if within else None
    batched_rps = batched_best["rps"] if batched_best else 0.0
    return {
        "unbatched_rps": unbatched_best["rps"],
        "unbatched_p99_ms": budget,
        "batched_rps": batched_rps,
        "batched_p99_ms": batched_best["p99_ms"] if batched_best else None,
        "ratio": round(batched_rps / unbatched_best["rps"], 2) if unbatched_best["rps"] else None,
        "errors": sum(r["errors"] for rs in results.values() for r in rs.values()),
        "levels": {name: {str(k): v for k, v in rs.items()} for name, rs in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="weights size (default 8)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--swap-seconds", type=float, default=20.0, help="the swap's request loop (0: skip)"
    )
    parser.add_argument(
        "--batch-seconds", type=float, default=3.0, help="per batching load level (0: skip)"
    )
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
    from app.replica import RankerReplica

    hidden = HIDDEN if args.gib >= 1 else 1024
    layers = max(1, math.ceil(args.gib * (1 << 30) / (hidden * hidden * 4))) + 1
    figures: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=args.tmp or "/var/tmp") as tmp:
        root = Path(tmp)
        started = time.perf_counter()

        def pack(seed: int, name: str, params: dict | None):
            src = root / f"src-{name}"
            write_ranker_source(src, seed=seed, params=params)
            packed = pack_artifact(
                src, root / name, model=DEMO_MODEL, artifact_id=name, feature_schema=FEATURE_SCHEMA
            )
            shutil.rmtree(src)  # the disk holds the packed copies only
            return packed

        large = {"hidden_dim": hidden, "num_layers": layers, "context_dim": 16}
        swapping = args.swap_seconds > 0
        packed = [pack(1, "gpu-a", large)] + ([pack(2, "gpu-b", large)] if swapping else [])
        # The demo model's architecture, for batching.
        small = pack(3, "gpu-default", None) if args.batch_seconds > 0 else None
        weights_file = packed[0].out_dir / "weights.safetensors"
        figures.update(
            step(
                "pack",
                {
                    "pack_s": round(time.perf_counter() - started, 1),
                    "weights_gib": round(weights_file.stat().st_size / (1 << 30), 3),
                },
            )
        )
        h2d = h2d_gib_s(device)
        figures.update(
            step(
                "bandwidth",
                {
                    "disk_read_gib_s": round(disk_read_gib_s(weights_file), 3),
                    "h2d_gib_s": round(h2d, 2) if h2d is not None else None,
                    "sha256_gib_s": round(sha256_gib_s(), 3),
                },
            )
        )

        cache_root = root / "cache"
        drop_from_page_cache(sorted(packed[0].out_dir.iterdir()))
        loads: dict[str, object] = {}
        for name in ("cold", "warm"):
            run = probe(cache_root, packed[0], device)
            weights = run["weights"]
            loads[f"{name}_load_s"] = round(run["load_s"], 2)
            if run["fetch_s"] is not None:  # a cold load's fetch, which fed the weights
                loads[f"{name}_fetch_s"] = round(run["fetch_s"], 2)
            loads[f"{name}_dry_run_s"] = round(run["dry_run_s"], 3)
            loads[f"{name}_host_peak_ratio"] = round(run["host_peak_added"] / weights, 3)
            for key in ("device_allocated_peak", "device_reserved_peak"):
                value = run[key]
                loads[f"{name}_{key}_ratio"] = (
                    round(value / weights, 3) if value is not None else None
                )
        shutil.rmtree(cache_root)
        disk_s = figures["weights_gib"] / figures["disk_read_gib_s"]  # type: ignore[operator]
        loads["cold_load_vs_disk_read"] = round(loads["cold_load_s"] / disk_s, 2)  # type: ignore[operator]
        if h2d is not None:
            h2d_s = figures["weights_gib"] / h2d  # type: ignore[operator]
            loads["warm_load_vs_h2d"] = round(loads["warm_load_s"] / h2d_s, 2)  # type: ignore[operator]
        figures.update(step("loads", loads))

        if not swapping and small is None:
            print(json.dumps(figures))
            return
        replica = RankerReplica("gpu-check", device=device, loader_nice=0)
        config = {"cohort": "stable", "cache_dir": str(root / "swap-cache")}
        try:
            if swapping:
                figures.update(
                    step(
                        "swap",
                        swap_under_load(replica, config, packed[0], packed[1], args.swap_seconds),
                    )
                )
            else:
                serve_target(replica, config, packed[0], 1)
            if small is not None:
                levels = [4, 16, 32, 64]
                large_batching = batching_at_equal_p99(replica, levels, args.batch_seconds)
                serve_target(replica, config, small, 4)
                default_batching = batching_at_equal_p99(replica, levels, args.batch_seconds)
                figures.update(
                    step(
                        "batching",
                        {"batching_large": large_batching, "batching_default": default_batching},
                    )
                )
        finally:
            replica.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
