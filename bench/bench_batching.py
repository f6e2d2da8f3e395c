"""Throughput of a ranker replica with `@serve.batch` against the same replica unbatched, at
equal p99, side by side in one run: on the default (demo) model and on a 2 GiB one.

Two Serve applications serve HTTP themselves (``mode: ranker_only``, one replica each, the
same model): ``batched`` merges concurrent calls into one forward (``batching``
``max_batch_size`` 32, 2 ms wait), ``unbatched`` runs one forward per request
(``max_batch_size`` 1). The same closed-loop load at rising concurrency goes to each, in
alternating order. "At equal p99": the unbatched replica's best throughput and the p99 it
had there, against the batched replica's best throughput at a p99 no worse than that.

    .venv/bin/python bench/bench_batching.py [--seconds 8] [--gib 2] [--quick]

Its last line holds the rows for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.demo_artifacts import make_demo_artifacts
from bench.bench_router import body, summarize, target, traffic
from rollout.local.cluster import LocalCluster
from tests.artifacts import pack_ranker

HIDDEN = 4096


def applications(packed: Any, work: Path, suffix: str) -> list[dict[str, Any]]:
    apps = []
    for name, max_batch in (("batched", 32), ("unbatched", 1)):
        apps.append(
            {
                "name": f"{name}{suffix}",
                "route_prefix": f"/{name}{suffix}",
                "import_path": "deployments.app:build_app",
                "args": {
                    "mode": "ranker_only",
                    "cache_dir": str(work / "cache"),
                    "batching": {"max_batch_size": max_batch, "batch_wait_timeout_s": 0.002},
                    "stable": {
                        "num_replicas": 1,
                        "num_cpus": 0.1,
                        "max_ongoing_requests": 64,
                        "target": target(packed, 1),
                    },
                },
            }
        )
    return apps


def measure(
    cluster: LocalCluster, packed: Any, work: Path, levels: list[int], seconds: float, label: str
) -> dict[str, Any]:
    # Apps of their own per model (the declarative PUT removes the previous pair): each
    # replica's first load is its startup, so the app is RUNNING once the model serves.
    suffix = f"-{label}"
    cluster.deploy(applications(packed, work, suffix), timeout_s=900)
    payloads = [body(16, seed) for seed in range(64)]
    results: dict[str, dict[int, dict[str, float]]] = {"batched": {}, "unbatched": {}}
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        for name in results:  # warm up both (and the client process)
            url = f"{cluster.http_url}/{name}{suffix}/v1/rank"
            pool.submit(traffic, "closed", url, payloads, 2.0, 4).result()
        for i, level in enumerate(levels):
            order = ("batched", "unbatched") if i % 2 == 0 else ("unbatched", "batched")
            for name in order:
                url = f"{cluster.http_url}/{name}{suffix}/v1/rank"
                latencies, _stamps, errors, elapsed = pool.submit(
                    traffic, "closed", url, payloads, seconds, level
                ).result()
                row = summarize(latencies, elapsed)
                row["errors"] = errors
                results[name][level] = row
                print(
                    f"{label} {name:>9} concurrency {level:>3}: {row['rps']:7.1f} req/s "
                    f"p50 {row['p50']:7.1f} ms p99 {row['p99']:7.1f} ms errors {errors}",
                    flush=True,
                )
    unbatched_best = max(results["unbatched"].values(), key=lambda r: r["rps"])
    budget = unbatched_best["p99"]
    within = [r for r in results["batched"].values() if r["p99"] <= budget]
    batched_best = max(within, key=lambda r: r["rps"]) if within else None
    return {
        "unbatched_rps": unbatched_best["rps"],
        "p99_ms": budget,
        "batched_rps": batched_best["rps"] if batched_best else 0.0,
        "batched_p99_ms": batched_best["p99"] if batched_best else math.nan,
        "errors": sum(r["errors"] for rs in results.values() for r in rs.values()),
        "levels": {name: {str(k): v for k, v in rs.items()} for name, rs in results.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per load level")
    parser.add_argument("--gib", type=float, default=2.0, help="the large model (0: skip it)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter levels")
    args = parser.parse_args()
    seconds = 4.0 if args.quick else args.seconds
    small_levels = [4, 16, 32] if args.quick else [1, 4, 8, 16, 32, 64]
    large_levels = [4, 16] if args.quick else [1, 4, 8, 16, 32]
    work = Path(tempfile.mkdtemp(prefix="bench-batching-", dir="/var/tmp"))
    cluster = LocalCluster.start(num_cpus=4, metrics_report_interval_ms=10_000)
    out: dict[str, dict[str, Any]] = {}
    try:
        demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
        out["default"] = measure(
            cluster, demo["ranker-v41"], work, small_levels, seconds, "default"
        )
        if args.gib > 0:
            layers = math.ceil(args.gib * (1 << 30) / (HIDDEN * HIDDEN * 4)) + 1
            large = pack_ranker(
                work / "store",
                artifact_id="ranker-batching-large",
                params={"hidden_dim": HIDDEN, "num_layers": layers, "context_dim": 16},
            )
            out[f"{args.gib:g} GiB"] = measure(
                cluster, large, work, large_levels, seconds, f"{args.gib:g}gib"
            )
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for model, r in out.items():
        ratio = r["batched_rps"] / r["unbatched_rps"] if r["unbatched_rps"] else None
        rows.append(
            {
                "measurement": f"batched vs unbatched replica throughput at equal p99 ({model})",
                "value": round(r["batched_rps"], 1),
                "baseline": round(r["unbatched_rps"], 1),
                "unit": f"req/s at p99 <= {r['p99_ms']:.0f} ms",
                "ratio": round(ratio, 2) if ratio is not None else None,
                "goal": ">= 2x where the forward dominates",
            }
        )
        print(
            f"{model}: unbatched {r['unbatched_rps']:.1f} req/s at p99 {r['p99_ms']:.1f} ms; "
            f"batched {r['batched_rps']:.1f} req/s at p99 {r['batched_p99_ms']:.1f} ms "
            f"({ratio or 0:.2f}x); errors {r['errors']}",
            flush=True,
        )
    print(json.dumps({"bench": "batching", "rows": rows, "detail": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
