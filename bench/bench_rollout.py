"""How fast the system gets traffic off a bad canary, as clients see it, in one run.

Two measurements on the whole local stack (Ray + Serve + registry + controller, as
``rollout demo`` runs it), each over several rounds under steady load:

- operator rollback: from the ``rollback`` command to the first request after which every
  answer comes from stable; reported with its ratio to the controller's tick interval;
- automatic rollback: from the first request that saw the injected canary fault (errors,
  absorbed by failover) to the controller setting stable 100%; reported with its ratio to the
  plan's bound ``threshold x interval``.

    .venv/bin/python bench/bench_rollout.py [--rounds 3] [--rate 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

PLAN: dict[str, Any] = {
    "judge": "threshold",  # the bound below is threshold x interval; bench_judge.py compares
    "steps": [25, 50, 100],
    "interval_s": 3,
    "min_requests": 5,
    "threshold": 2,
    "progress_deadline_s": 90,
    "gates": {"pause_before_steps": [50]},
    "checks": {"success_rate_min": 0.95, "p99_max_ms": 5000, "p99_max_ratio": None,
               "error_rate_max_ratio": 3.0, "error_rate_floor": 0.05},
    "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
}  # fmt: skip
TICK_S = 0.5
POLL_S = 0.05  # how often the bench looks: small next to the times it measures


def stable_only_since(records: list[Any], after: float, tail: int = 20) -> float | None:
    """Start time of the first request after ``after`` from which every answer is stable."""
    recent = [r for r in records if r.start_s >= after and r.cohort]
    for i, record in enumerate(recent):
        rest = recent[i:]
        if len(rest) >= tail and all(r.cohort == "stable" for r in rest):
            return record.start_s
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=40.0)
    args = parser.parse_args()
    # Test-only fault injection must be allowed in the replicas' environment (inherited from
    # this process by the local cluster).
    os.environ["ROLLOUT_FAULT_INJECTION"] = "allow"

    from app.polling import wait_until
    from rollout.local.stack import APP, CANDIDATE, LocalStack
    from rollout.local.traffic import TrafficRun, TrafficSpec

    failed = total = 0
    operator_s: list[float] = []
    automatic_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        stack = LocalStack.up(Path(tmp), args={"report_interval_s": 0.5})
        control = stack.cluster.serve_control()
        run = TrafficRun(
            TrafficSpec(url=stack.cluster.http_url, rate=args.rate, max_requests=1_000_000,
                        max_seconds=3600, users=1000)
        ).start()  # fmt: skip
        try:
            for _ in range(args.rounds):
                for mode in ("operator", "automatic"):
                    stack.call("start_rollout", CANDIDATE, PLAN, "bench")
                    wait_until(
                        lambda: stack.call("status").get("phase") == "paused",
                        120,
                        "paused",
                        every=POLL_S,
                    )
                    wait_until(
                        lambda: any(r.cohort == "canary" for r in run.records[-20:]),
                        30,
                        "canary answering",
                        every=POLL_S,
                    )
                    if mode == "operator":
                        asked = run.now_s()
                        stack.call("command", "rollback", "bench")
                        done = wait_until(
                            lambda a=asked: stable_only_since(run.records, a),
                            60,
                            "stable only",
                            every=POLL_S,
                        )
                        operator_s.append(done - asked)
                    else:
                        canary = control.current_user_config(APP, "canary") or {}
                        control.update_deployment(
                            APP, "canary", user_config={**canary, "faults": {"error_rate": 1.0}}
                        )
                        seen = wait_until(
                            lambda: next((r.start_s for r in run.records if r.failover), None),
                            30,
                            "fault seen by a client",
                            every=POLL_S,
                        )

                        # Failover already answers every request from stable, so clients
                        # cannot see the moment: the controller's record of setting stable
                        # 100% (on the same clock) can.
                        def withdrawn() -> float | None:
                            events = stack.call("status").get("events") or []
                            return next(
                                (
                                    float(e["at"]) - (run.started_at or 0.0)
                                    for e in events
                                    if e["event"] == "weights" and e.get("canary_bp") == 0
                                ),
                                None,
                            )

                        done = wait_until(withdrawn, 90, "automatic rollback", every=POLL_S)
                        automatic_s.append(done - seen)
                        canary = control.current_user_config(APP, "canary") or {}
                        canary.pop("faults", None)
                        control.update_deployment(APP, "canary", user_config=canary)
                    try:
                        wait_until(
                            lambda: stack.call("status").get("finished"),
                            60,
                            "finished",
                            every=POLL_S,
                        )
                    except TimeoutError:
                        view = stack.call("status")
                        raise TimeoutError(
                            f"rollout not finished: {view.get('phase')} {view.get('reason')} "
                            f"events {view.get('events')} errors {view.get('errors')}"
                        ) from None
                    failed += sum(1 for r in run.records if not 200 <= r.status < 300)
                    total += len(run.records)
                    run.records.clear()
        finally:
            run.stop()
            control.close()
            stack.down()
    bound = PLAN["threshold"] * PLAN["interval_s"]
    op, auto = statistics.median(operator_s), statistics.median(automatic_s)
    print(f"{'measurement':<44} {'median s':>9} {'bound s':>8} {'ratio':>7}  rounds")
    print(f"{'rollback command -> 100% stable (clients)':<44} {op:>9.2f} {TICK_S:>8.2f} "
          f"{op / TICK_S:>6.1f}x  {[round(v, 2) for v in operator_s]}")  # fmt: skip
    print(f"{'canary fault -> automatic rollback':<44} {auto:>9.2f} {bound:>8.2f} "
          f"{auto / bound:>6.2f}x  {[round(v, 2) for v in automatic_s]}")  # fmt: skip
    print(f"client errors: {failed} of {total} requests (failover absorbs canary errors)")
    rows = [
        {"measurement": "rollback command -> 100% stable seen by clients", "value": round(op, 2),
         "baseline": TICK_S, "unit": "s (vs tick)", "ratio": round(op / TICK_S, 1),
         "goal": "a few ticks"},
        {"measurement": "canary fault -> automatic rollback (weights stable 100%)",
         "value": round(auto, 2), "baseline": bound, "unit": "s (vs threshold x interval)",
         "ratio": round(auto / bound, 2), "goal": "<= 2x"},
        {"measurement": "client errors during both", "value": failed, "baseline": total,
         "unit": "requests", "ratio": round(failed / max(total, 1), 4), "goal": "0"},
    ]  # fmt: skip
    print(json.dumps({"bench": "rollout", "rows": rows}))


if __name__ == "__main__":
    main()
