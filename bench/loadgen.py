"""Load generator: bounded synthetic ranking traffic against a local service.

Open loop (``--rate``: requests start on a fixed schedule whatever the answers do) or closed
loop (``--concurrency`` workers, no ``--rate``). Loopback targets only; bounded by
``--requests`` and ``--seconds``. Records every request (start, latency, status, cohort,
artifact, revision, user key) into a JSON file and draws a timeline picture. A plain client
by default (every non-2xx counted as it came); ``--retries N``: app/client.py's retrying client
(429/5xx and connection errors retried up to N times, Retry-After honoured).

    .venv/bin/python bench/loadgen.py --url http://127.0.0.1:8000 --rate 50 --seconds 30
    .venv/bin/python bench/loadgen.py --url http://127.0.0.1:8000 --concurrency 16 --seconds 30
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from app.client import RetryPolicy
from rollout.local.traffic import TrafficRun, TrafficSpec, plot_timeline, summarize, write_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rate", type=float, default=None, help="open loop, requests/s")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=100_000, help="upper bound")
    parser.add_argument("--seconds", type=float, default=30.0, help="upper bound")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=20)
    parser.add_argument(
        "--retries", type=int, default=0, help="retries per call (0: a plain client)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/loadgen"))
    args = parser.parse_args()

    run = TrafficRun(
        TrafficSpec(
            url=args.url,
            rate=args.rate,
            concurrency=args.concurrency,
            max_requests=args.requests,
            max_seconds=args.seconds,
            users=args.users,
            candidates=args.candidates,
            retry=RetryPolicy(max_attempts=args.retries + 1) if args.retries else None,
        )
    )
    records = run.start().join()
    args.out.mkdir(parents=True, exist_ok=True)
    write_records(records, args.out / "records.json")
    picture = plot_timeline(records, args.out / "timeline.png", title="loadgen")
    summary = summarize(records)
    mode = f"open loop {args.rate:g}/s" if args.rate else f"closed loop x{args.concurrency}"
    elapsed = max((r.start_s for r in records), default=0.0)
    print(
        f"{mode}: {summary.requests} requests in {elapsed:.1f}s "
        f"({summary.requests / max(elapsed, 1e-9):.1f}/s), non-2xx {summary.non_2xx}, "
        f"statuses {summary.statuses}"
    )
    if summary.requests and not summary.by_cohort:
        print("  no per-cohort split: the answers do not name their cohort (the router's "
              "reveal_cohort is off, as in production configs)")  # fmt: skip
    for cohort, stats in summary.by_cohort.items():
        print(f"  {cohort}: {stats['requests']} answers, p50 {stats['p50_ms']:.1f} ms, "
              f"p99 {stats['p99_ms']:.1f} ms")  # fmt: skip
    print(json.dumps({**asdict(summary), "records": str(args.out / "records.json"),
                      "timeline": str(picture)}))  # fmt: skip


if __name__ == "__main__":
    main()
