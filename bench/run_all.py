"""Every benchmark in one run, one table of ratios measured side by side.

Runs each bench script in turn (each starts and stops what it needs: its own Ray cluster, its
own PostgreSQL), collects the JSON line each prints last, and prints one table; the table and
the machine it ran on are also written to bench/out/results.json.

    .venv/bin/python bench/run_all.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> list[dict]:
    print(f"== {script} {' '.join(args)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    sys.stderr.write(proc.stdout)
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{") and '"rows"' in line:
            rows = json.loads(line)["rows"]
            print(f"   ({time.monotonic() - started:.0f}s)", file=sys.stderr)
            return rows
    sys.stderr.write(proc.stderr[-3000:])
    return [{"measurement": f"{script} failed (exit {proc.returncode})", "value": None,
             "baseline": None, "unit": "", "ratio": None, "goal": ""}]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter phases")
    args = parser.parse_args()
    quick = args.quick
    rows: list[dict] = []
    rows += run("bench_router.py", *(["--rounds", "1"] if quick else []))
    rows += run("bench_verify.py", "--rounds", "1" if quick else "3")
    rows += run("bench_load.py", *(["--quick"] if quick else []))
    rows += run("bench_batching.py", *(["--quick"] if quick else []))
    rows += run("bench_signature.py", *(["--quick"] if quick else []))
    rows += run("bench_rollout.py", "--rounds", "1" if quick else "3")
    rows += run("bench_judge.py", *(["--quick"] if quick else []))
    rows += run("judge_floor.py")
    rows += run("bench_shadow.py", *(["--quick"] if quick else []))
    rows += run("bench_head_swap.py", *(["--quick"] if quick else []))
    rows += run("bench_registry.py")

    width = max(len(r["measurement"]) for r in rows)
    print(f"{'measurement':<{width}}  {'value':>10}  {'baseline':>10}  {'ratio':>18}  goal")
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:g}"
        baseline = "-" if r["baseline"] is None else f"{r['baseline']:g}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:g}x"
        if r.get("interval"):  # a 90% bootstrap interval where the ratio is a noisy one
            ratio += " [{:g}..{:g}]".format(*r["interval"])
        print(f"{r['measurement']:<{width}}  {value:>10}  {baseline:>10}  {ratio:>18}  "
              f"{r['goal']}  ({r['unit']})")  # fmt: skip
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    (out / "results.json").write_text(
        json.dumps(
            {
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"({datetime.now(UTC):%Y-%m-%d}, {machine})")


if __name__ == "__main__":
    main()
