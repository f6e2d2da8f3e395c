"""Cost of the router hop, and the latency cost of loading a candidate, side by side in one run.

Every round measures both; the summary gives the throughput ratio per round and their median,
and the p99 ratios pooled over the rounds, so the noise of a shared 2-core machine is visible
next to the result:

1. Throughput and p50/p99 of ``POST /v1/rank`` through the router (router -> stable ranker)
   vs the ranker deployment serving HTTP itself (``mode: ranker_only``), same model, same
   request, same closed-loop load; the order of the two alternates between rounds so drift
   hits both. Goal: >= 0.8x.
2. p99 through the router while a candidate loads (a fresh artifact every round, so every
   round downloads, verifies, loads and dry-runs) vs the same traffic just before the change
   and from 1 s after it, at a fixed request rate (open loop, half the first round's router
   throughput unless given); both sides are pooled over the rounds, as one window holds few
   requests and the p99 of a few is close to their maximum. Measured in the two places a
   candidate loads: (a) the canary pool loads a larger candidate (~34 MB) as a rollout's
   first step does, while stable serves all the traffic; (b) every stable replica swaps in
   place while it serves, to a fresh artifact of the architecture it already serves (a
   larger model would make every request after the swap dearer and pass for the load's cost;
   the first version of this bench did exactly that, and its later rounds also compared a
   heavier routed model with the direct one). ``--stable-replicas`` is 2 by default, as
   production runs several: Serve reconfigures replicas a few at a time. A window runs from
   the user_config PUT to the moment every replica of the deployment reports the candidate
   installed (polled through a handle every 50 ms). Goal: <= 1.25x. A control window of the
   same length around a stable user_config change that loads nothing (``report_interval_s``)
   separates what the declarative update costs by itself (the dashboard REST
   read-modify-write, the Serve controller, reconfigure) from the load's cost.
   The traffic runs in a separate client process, so this process's control-plane calls do
   not stall the client and pass for service latency.

Loopback only, one local Ray cluster on free ports, bounded in count and time. Usage:
    .venv/bin/python bench/bench_router.py [--seconds 8] [--concurrency 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np
import ray

from app.demo_artifacts import DEMO_PARAMS, make_demo_artifacts
from app.features import NUM_FEATURES
from rollout.local_cluster import free_port
from rollout.serve_control import ServeControl
from tests.artifacts import pack_ranker

MAX_REQUESTS_PER_PHASE = 20_000


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


def traffic(kind: str, url: str, payloads: list[bytes], seconds: float, load: float):
    """One traffic phase, run in a separate process (see ``main``): ``closed`` with ``load``
    concurrent workers or ``open`` at ``load`` req/s. Time stamps are perf_counter, which is
    CLOCK_MONOTONIC on Linux and so comparable between processes."""
    if kind == "closed":
        return asyncio.run(closed_loop(url, payloads, seconds, int(load)))
    return asyncio.run(open_loop(url, payloads, seconds, load))


def summarize(latencies: list[float], elapsed: float) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    if not ms:  # e.g. a window that filled its whole phase: no reference around it
        return {"rps": 0.0, "p50": float("nan"), "p99": float("nan"), "n": 0}
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


def spread(values: list[float]) -> str:
    """median [min..max] of per-round values."""
    return f"{statistics.median(values):.2f}x [{min(values):.2f}..{max(values):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
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
        help="req/s of the candidate-load phases (default: half the first round's router rate)",
    )
    parser.add_argument(
        "--calls-per-replica", type=int, default=None, help="router coalesce_calls_per_replica"
    )
    parser.add_argument(
        "--stable-replicas",
        type=int,
        default=2,
        help="replicas of stable (and of the direct path); Serve reconfigures them a few at a "
        "time, so with one alone every user_config change stalls all traffic for a moment",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    params = {"hidden_dim": args.candidate_hidden, "num_layers": 8, "context_dim": 16}
    # A distinct candidate per round: each load is a full download + verify + load + dry run.
    # The canary loads a large one (it serves nothing meanwhile); stable swaps in place to one
    # of the serving model's own architecture, so the requests measured during and after the
    # swap cost what they cost before it: the difference is the load, not a heavier model.
    bigs = [
        pack_ranker(work / "store", artifact_id=f"ranker-large-r{i}", seed=1000 + i, params=params)
        for i in range(args.rounds)
    ]
    same_size = [
        pack_ranker(
            work / "store", artifact_id=f"ranker-same-r{i}", seed=2000 + i, params=DEMO_PARAMS
        )
        for i in range(args.rounds)
    ]
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
    rest = ServeControl(f"http://127.0.0.1:{dash_port}")
    clients: ProcessPoolExecutor | None = None
    try:
        from ray import serve

        router = {}
        if args.calls_per_replica:
            router["coalesce_calls_per_replica"] = args.calls_per_replica
        common = {"cache_dir": str(work / "cache"), "router_num_cpus": 0.1}
        cohort = {
            "num_replicas": args.stable_replicas,
            "num_cpus": 0.1,
            "target": target(demo["ranker-v41"], 1),
        }
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
        rest.apply(config)
        wait_for(
            lambda: all(rest.app_status(a) == "RUNNING" for a in ("routed", "direct")),
            180,
            "apps running",
        )
        handles = {
            name: serve.get_deployment_handle(name, app_name="routed")
            for name in ("stable", "canary")
        }
        base = f"http://127.0.0.1:{http_port}"
        payloads = [body(args.candidates, seed) for seed in range(64)]
        routes = {"router": f"{base}/routed/v1/rank", "direct": f"{base}/direct/v1/rank"}
        # Traffic runs in its own process: the control-plane calls of this one (the REST PUT,
        # the install polling) would otherwise hold up the client's event loop and show up as
        # service latency in exactly the windows being measured.
        clients = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        )
        for url in routes.values():  # warm up both paths (and the client process)
            clients.submit(traffic, "closed", url, payloads, 2.0, args.concurrency).result()

        errors = 0
        rounds: list[dict[str, Any]] = []
        # Per kind of change: latencies in its windows and around them, over every round.
        pooled: dict[str, tuple[list[float], list[float]]] = {}
        rate = args.load_rate
        for i in range(args.rounds):
            row: dict[str, Any] = {}
            order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
            for name in order:
                lat, _, err, elapsed = clients.submit(
                    traffic, "closed", routes[name], payloads, args.seconds, args.concurrency
                ).result()
                errors += err
                row[name] = summarize(lat, elapsed)
            if rate is None:
                rate = 0.5 * row["router"]["rps"]

            revision = 2 + i
            candidate = bigs[i]

            def during_change(
                deployment: str,
                change: Any,
                revision: int | None,
                window: float | None = None,
                rate=rate,
            ) -> tuple[list[float], list[float], int, float, dict[str, Any]]:
                """Open-loop traffic around one user_config change of ``deployment``. The
                window ends when every replica of it reports ``revision`` installed, or after
                ``window`` seconds. Returns the latencies of the requests in flight at any
                moment of the window, and of the same traffic's requests wholly before it or
                wholly after it (from 1 s after its end): the reference, measured under the
                same conditions, in the same phase."""
                phase = clients.submit(
                    traffic, "open", routes["router"], payloads, 3 * args.seconds, rate
                )
                # Let the traffic settle, then keep a reference of at least a second before the
                # change (requests in the phase's first second are left out as warm-up).
                time.sleep(max(args.seconds / 4, 2.5))
                start = time.perf_counter()
                rest.update_user_configs("routed", {deployment: change})
                report: dict[str, Any] = {}
                seen: dict[str, dict[str, Any]] = {}
                replicas = args.stable_replicas if deployment == "stable" else 1
                while revision is not None:
                    # Each call reaches one replica: keep asking until all have answered
                    # with the revision installed.
                    report = handles[deployment].status.remote().result(timeout_s=10)
                    if report["phase"] == "failed":
                        raise RuntimeError(f"candidate failed to load: {report['last_error']}")
                    if report["actual_revision"] == revision:
                        seen[report["replica_id"]] = report
                        if len(seen) >= replicas:
                            break
                    if time.perf_counter() - start > 120:
                        raise TimeoutError("candidate not installed after 120 s")
                    time.sleep(0.05)  # polling interval of the install
                if window is not None:
                    time.sleep(max(0.0, start + window - time.perf_counter()))
                end = time.perf_counter()
                lat, stamps, err, _ = phase.result()
                first = min(t - x for x, t in zip(lat, stamps, strict=True))
                in_window, reference = [], []
                for x, t in zip(lat, stamps, strict=True):
                    if t >= start and t - x <= end:
                        in_window.append(x)
                    elif (first + 1.0 <= t - x and t < start) or t - x > end + 1.0:
                        reference.append(x)
                return in_window, reference, err, end - start, report

            def new_target(cfg: dict[str, Any], candidate: Any, revision=revision):
                return {**cfg, "target": target(candidate, revision)}

            # 1. What a rollout does first: the canary pool loads the candidate while stable
            #    serves all the traffic (weight 0 to the canary).
            prep_in, prep_ref, err1, prep_s, _ = during_change(
                "canary", lambda cfg, c=candidate: new_target(cfg, c), revision
            )
            # 2. Stable hot-swaps in place: every stable replica loads while it serves.
            swap_in, swap_ref, err2, swap_s, report = during_change(
                "stable", lambda cfg, c=same_size[i]: new_target(cfg, c), revision
            )

            # Control: a user_config change that loads nothing, over a window as long as the
            # swap's: what the declarative update costs without any candidate load.
            def config_only(cfg: dict[str, Any], i=i) -> dict[str, Any]:
                return {**cfg, "report_interval_s": 10.0 + 0.5 * (i + 1)}

            ctl_in, ctl_ref, err3, _, _ = during_change("stable", config_only, None, window=swap_s)
            errors += err1 + err2 + err3
            for name, inside, outside, span in (
                ("preparing", prep_in, prep_ref, prep_s),
                ("loading", swap_in, swap_ref, swap_s),
                ("control", ctl_in, ctl_ref, swap_s),
            ):
                pooled.setdefault(name, ([], []))
                pooled[name][0].extend(inside)
                pooled[name][1].extend(outside)
                row[name] = {
                    "in": summarize(inside, max(span, 1e-9)),
                    "ref": summarize(outside, 1.0),
                    "window_s": span,
                }
            row["timings"] = report.get("timings", {})
            rounds.append(row)

            def said(name: str, row=row) -> str:
                r = row[name]
                return (
                    f"{r['in']['p99'] / r['ref']['p99']:.2f}x ({r['in']['p99']:.0f}/"
                    f"{r['ref']['p99']:.0f} ms, {r['in']['n']} requests in {r['window_s']:.1f} s)"
                )

            print(
                f"round {i + 1}: router/direct {row['router']['rps'] / row['direct']['rps']:.2f}x "
                f"({row['router']['rps']:.0f}/{row['direct']['rps']:.0f} req/s)   p99 in window "
                f"vs around it: canary loads {said('preparing')}, stable swaps "
                f"{said('loading')}, config-only {said('control')}; stable load "
                + ", ".join(f"{k} {v:.2f}s" for k, v in row["timings"].items()),
                flush=True,
            )

        def median(name: str, key: str) -> float:
            return statistics.median(r[name][key] for r in rounds)

        def p99(values: list[float]) -> float:
            return summarize(values, 1.0)["p99"]

        print()
        print(f"{'path (median of rounds)':<34}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
        for name, label in (("direct", "ranker as ingress (direct)"), ("router", "router")):
            print(
                f"{label:<34}{median(name, 'rps'):>9.0f}{median(name, 'p50'):>9.1f}"
                f"{median(name, 'p99'):>9.1f}"
            )
        title = f"p99 pooled over rounds at {rate:.0f} req/s"
        print(f"\n{title:<40}{'in window':>10}{'around':>10}{'ratio':>8}{'n in':>7}")
        ratios = {}
        for name, label in (
            ("preparing", "canary loads a candidate"),
            ("loading", "stable swaps in place"),
            ("control", "config-only change"),
        ):
            inside, outside = pooled[name]
            ratios[name] = p99(inside) / p99(outside)
            print(
                f"{label:<40}{p99(inside):>10.1f}{p99(outside):>10.1f}"
                f"{ratios[name]:>7.2f}x{len(inside):>7}"
            )
        throughput = [r["router"]["rps"] / r["direct"]["rps"] for r in rounds]
        print(f"\nrouter/direct throughput: {spread(throughput)} (goal >= 0.8)")
        unit = f"ms at {rate:.0f} req/s, pooled over rounds"
        rows = [
            {
                "measurement": "throughput through the router vs ranker as ingress",
                "value": round(median("router", "rps"), 1),
                "baseline": round(median("direct", "rps"), 1),
                "unit": "req/s, median of rounds",
                "ratio": round(statistics.median(throughput), 2),
                "goal": ">= 0.8x",
            },
            *(
                {
                    "measurement": measurement,
                    "value": round(p99(pooled[name][0]), 1),
                    "baseline": round(p99(pooled[name][1]), 1),
                    "unit": unit,
                    "ratio": round(ratios[name], 2),
                    "goal": goal,
                }
                for name, measurement, goal in (
                    (
                        "preparing",
                        "p99 while the canary loads a candidate vs around it",
                        "<= 1.25x",
                    ),
                    (
                        "loading",
                        f"p99 while {args.stable_replicas} stable replicas swap in place "
                        "vs around it",
                        "<= 1.25x",
                    ),
                    ("control", "p99 during a config-only change vs around it (control)", ""),
                )
            ),
        ]
        print(
            f"{args.rounds} rounds   non-200: {errors}   "
            f"concurrency {args.concurrency}, {args.candidates} candidates/request, "
            f"{args.seconds:.0f} s phases, candidate hidden_dim {args.candidate_hidden}, "
            f"{args.stable_replicas} stable replicas"
        )
        print(json.dumps({"bench": "router", "non_200": errors, "rows": rows}))
    finally:
        if clients is not None:
            clients.shutdown()
        rest.close()
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
