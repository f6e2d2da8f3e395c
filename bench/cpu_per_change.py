"""Where the CPU of a config-only user_config change goes, per process, on each node.

On the production-like layout of ``bench_router --layout multinode`` (a CPU-less head on one
core, a worker node with every replica on the other), with a fixed open-loop load running:
``--changes`` stable user_config changes that load nothing (a new ``report_interval_s``), one
every ``--every`` seconds, against an equally long stretch with none. Each process's CPU time
(utime + stime from /proc) is read before and after both stretches; the difference between
them, per change, is what a change costs that process. Processes are named by their title
(Ray renames its workers ``ray::ServeReplica:ranker:stable`` and so on) and grouped by node.

Usage: .venv/bin/python bench/cpu_per_change.py [--changes 20] [--every 1.5] [--rate 40]
Last line: JSON {"per_change_ms": {node: {process: ms}}, "changes": N}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.demo_artifacts import make_demo_artifacts
from bench.bench_router import body, traffic
from rollout.local.multinode import MultiNodeCluster, _descendants, _processes_naming, pinned_layout

TICKS = os.sysconf("SC_CLK_TCK")


def title(pid: int) -> str:
    """A process's name as Ray shows it: its title (cmdline), shortened."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    first = args[0]
    if first.startswith("ray::"):
        # Ray's title is the actor and the method it runs now: keep the actor.
        return re.sub(r"[.\s].*", "", first)
    for arg in args:
        name = Path(arg).name
        if name.endswith(".py") or name in ("raylet", "gcs_server"):
            return name
    return Path(first).name[:40]


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def processes(cluster: MultiNodeCluster) -> dict[int, str]:
    """pid -> node name, for every process of the cluster (renamed workers included)."""
    worker_pids = {p for w in cluster.workers for p in w.pids}
    nodes: dict[int, str] = {}
    for pid, _ in _processes_naming(cluster.temp_dir):
        node = "worker" if pid in worker_pids else "head"
        for p in (pid, *_descendants(pid)):
            nodes.setdefault(p, node)
    for w in cluster.workers:  # the raylet's children belong to the worker node
        for pid in w.pids:
            for p in _descendants(pid):
                nodes[p] = "worker"
    return nodes


def snapshot(nodes: dict[int, str]) -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in nodes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--every", type=float, default=1.5, help="seconds between changes")
    parser.add_argument("--rate", type=float, default=40.0, help="req/s of the load")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two cores: one for the head, one for the worker")
    work = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    cluster = pinned_layout(work)
    clients = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    rest = cluster.serve_control()
    try:
        cohort = {
            "num_replicas": 2,
            "num_cpus": 0.1,
            "target": demo["ranker-v41"].target(1).model_dump(mode="json"),
        }
        cluster.deploy(
            [
                {
                    "name": "routed",
                    "route_prefix": "/routed",
                    "import_path": "deployments.app:build_app",
                    "args": {
                        "cache_dir": str(work / "cache"),
                        "router_num_cpus": 0.1,
                        "stable": cohort,
                        "canary": {"num_replicas": 1, "num_cpus": 0.1},
                    },
                }
            ]
        )
        url = f"{cluster.http_url}/routed/v1/rank"
        payloads = [body(16, seed) for seed in range(64)]
        clients.submit(traffic, "closed", url, payloads, 2.0, 4).result()  # warm up
        stretch = args.changes * args.every
        load = clients.submit(traffic, "open", url, payloads, 2 * stretch + 4.0, args.rate)
        time.sleep(2.0)
        nodes = processes(cluster)
        names = {pid: (node, title(pid)) for pid, node in nodes.items()}  # titles change later
        quiet_start = snapshot(nodes)
        time.sleep(stretch)
        quiet_end = snapshot(nodes)
        for n in range(args.changes):
            began = time.perf_counter()
            rest.update_user_configs(
                "routed", {"stable": lambda cfg, n=n: {**cfg, "report_interval_s": 10.0 + n / 8}}
            )
            time.sleep(max(0.0, began + args.every - time.perf_counter()))
        busy_end = snapshot(nodes)
        _, _, errors, _ = load.result()
        per_change: dict[str, dict[str, float]] = {}
        for pid, (node, name) in names.items():
            quiet = quiet_end[pid] - quiet_start[pid]
            busy = busy_end[pid] - quiet_end[pid]
            ms = (busy - quiet) / args.changes * 1000.0
            rows = per_change.setdefault(node, {})
            rows[name] = round(rows.get(name, 0.0) + ms, 1)
        print(f"CPU per config-only change (ms; busy minus quiet, {args.changes} changes)")
        for node, rows in per_change.items():
            total = sum(rows.values())
            print(f"  {node}: {total:.1f} ms")
            for name, ms in sorted(rows.items(), key=lambda kv: -kv[1]):
                if abs(ms) >= 0.5:
                    print(f"    {name:<50}{ms:>8.1f}")
        print(f"  non-200 during the run: {errors}")
        print(json.dumps({"per_change_ms": per_change, "changes": args.changes}))
    finally:
        clients.shutdown()
        rest.close()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
