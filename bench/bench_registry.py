"""Compare-and-set publish latency of the registry, SQLite vs PostgreSQL, side by side.

    .venv/bin/python bench/bench_registry.py [--publishes 300] [--threads 4]

Starts its own throwaway PostgreSQL server (tests/postgres.py) and an SQLite file in a temp
dir, then runs the same workloads on both through the public Registry API:

- sequential: one client, each publish on the revision the previous one returned (always wins);
- contended: N threads, each reading the target and publishing on what it read (some lose
  with RevisionConflict; both outcomes are timed).

Prints one table with p50/p99 per backend and workload and the PostgreSQL/SQLite ratio.
Numbers are only comparable within one run on one machine. The PostgreSQL server runs with
fsync=off and SQLite with synchronous=NORMAL (WAL), so neither waits for the disk: this
measures protocol, locking and transaction cost, not storage.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.* when run as a script

from app.errors import RevisionConflict
from app.registry import Registry, open_registry
from tests.integration.manifests import write_manifest
from tests.postgres import running_server

MODEL, ENV, COHORT = "ranker", "default", "stable"
WARMUP = 20


@dataclass
class Sample:
    workload: str
    backend: str
    latencies_s: list[float]
    wins: int
    conflicts: int

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
        return ordered[index]


def _prepare(registry: Registry, manifests_dir: Path) -> int:
    for artifact_id in ("bench-a", "bench-b"):
        ref = write_manifest(manifests_dir / artifact_id, artifact_id)
        registry.register_artifact(ref.uri, ref.sha256, state="ready")
    revision = registry.publish(MODEL, ENV, COHORT, "bench-a", 0, actor="bench", reason="start")
    return revision.revision


def _sequential(registry: Registry, backend: str, revision: int, publishes: int) -> Sample:
    latencies = []
    for i in range(WARMUP + publishes):
        artifact = "bench-b" if i % 2 == 0 else "bench-a"
        start = time.perf_counter()
        target = registry.publish(MODEL, ENV, COHORT, artifact, revision, actor="b", reason="seq")
        elapsed = time.perf_counter() - start
        revision = target.revision
        if i >= WARMUP:
            latencies.append(elapsed)
    return Sample("sequential", backend, latencies, publishes, 0)


def _contended(registry: Registry, backend: str, threads: int, attempts: int) -> Sample:
    latencies: list[float] = []
    counts = {"wins": 0, "conflicts": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def worker(i: int) -> None:
        barrier.wait()
        for n in range(attempts):
            seen = registry.get_target(MODEL, ENV, COHORT).revision
            artifact = "bench-b" if (i + n) % 2 == 0 else "bench-a"
            start = time.perf_counter()
            try:
                registry.publish(MODEL, ENV, COHORT, artifact, seen, actor=f"t{i}", reason="con")
                outcome = "wins"
            except RevisionConflict:
                outcome = "conflicts"
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                counts[outcome] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return Sample(f"contended x{threads}", backend, latencies, counts["wins"], counts["conflicts"])


def _run_backend(
    url: str, backend: str, manifests_dir: Path, publishes: int, threads: int
) -> list[Sample]:
    with open_registry(url) as registry:
        revision = _prepare(registry, manifests_dir)
        sequential = _sequential(registry, backend, revision, publishes)
        contended = _contended(registry, backend, threads, max(1, publishes // threads))
        # The invariant the workloads rely on, checked once more here.
        final = registry.get_target(MODEL, ENV, COHORT).revision
        expected = 1 + WARMUP + sequential.wins + contended.wins
        assert final == expected, f"{backend}: revision {final}, expected {expected}"
    return [sequential, contended]


def _print_table(samples: list[Sample]) -> None:
    headers = ("workload", "backend", "n", "wins", "conflicts", "p50 ms", "p99 ms", "p50 vs sqlite")
    sqlite_p50 = {s.workload: s.percentile(50) for s in samples if s.backend == "sqlite"}
    rows = []
    for s in samples:
        ratio = s.percentile(50) / sqlite_p50[s.workload]
        rows.append(
            (
                s.workload,
                s.backend,
                str(len(s.latencies_s)),
                str(s.wins),
                str(s.conflicts),
                f"{s.percentile(50) * 1e3:.3f}",
                f"{s.percentile(99) * 1e3:.3f}",
                f"{ratio:.2f}x",
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=300, help="timed publishes per workload")
    parser.add_argument("--threads", type=int, default=4, help="threads of the contended workload")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp, running_server() as pg:
        root = Path(tmp)
        samples = _run_backend(
            f"sqlite:///{root / 'registry.db'}", "sqlite", root / "m-sqlite", args.publishes,
            args.threads,
        )  # fmt: skip
        samples += _run_backend(
            pg.create_database("bench"), "postgres", root / "m-postgres", args.publishes,
            args.threads,
        )  # fmt: skip
    samples.sort(key=lambda s: (s.workload != "sequential", s.workload, s.backend != "sqlite"))
    print(f"CAS publish latency, {args.publishes} publishes per workload (after {WARMUP} warm-up)")
    _print_table(samples)
    by = {(s.workload, s.backend): s for s in samples}
    rows = [
        {
            "measurement": f"CAS publish p50, {workload}: postgres vs sqlite",
            "value": round(by[(workload, "postgres")].percentile(50) * 1e3, 3),
            "baseline": round(by[(workload, "sqlite")].percentile(50) * 1e3, 3),
            "unit": "ms",
            "ratio": round(
                by[(workload, "postgres")].percentile(50) / by[(workload, "sqlite")].percentile(50),
                2,
            ),
            "goal": "-",
        }
        for workload in sorted({s.workload for s in samples})
    ]
    print(json.dumps({"bench": "registry", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
