"""Cost of the router hop, and the latency cost of loading a candidate, side by side in one run.

1. Throughput and p50/p99 of ``POST /v1/rank`` through the router (router -> stable ranker)
   vs the ranker deployment serving HTTP itself (``mode: ranker_only``), same model, same
   request, same closed-loop load; phases alternate so drift hits both. Goal: >= 0.8x.
2. p99 through the router while the stable replica loads a larger candidate (~34 MB) in the
   background vs the steady state just before, both at the same fixed request rate (open loop,
   half the measured router throughput by default). Goal: <= 1.25x.

Loopback only, one local Ray cluster on free ports, bounded in count and time. Usage:
    .venv/bin/python bench/bench_router.py [--seconds 8] [--concurrency 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np
import ray

from app.demo_artifacts import make_demo_artifacts
from app.features import NUM_FEATURES
from tests.artifacts import large_artifact
from tests.e2e.serve_rest import ServeRest, ray_auth_token

MAX_REQUESTS_PER_PHASE = 20_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def body(n_candidates: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return json.dumps(
        {
            "user_id": f"bench-{seed}",
            "candidates": [
                {"id": f"c{i}", "features": [float(x) for x in rng.normal(size=NUM_FEATURES)]}
                for i in range(n_candidates)
            ],
            "top_n": 5,
        }
    ).encode()


async def closed_loop(url: str, payloads: list[bytes], seconds: float, concurrency: int):
    """Each worker sends its next request when the previous answer arrives."""
    latencies: list[float] = []
    stamps: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < deadline and len(latencies) < MAX_REQUESTS_PER_PHASE:
                started = time.perf_counter()
                async with session.post(
                    url,
                    data=payloads[i % len(payloads)],
                    headers={"content-type": "application/json"},
                ) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                done = time.perf_counter()
                latencies.append(done - started)
                stamps.append(done)
                i += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - started
    return latencies, stamps, errors, elapsed


async def open_loop(url: str, payloads: list[bytes], seconds: float, rate: float):
    """Requests sent at a fixed rate whatever the answers do (the production question:
    latency at normal load, not at saturation)."""
    latencies: list[float] = []
    stamps: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:

        async def one(i: int) -> None:
            nonlocal errors
            started = time.perf_counter()
            async with session.post(
                url, data=payloads[i % len(payloads)], headers={"content-type": "application/json"}
            ) as r:
                await r.read()
                errors += r.status != 200
            latencies.append(time.perf_counter() - started)
            stamps.append(time.perf_counter())

        began = time.perf_counter()
        tasks = []
        for i in range(min(int(seconds * rate), MAX_REQUESTS_PER_PHASE)):
            await asyncio.sleep(max(0.0, began + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - began
    return latencies, stamps, errors, elapsed


def summarize(latencies: list[float], elapsed: float) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"rps": len(ms) / elapsed, "p50": q[49], "p99": q[98], "n": len(ms)}


def wait_for(predicate, timeout: float, desc: str) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"{desc}: {last!r}")


def target(packed: Any, revision: int) -> dict[str, Any]:
    return {
        "revision": revision,
        "artifact_id": packed.artifact_id,
        "manifest_uri": packed.manifest_uri,
        "manifest_sha256": packed.manifest_sha256,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=16, help="per request")
    parser.add_argument(
        "--candidate-hidden",
        type=int,
        default=1024,
        help="hidden_dim of the candidate (8 layers): 1024 ~ 34 MB, 2048 ~ 134 MB",
    )
    parser.add_argument(
        "--load-rate",
        type=float,
        default=None,
        help="req/s of the candidate-load phases (default: half the measured router rate)",
    )
    parser.add_argument(
        "--calls-per-replica", type=int, default=None, help="router coalesce_calls_per_replica"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    big = large_artifact(work / "store", hidden_dim=args.candidate_hidden, num_layers=8)
    http_port, dash_port = free_port(), free_port()
    os.environ["RAY_GCS_SERVER_PORT"] = str(free_port())
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=True,
        dashboard_port=dash_port,
        _metrics_export_port=free_port(),
        log_to_driver=False,
    )
    rest = ServeRest(f"http://127.0.0.1:{dash_port}", ray_auth_token())
    try:
        router = {}
        if args.calls_per_replica:
            router["coalesce_calls_per_replica"] = args.calls_per_replica
        common = {"cache_dir": str(work / "cache"), "router_num_cpus": 0.1}
        cohort = {"num_replicas": 1, "num_cpus": 0.1, "target": target(demo["ranker-v41"], 1)}
        config = {
            "http_options": {"host": "127.0.0.1", "port": http_port},
            "proxy_location": "HeadOnly",
            "applications": [
                {
                    "name": "routed",
                    "route_prefix": "/routed",
                    "import_path": "app.main:build_app",
                    "args": {
                        **common,
                        "stable": cohort,
                        "canary": {"num_replicas": 1, "num_cpus": 0.1},
                        "router": router,
                    },
                },
                {
                    "name": "direct",
                    "route_prefix": "/direct",
                    "import_path": "app.main:build_app",
                    "args": {**common, "stable": cohort, "mode": "ranker_only"},
                },
            ],
        }
        wait_for(lambda: rest.details() is not None, 60, "dashboard up")
        rest.put(config)
        wait_for(
            lambda: all(rest.app_status(a) == "RUNNING" for a in ("routed", "direct")),
            180,
            "apps running",
        )
        base = f"http://127.0.0.1:{http_port}"
        payloads = [body(args.candidates, seed) for seed in range(64)]
        routes = {"router": f"{base}/routed/v1/rank", "direct": f"{base}/direct/v1/rank"}
        for url in routes.values():  # warm up both paths
            asyncio.run(closed_loop(url, payloads, 2.0, args.concurrency))

        results: dict[str, list[dict[str, float]]] = {"router": [], "direct": []}
        errors = 0
        for _ in range(args.rounds):
            for name, url in routes.items():
                lat, _, err, elapsed = asyncio.run(
                    closed_loop(url, payloads, args.seconds, args.concurrency)
                )
                errors += err
                results[name].append(summarize(lat, elapsed))

        # Candidate load under traffic: steady window, then a window that covers a load.
        rate = args.load_rate or 0.5 * statistics.fmean(r["rps"] for r in results["router"])
        steady_lat, _, err1, steady_s = asyncio.run(
            open_loop(routes["router"], payloads, args.seconds, rate)
        )

        async def during_load() -> tuple[list[float], list[float], int, float, float, float]:
            loop = asyncio.get_running_loop()
            traffic = asyncio.create_task(
                open_loop(routes["router"], payloads, 3 * args.seconds, rate)
            )
            await asyncio.sleep(args.seconds / 4)
            load_start = time.perf_counter()
            await loop.run_in_executor(
                None,
                lambda: rest.update_user_configs(
                    "routed", {"stable": lambda cfg: {**cfg, "target": target(big, 2)}}
                ),
            )

            def installed() -> bool:
                s = json.loads(_get(f"{base}/routed/v1/status"))
                reps = s["cohorts"][0]["replicas"]
                return bool(reps) and all(x["actual_revision"] == 2 for x in reps)

            await loop.run_in_executor(None, lambda: wait_for(installed, 120, "big installed"))
            load_end = time.perf_counter()
            lat, stamps, err, elapsed = await traffic
            return lat, stamps, err, elapsed, load_start, load_end

        lat, stamps, err2, _, load_start, load_end = asyncio.run(during_load())
        errors += err1 + err2
        in_window = [x for x, t in zip(lat, stamps, strict=True) if load_start <= t <= load_end]
        steady = summarize(steady_lat, steady_s)
        loading = summarize(in_window, max(load_end - load_start, 1e-9))

        def mean(name: str, key: str) -> float:
            return statistics.fmean(r[key] for r in results[name])

        print()
        print(f"{'path':<34}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
        for name in ("direct", "router"):
            label = "ranker as ingress (direct)" if name == "direct" else "router -> ranker"
            print(
                f"{label:<34}{mean(name, 'rps'):>9.0f}{mean(name, 'p50'):>9.1f}"
                f"{mean(name, 'p99'):>9.1f}"
            )
        print(
            f"{'router, steady':<34}{steady['rps']:>9.0f}{steady['p50']:>9.1f}{steady['p99']:>9.1f}"
        )
        print(
            f"{'router, during candidate load':<34}{loading['rps']:>9.0f}{loading['p50']:>9.1f}"
            f"{loading['p99']:>9.1f}   ({len(in_window)} requests, "
            f"{load_end - load_start:.1f} s window)"
        )
        ratio = mean("router", "rps") / mean("direct", "rps")
        p99_ratio = loading["p99"] / steady["p99"]
        print()
        print(
            f"router/direct throughput: {ratio:.2f}x (goal >= 0.8)   "
            f"p99 during load / steady at {rate:.0f} req/s: {p99_ratio:.2f}x (goal <= 1.25)   "
            f"non-200: {errors}   concurrency {args.concurrency}, "
            f"{args.candidates} candidates/request, {args.rounds} rounds x {args.seconds:.0f} s"
        )
    finally:
        rest.close()
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


if __name__ == "__main__":
    raise SystemExit(main())
