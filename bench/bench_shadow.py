"""Client latency of mirrored requests against requests that are not mirrored, side by side in
one run: does the shadow phase cost the users whose requests are copied anything?

One application with the router: stable serves ranker-v41, the canary ranker-v43 (a different
model, so every copy is a real forward and a real comparison). Open-loop traffic at a fixed
rate from 400 users keyed by user id; the router mirrors half of the users (by the hash the
router uses, which this script computes the same way). Phases alternate between mirroring on
and off, the same traffic in each:

- ``mirrored vs not``: in the phases with mirroring on, the p99 of the mirrored users' requests
  against the p99 of the others' (the same moment, the same router: only the copy differs);
- ``mirrored on vs off``: the mirrored users' p99 with mirroring on against the same users'
  requests with it off (the same payloads: only the copy differs).
Goal: both within the noise (a 90% cluster-bootstrap interval over phases that holds 1.0x).

    .venv/bin/python bench/bench_shadow.py [--seconds 10] [--rounds 3] [--rate 40] [--quick]

Its last line holds the rows for bench/run_all.py and the named keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import httpx
import numpy as np

from app.demo_artifacts import make_demo_artifacts, make_shadow_artifacts
from app.ingress.routing import request_key
from app.ingress.shadow import is_mirrored
from app.polling import wait_until
from app.request_bodies import rank_bodies
from bench.bench_router import p99_ratio_interval
from rollout.local.cluster import LocalCluster

USERS = 400
FRACTION_BP = 5000
SALT = "ranker"  # RouterConfig's default salt


def payloads() -> tuple[list[bytes], list[bool]]:
    """One body per user (the live load's shape) and whether the router mirrors that user."""
    bodies, mirrored = [], []
    for i, body in enumerate(rank_bodies(USERS, seed=11)):
        user = f"shadow-bench-{i}"
        body = {**body, "user_id": user}
        bodies.append(json.dumps(body).encode())
        mirrored.append(
            is_mirrored(
                fraction_bp=FRACTION_BP,
                salt=SALT,
                key=request_key(user, None),
                random_bp=lambda: 0,
            )
        )
    return bodies, mirrored


async def open_loop(url: str, bodies: list[bytes], seconds: float, rate: float):
    """(user index, latency s, status) of each request, sent at a fixed rate."""
    out: list[tuple[int, float, int]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:

        async def one(i: int) -> None:
            started = time.perf_counter()
            try:
                async with session.post(
                    url, data=bodies[i], headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                    status = r.status
            except aiohttp.ClientError:
                status = 0
            out.append((i, time.perf_counter() - started, status))

        began = time.perf_counter()
        tasks = []
        rng = np.random.default_rng(int(began * 1000) % (1 << 32))
        for n in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, began + n / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(int(rng.integers(0, len(bodies))))))
        await asyncio.gather(*tasks)
    return out


def traffic(url: str, bodies: list[bytes], seconds: float, rate: float):
    return asyncio.run(open_loop(url, bodies, seconds, rate))


def p99(values: list[float]) -> float:
    return float(np.percentile(np.asarray(values) * 1000, 99)) if values else float("nan")


def p50(values: list[float]) -> float:
    return float(np.percentile(np.asarray(values) * 1000, 50)) if values else float("nan")


def shadow_counts(metrics_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ray_ranker_router_shadow_requests_total":
                outcome = sample.labels.get("outcome", "")
                counts[outcome] = counts.get(outcome, 0.0) + sample.value
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3, help="on/off phase pairs")
    parser.add_argument("--rate", type=float, default=40.0, help="requests/s")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 6 s phases")
    args = parser.parse_args()
    seconds, rounds = (6.0, 2) if args.quick else (args.seconds, args.rounds)
    work = Path(tempfile.mkdtemp(prefix="bench-shadow-", dir="/var/tmp"))
    cluster = LocalCluster.start(num_cpus=4)
    bodies, mirrored = payloads()
    phases: dict[str, list[list[tuple[int, float, int]]]] = {"on": [], "off": []}
    try:
        demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
        shadow = make_shadow_artifacts(work / "store", demo["ranker-v41"])
        cluster.deploy(
            [
                {
                    "name": "ranker",
                    "route_prefix": "/",
                    "import_path": "deployments.app:build_app",
                    "args": {
                        "cache_dir": str(work / "cache"),
                        "router_num_cpus": 0.1,
                        "stable": {
                            "num_replicas": 1,
                            "num_cpus": 0.1,
                            "target": demo["ranker-v41"].target(1).model_dump(mode="json"),
                        },
                        "canary": {
                            "num_replicas": 1,
                            "num_cpus": 0.1,
                            "target": shadow["ranker-v43"].target(1).model_dump(mode="json"),
                        },
                        "router": {"probe_interval_s": 1.0, "reveal_cohort": True},
                    },
                }
            ],
            timeout_s=300,
        )
        rest = cluster.serve_control()
        url = f"{cluster.http_url}/v1/rank"

        def set_shadow(fraction_bp: int) -> None:
            shadow_config = {"fraction_bp": fraction_bp, "max_in_flight": 16}
            rest.update_user_configs(
                "ranker", {"router": lambda cfg: {**cfg, "shadow": shadow_config}}
            )
            wait_until(
                lambda: (
                    httpx.get(f"{cluster.http_url}/v1/status", timeout=5).json()["shadow_bp"]
                    == fraction_bp
                ),
                60,
                f"router mirroring {fraction_bp} bp",
                retry_on=(Exception,),
            )

        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            pool.submit(traffic, url, bodies, 2.0, args.rate).result()  # warm-up
            for r in range(rounds):
                for state in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    set_shadow(FRACTION_BP if state == "on" else 0)
                    time.sleep(1.0)  # copies of the previous phase drain
                    got = pool.submit(traffic, url, bodies, seconds, args.rate).result()
                    phases[state].append(got)
                    print(f"round {r + 1} mirroring {state}: {len(got)} requests", flush=True)
        counts = shadow_counts(cluster.metrics_url)
        rest.close()
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    def lat(state: str, want: bool) -> list[list[float]]:
        return [[x for i, x, _ in phase if mirrored[i] == want] for phase in phases[state]]

    errors = sum(1 for s in phases.values() for phase in s for _, _, st in phase if st != 200)
    on_m, on_n, off_m = lat("on", True), lat("on", False), lat("off", True)

    def pooled(groups: list[list[float]]) -> list[float]:
        return [x for g in groups for x in g]

    vs_not = p99(pooled(on_m)) / p99(pooled(on_n))
    vs_off = p99(pooled(on_m)) / p99(pooled(off_m))
    vs_not_ci = p99_ratio_interval(on_m, on_n, seed=1)
    vs_off_ci = p99_ratio_interval(on_m, off_m, seed=2)
    summary = {
        "requests": sum(len(p) for s in phases.values() for p in s),
        "errors": errors,
        "mirrored_users": sum(mirrored),
        "p50_ms": {
            "mirrored_on": p50(pooled(on_m)),
            "not_mirrored_on": p50(pooled(on_n)),
            "mirrored_off": p50(pooled(off_m)),
        },
        "p99_ms": {
            "mirrored_on": p99(pooled(on_m)),
            "not_mirrored_on": p99(pooled(on_n)),
            "mirrored_off": p99(pooled(off_m)),
        },
        "copies": counts,
    }
    print(json.dumps(summary), flush=True)
    rows = [
        {
            "measurement": "shadow: p99 of mirrored vs not-mirrored requests (mirroring on)",
            "value": round(p99(pooled(on_m)), 1),
            "baseline": round(p99(pooled(on_n)), 1),
            "unit": "ms",
            "ratio": round(vs_not, 2),
            "interval": [round(v, 2) for v in vs_not_ci],
            "goal": "within noise (~1.0x)",
        },
        {
            "measurement": "shadow: p99 of the mirrored users, mirroring on vs off",
            "value": round(p99(pooled(on_m)), 1),
            "baseline": round(p99(pooled(off_m)), 1),
            "unit": "ms",
            "ratio": round(vs_off, 2),
            "interval": [round(v, 2) for v in vs_off_ci],
            "goal": "within noise (~1.0x)",
        },
    ]
    print(
        json.dumps(
            {
                "bench": "shadow",
                "rows": rows,
                "p99_ratio_mirrored_vs_not": round(vs_not, 3),
                "p99_ratio_mirrored_on_vs_off": round(vs_off, 3),
                "detail": summary,
            }
        )
    )
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
