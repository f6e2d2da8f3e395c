"""Cost of the router hop, and the latency cost of loading a candidate, side by side in one run.

Every round measures both; the summary gives the throughput ratio per round and their median,
and the p99s pooled over the rounds, so the noise of a shared 2-core machine is visible next to
the result:

1. Throughput and p50/p99 of ``POST /v1/rank`` through the router (router -> stable ranker)
   vs the ranker deployment serving HTTP itself (``mode: ranker_only``), same model, same
   request, same closed-loop load; the order of the two alternates between rounds so drift
   hits both. Goal: >= 0.8x.
2. p99 through the router in windows where something changes vs steady state (the same
   traffic outside every window), at a fixed request rate (open loop, half the first round's
   router throughput unless given). One traffic phase per round holds ``--events`` windows of
   each kind below, in a shuffled order, one every ``--slot`` seconds:
   - ``canary``: the canary pool loads a fresh ~34 MB candidate (download, verify, load, dry
     run), as a rollout's first step does, while stable serves all the traffic;
   - ``stable``: every stable replica swaps in place, while it serves, to a fresh artifact of
     the architecture it already serves (a larger model would make every later request dearer
     and pass for the load's cost; the first version of this bench did exactly that);
   - ``config``: a stable user_config change that loads nothing: what the declarative update
     costs by itself (dashboard REST read-modify-write, Serve controller, reconfigure);
   - ``none``: nothing happens: the control of the method itself, which should come out at
     ~1.0x (a window holds ~100 requests; its p99 is close to their maximum, so only pooling
     many windows gives a p99 worth comparing).
   A load's window runs from the user_config PUT to the moment the last replica installed the
   candidate, by the ``installed_at`` the replicas report (nothing polls them during the
   window: a status call on a serving replica is a request like any other); ``config`` and
   ``none`` windows are as long as the stable swaps' median. Goal: <= 1.25x.
   The traffic runs in a separate client process, so this process's control-plane calls do
   not stall the client and pass for service latency.

``--layout multinode`` runs the same windows on a production-like layout: a head node with no
CPU resource (GCS, dashboard, Serve controller, the HTTP proxy) and one worker node with every
replica, each a raylet of its own (``rollout.local.multinode``), the head's processes, this one and
the load generator pinned to core 0 and the worker's to core 1 (``taskset``), as production
puts the control plane on a CPU head of its own.

Loopback only, one local Ray cluster on free ports, bounded in count and time. Usage:
    .venv/bin/python bench/bench_router.py [--seconds 8] [--concurrency 16] [--rounds 3]
        [--layout single|multinode]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np

from app.demo_artifacts import DEMO_PARAMS, make_demo_artifacts
from app.models.ranker_mlp.features import NUM_FEATURES
from app.polling import wait_until
from rollout.local.cluster import LocalCluster
from rollout.local.multinode import MultiNodeCluster, pinned_layout
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


def target(packed: Any, revision: int) -> dict[str, Any]:
    return packed.target(revision).model_dump(mode="json")


def spread(values: list[float]) -> str:
    """median [min..max] of per-round values."""
    return f"{statistics.median(values):.2f}x [{min(values):.2f}..{max(values):.2f}]"


KINDS = ("none", "config", "canary", "stable")
LABELS = {
    "none": "nothing changes (control of the method)",
    "config": "config-only stable change (control)",
    "canary": "canary loads a candidate",
    "stable": "stable replicas swap in place",
}


@dataclass
class Window:
    kind: str
    start: float  # perf_counter of this process (CLOCK_MONOTONIC, shared with the client)
    end: float


def windowed(
    windows: list[Window], latencies: list[float], stamps: list[float], first: float
) -> tuple[dict[str, list[list[float]]], list[list[float]]]:
    """Latencies of the requests in flight at any moment of each window, per kind and window,
    and of the steady-state requests, per gap between windows: those that overlap no window
    nor the second after one (as the phase's first second, left out as warm-up)."""
    inside: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    per_window: list[list[float]] = [[] for _ in windows]
    gaps: list[list[float]] = [[] for _ in range(len(windows) + 1)]
    for x, done in zip(latencies, stamps, strict=True):
        sent = done - x
        hit = False
        for k, w in enumerate(windows):
            if done >= w.start and sent <= w.end:
                per_window[k].append(x)
                hit = True
        near = any(done >= w.start and sent <= w.end + 1.0 for w in windows)
        if not hit and not near and sent >= first + 1.0:
            gaps[sum(w.start <= sent for w in windows)].append(x)
    for w, got in zip(windows, per_window, strict=True):
        inside[w.kind].append(got)
    return inside, [gap for gap in gaps if gap]


def p99_ratio_interval(
    windows: list[list[float]], gaps: list[list[float]], seed: int, resamples: int = 2000
) -> tuple[float, float]:
    """90% interval of (pooled p99 in the windows) / (pooled p99 in steady state) by a
    cluster bootstrap: whole windows and whole gaps between them are resampled, as requests
    close in time share their fate (one hiccup slows a burst of them)."""
    rng = np.random.default_rng(seed)
    w = [np.asarray(x) for x in windows if x]
    g = [np.asarray(x) for x in gaps if x]
    if not w or not g:
        return float("nan"), float("nan")
    ratios = np.empty(resamples)
    for b in range(resamples):
        a = np.concatenate([w[i] for i in rng.integers(0, len(w), len(w))])
        s = np.concatenate([g[i] for i in rng.integers(0, len(g), len(g))])
        ratios[b] = np.percentile(a, 99) / np.percentile(s, 99)
    lo, hi = np.percentile(ratios, [5, 95])
    return float(lo), float(hi)


def flat(groups: list[list[float]]) -> list[float]:
    return [x for group in groups for x in group]


def pin_proxies(cores: set[int]) -> list[int]:
    """Move every thread of Serve's HTTP proxies onto ``cores`` (a thread keeps the affinity it
    was created with, so each one is set, as ``taskset -a`` does)."""
    from ray.util.state import list_actors

    pids = [
        int(actor.pid)
        for actor in list_actors(filters=[("class_name", "=", "ProxyActor")], detail=True)
        if actor.state == "ALIVE" and actor.pid
    ]
    if not pids:
        raise RuntimeError("no live ProxyActor to move")
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), cores)
    return pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per throughput phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--events", type=int, default=6, help="windows of each kind per round (shuffled)"
    )
    parser.add_argument(
        "--slot", type=float, default=4.0, help="seconds from one window to the next"
    )
    parser.add_argument("--candidates", type=int, default=16, help="per request")
    parser.add_argument(
        "--candidate-hidden",
        type=int,
        default=1024,
        help="hidden_dim of the canary's candidate (8 layers): 1024 ~ 34 MB, 2048 ~ 134 MB",
    )
    parser.add_argument(
        "--load-rate",
        type=float,
        default=None,
        help="req/s of the windowed phases (default: half the first round's router rate)",
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
    parser.add_argument("--seed", type=int, default=20261129, help="of the window order")
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="kinds of windows to measure (comma-separated; 'none' and 'config' are controls)",
    )
    parser.add_argument(
        "--layout",
        choices=("single", "multinode"),
        default="single",
        help="one node, or a CPU-less head on core 0 and a worker node on core 1",
    )
    parser.add_argument(
        "--proxy-core",
        choices=("head", "worker"),
        default="head",
        help="(multinode) the core of the HTTP proxy that takes the load: the head's, beside "
        "the Serve controller and dashboard, or the worker's, as proxy_location: EveryNode "
        "puts one on every node of a real cluster (one host cannot run two on one port, so "
        "the head's proxy is moved onto the worker's core)",
    )
    args = parser.parse_args()
    measured = [kind for kind in KINDS if kind in args.kinds.split(",")]
    if not measured or set(args.kinds.split(",")) - set(KINDS):
        parser.error(f"--kinds: a comma-separated subset of {','.join(KINDS)}")

    if args.layout == "multinode" and len(os.sched_getaffinity(0)) < 2:
        parser.error("--layout multinode needs two cores: one for the head, one for the worker")

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    params = {"hidden_dim": args.candidate_hidden, "num_layers": 8, "context_dim": 16}
    loads = args.rounds * args.events
    # A distinct candidate per window: each load is a full download + verify + load + dry run.
    # The canary loads large ones (it serves nothing meanwhile); stable swaps in place to ones
    # of the serving model's own architecture, so the requests measured during and after the
    # swap cost what they cost before it: the difference is the load, not a heavier model.
    candidates = {
        "canary": [
            pack_ranker(
                work / "store", artifact_id=f"ranker-large-{i}", seed=1000 + i, params=params
            )
            for i in range(loads)
        ],
        "stable": [
            pack_ranker(
                work / "store", artifact_id=f"ranker-same-{i}", seed=2000 + i, params=DEMO_PARAMS
            )
            for i in range(loads)
        ],
    }
    # Ray and Serve on free ports (GCS, dashboard, metrics, HTTP); Ray's own metrics report
    # interval (10 s), not LocalCluster's 1 s for the tests: the bench measures latency, and
    # nothing here reads the metrics.
    multinode: MultiNodeCluster | None = None
    if args.layout == "multinode":
        # This driver and, inherited, the load generator run on the head's core.
        multinode = pinned_layout(work)
        import ray

        try:
            ray.init(address=multinode.address, log_to_driver=False, namespace="bench")
        except BaseException:
            multinode.stop()
            raise
        cluster: LocalCluster | MultiNodeCluster = multinode
    else:
        cluster = LocalCluster.start(num_cpus=4, metrics_report_interval_ms=10_000)
    rest = cluster.serve_control()
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
        applications = [
            {
                "name": "routed",
                "route_prefix": "/routed",
                "import_path": "deployments.app:build_app",
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
                "import_path": "deployments.app:build_app",
                "args": {**common, "stable": cohort, "mode": "ranker_only"},
            },
        ]
        wait_until(
            lambda: rest.details() is not None, 60, "dashboard up", every=0.2, retry_on=(Exception,)
        )
        # One proxy, on the head node (on the multinode layout, beside the control plane).
        cluster.deploy(applications, timeout_s=180)
        if multinode is not None and args.proxy_core == "worker":
            assert multinode.worker_cpus is not None
            moved = pin_proxies({int(c) for c in multinode.worker_cpus.split(",")})
            print(f"HTTP proxy (pid {', '.join(map(str, moved))}) moved to the worker's core")
        handles = {
            name: serve.get_deployment_handle(name, app_name="routed")
            for name in ("stable", "canary")
        }
        replicas = {"stable": args.stable_replicas, "canary": 1}
        base = cluster.http_url
        payloads = [body(args.candidates, seed) for seed in range(64)]
        routes = {"router": f"{base}/routed/v1/rank", "direct": f"{base}/direct/v1/rank"}
        # Traffic runs in its own process: the control-plane calls of this one (the REST PUT,
        # the reports read after a load) would otherwise hold up the client's event loop and
        # show up as service latency in exactly the windows being measured.
        clients = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        )
        for url in routes.values():  # warm up both paths (and the client process)
            clients.submit(traffic, "closed", url, payloads, 2.0, args.concurrency).result()

        # time.time() - perf_counter(): turns the replicas' wall-clock installed_at into this
        # process's monotonic time (same machine, same clocks).
        wall_offset = time.time() - time.perf_counter()
        order_rng = random.Random(args.seed)
        revisions = {"stable": 1, "canary": 0}
        used = {"stable": 0, "canary": 0}
        swap_lengths: list[float] = []
        config_changes = itertools.count(1)

        def reports_of(deployment: str, revision: int, timeout: float = 120.0):
            """Every replica's report once all have installed ``revision``; each call reaches
            one replica, so keep asking until each has answered."""
            seen: dict[str, dict[str, Any]] = {}

            def all_seen() -> list[dict[str, Any]] | None:
                report = handles[deployment].status.remote().result(timeout_s=10)
                if report["phase"] == "failed":  # not retried: ends the wait at once
                    raise RuntimeError(f"candidate failed to load: {report['last_error']}")
                if report["actual_revision"] == revision:
                    seen[report["replica_id"]] = report
                return list(seen.values()) if len(seen) == replicas[deployment] else None

            # A pause after every answer, also one from a replica already seen: the next call
            # may reach the same one again.
            return wait_until(all_seen, timeout, f"{deployment} revision {revision} installed")

        def event(kind: str, slot_end: float) -> tuple[Window, dict[str, Any]]:
            length = statistics.median(swap_lengths) if swap_lengths else 1.0
            start = time.perf_counter()
            if kind == "none":
                return Window(kind, start, start + length), {}
            if kind == "config":
                n = next(config_changes)  # a value not seen before: a real change
                rest.update_user_configs(
                    "routed", {"stable": lambda cfg: {**cfg, "report_interval_s": 10.0 + n / 8}}
                )
                return Window(kind, start, start + length), {}
            revisions[kind] += 1
            candidate = candidates[kind][used[kind]]
            used[kind] += 1
            rest.update_user_configs(
                "routed",
                {kind: lambda cfg: {**cfg, "target": target(candidate, revisions[kind])}},
            )
            # Nothing asks the replicas anything until the slot is over.
            time.sleep(max(0.0, slot_end - time.perf_counter()))
            reports = reports_of(kind, revisions[kind])
            end = max(float(r["installed_at"]) for r in reports) - wall_offset
            if kind == "stable":
                swap_lengths.append(end - start)
            return Window(kind, start, end), reports[0].get("timings", {})

        errors = 0
        rounds: list[dict[str, Any]] = []
        pooled: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
        steady_pooled: list[list[float]] = []
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

            kinds = [kind for kind in measured for _ in range(args.events)]
            order_rng.shuffle(kinds)
            settle = 2.5
            # Slack for loads that run past their slot: the traffic must outlast the events.
            seconds = settle + len(kinds) * args.slot * 1.25 + 2.0
            phase = clients.submit(traffic, "open", routes["router"], payloads, seconds, rate)
            time.sleep(settle)
            windows: list[Window] = []
            timings: dict[str, dict[str, float]] = {}
            for kind in kinds:
                slot_end = time.perf_counter() + args.slot
                window, loaded = event(kind, slot_end)
                windows.append(window)
                if loaded:
                    timings[kind] = loaded
                time.sleep(max(0.0, slot_end - time.perf_counter()))
            lat, stamps, err, _ = phase.result()
            errors += err
            if max(stamps) < max(w.end for w in windows):
                raise RuntimeError("the traffic ended before the last window: raise its slack")
            first = min(t - x for x, t in zip(lat, stamps, strict=True))
            inside, steady = windowed(windows, lat, stamps, first)
            for kind in KINDS:
                pooled[kind].extend(inside[kind])
            steady_pooled.extend(steady)
            row["windows"] = {
                kind: {
                    **summarize(flat(inside[kind]), 1.0),
                    "s": statistics.median(w.end - w.start for w in windows if w.kind == kind),
                }
                for kind in measured
            }
            row["steady"] = summarize(flat(steady), 1.0)
            rounds.append(row)
            said = ", ".join(
                f"{kind} {row['windows'][kind]['p99'] / row['steady']['p99']:.2f}x "
                f"({row['windows'][kind]['s']:.1f} s)"
                for kind in measured
            )
            loaded_in = "; ".join(
                f"{kind} load "
                + ", ".join(
                    f"{k} {v / (1 << 20):.0f} MiB" if k.endswith("_bytes") else f"{k} {v:.2f}s"
                    for k, v in t.items()
                )
                for kind, t in timings.items()
            )
            print(
                f"round {i + 1}: router/direct {row['router']['rps'] / row['direct']['rps']:.2f}x "
                f"({row['router']['rps']:.0f}/{row['direct']['rps']:.0f} req/s)   p99 in windows "
                f"vs steady {row['steady']['p99']:.0f} ms: {said}   ({loaded_in})",
                flush=True,
            )

        def median(name: str, key: str) -> float:
            return statistics.median(r[name][key] for r in rounds)

        print()
        print(f"{'path (median of rounds)':<34}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
        for name, label in (("direct", "ranker as ingress (direct)"), ("router", "router")):
            print(
                f"{label:<34}{median(name, 'rps'):>9.0f}{median(name, 'p50'):>9.1f}"
                f"{median(name, 'p99'):>9.1f}"
            )
        steady = summarize(flat(steady_pooled), 1.0)
        title = f"pooled over rounds at {rate:.0f} req/s"
        print(
            f"\n{title:<42}{'p50 ms':>8}{'p99 ms':>8}{'vs steady':>10}{'90% interval':>15}"
            f"{'requests':>9}"
        )
        print(f"{'steady state':<42}{steady['p50']:>8.1f}{steady['p99']:>8.1f}{'':>25}"
              f"{steady['n']:>9}")  # fmt: skip
        ratios: dict[str, float] = {}
        intervals: dict[str, tuple[float, float]] = {}
        for k, kind in enumerate(measured):
            got = summarize(flat(pooled[kind]), 1.0)
            ratios[kind] = got["p99"] / steady["p99"]
            intervals[kind] = p99_ratio_interval(pooled[kind], steady_pooled, args.seed + k)
            lo, hi = intervals[kind]
            print(
                f"{LABELS[kind]:<42}{got['p50']:>8.1f}{got['p99']:>8.1f}{ratios[kind]:>9.2f}x"
                f"{f'{lo:.2f}..{hi:.2f}x':>15}{got['n']:>9}"
            )
        throughput = [r["router"]["rps"] / r["direct"]["rps"] for r in rounds]
        print(f"\nrouter/direct throughput: {spread(throughput)} (goal >= 0.8)")
        unit = f"ms at {rate:.0f} req/s, {args.rounds * args.events} windows, pooled"
        goals = {"canary": "<= 1.25x", "stable": "<= 1.25x", "config": "", "none": "~1x"}
        measurements = {
            "none": "p99 in windows where nothing changes vs steady (method control)",
            "config": "p99 during a config-only change vs steady (control)",
            "canary": "p99 while the canary loads a candidate vs steady",
            "stable": f"p99 while {args.stable_replicas} stable replicas swap in place vs steady",
        }
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
                    "measurement": measurements[kind],
                    "value": round(summarize(flat(pooled[kind]), 1.0)["p99"], 1),
                    "baseline": round(steady["p99"], 1),
                    "unit": unit,
                    "ratio": round(ratios[kind], 2),
                    "interval": [round(x, 2) for x in intervals[kind]],
                    "goal": goals[kind],
                }
                for kind in ("canary", "stable", "config", "none")
                if kind in measured
            ),
        ]
        print(
            f"{args.rounds} rounds   non-200: {errors}   "
            f"concurrency {args.concurrency}, {args.candidates} candidates/request, "
            f"{args.seconds:.0f} s phases, {args.events} windows of each kind per round, "
            f"candidate hidden_dim {args.candidate_hidden}, {args.stable_replicas} stable replicas"
        )
        print(
            json.dumps({"bench": "router", "layout": args.layout, "non_200": errors, "rows": rows})
        )
    finally:
        if clients is not None:
            clients.shutdown()
        rest.close()
        try:
            if multinode is not None:
                import ray

                try:
                    ray.shutdown()
                finally:
                    multinode.stop()
            else:
                LocalCluster.stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
