"""Record what the judge sees in steady state, for bench/bench_judge.py to resample.

Starts the whole local stack (as ``rollout demo`` runs it), holds a rollout of ranker-v42 over
ranker-v41 at 50% (a gate before its last step; both models have the same architecture and
size), and sends open-loop traffic at each rate in turn. Every answer is kept, grouped into
one-second chunks per cohort: its latency as the client measured it and whether it failed.
Nothing is injected: regressions are applied by the benchmark, on top of these recordings.

    .venv/bin/python bench/record_judge_windows.py [--rates 40 80 140] [--seconds 90] \\
        [--out bench/data/judge_windows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOLD_PLAN: dict[str, Any] = {
    "judge": "threshold",
    "steps": [50, 100],
    "interval_s": 3,
    "min_requests": 5,
    "threshold": 100,
    "progress_deadline_s": 3600,
    "gates": {"pause_before_steps": [100]},
    "checks": {"success_rate_min": 0.5, "p99_max_ms": 30000, "p99_max_ratio": None,
               "error_rate_max_ratio": None},
    "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
}  # fmt: skip
WARMUP_S = 5.0  # dropped from each rate's recording: the rate's own ramp-up


def chunks_of(records: list[Any], seconds: float) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = [
        {"stable": [], "canary": [], "stable_errors": 0, "canary_errors": 0}
        for _ in range(int(seconds))
    ]
    for r in records:
        index = int(r.start_s - WARMUP_S)
        if not 0 <= index < len(chunks) or r.cohort not in ("stable", "canary"):
            continue
        chunk = chunks[index]
        chunk[r.cohort].append(round(r.latency_ms, 2))
        if not 200 <= r.status < 300 or r.failover:
            chunk[f"{r.cohort}_errors"] += 1
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[40.0, 80.0, 140.0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "judge_windows.json")
    args = parser.parse_args()
    os.chdir(ROOT)

    from app.polling import wait_until
    from rollout.local.stack import CANDIDATE, LocalStack
    from rollout.local.traffic import TrafficRun, TrafficSpec

    recordings = []
    with tempfile.TemporaryDirectory(prefix="record-judge-") as tmp:
        stack = LocalStack.up(Path(tmp), echo=lambda line: print(line, file=sys.stderr))
        try:
            stack.call("start_rollout", CANDIDATE, HOLD_PLAN, "bench")
            warm = TrafficRun(TrafficSpec(url=stack.cluster.http_url, rate=20, max_seconds=120))
            warm.start()
            wait_until(lambda: stack.call("status").get("phase") == "paused", 120, "held at 50%")
            warm.stop()
            for rate in args.rates:
                run = TrafficRun(
                    TrafficSpec(
                        url=stack.cluster.http_url,
                        rate=rate,
                        max_requests=10_000_000,
                        max_seconds=args.seconds + WARMUP_S,
                        users=1000,
                    )
                )
                records = run.start().join(timeout=args.seconds + 60)
                chunks = chunks_of(records, args.seconds)
                answered = sum(len(c["stable"]) + len(c["canary"]) for c in chunks)
                print(f"   rate {rate:g}: {answered} answers", file=sys.stderr)
                recordings.append({"rate": rate, "chunk_s": 1.0, "chunks": chunks})
            stack.call("command", "abort", "recording done")
        finally:
            stack.down()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "bench/record_judge_windows.py " + " ".join(sys.argv[1:])
    args.out.write_text(
        json.dumps(
            {
                "command": command.strip(),
                "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                f"{platform.python_version()}",
                "what": "client-side latency (ms) of every answer per cohort and one-second "
                "chunk, the rollout held at 50% (ranker-v42 over ranker-v41); errors count "
                "non-2xx answers and failovers",
                "recordings": recordings,
            },
            separators=(",", ":"),
        )
    )
    print(json.dumps({"out": str(args.out), "rates": args.rates}))


if __name__ == "__main__":
    main()
