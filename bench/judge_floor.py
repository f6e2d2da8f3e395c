"""The least evidence any valid test needs to decide bench_judge's scenarios, from the same
recording and hypotheses: what no judge can beat, beside what the judges do.

For each scenario, the canary's true rate and the closest rate its hypothesis allows (the
null a test must reject, or for A/A the bound it must show the canary inside of), and the
expected number of canary requests a sequential probability ratio test that knows both rates
in advance needs to decide one check alone: Wald's approximation, ``ln(1/risk) / KL`` with KL
the information one request carries. Every valid test needs at least about that many; the
sequential judge also pays for not knowing the alternative and for sharing alpha over four
checks. Then the same in minutes of the default plan's first step (5%) at each simulated rate.

- latency: the share of canary requests slower than the bench's limit (1.25x stable's p99 +
  5 ms, stable's p99 taken over the whole recording) against the 1% a p99 allows;
- errors: the canary's error rate against the 0.5% floor (the closest allowed rate: a rate at
  the floor meets the hypothesis whatever stable's rate, so no comparison with stable can
  reject it);
- A/A: showing a healthy canary's 0.2% within the 0.5% floor at beta = 0.05.

    .venv/bin/python bench/judge_floor.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_judge import BASE_ERROR_RATE, DATA, HYPOTHESES, SCENARIOS

ALPHA, BETA, TAIL = 0.01, 0.05, 0.01
FIRST_STEP = 0.05
RATES = (40.0, 200.0, 1000.0)


def kl(p: float, q: float) -> float:
    """Information per Bernoulli observation for telling rate ``p`` from ``q`` (nats)."""
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def main() -> None:
    data = json.loads(DATA.read_text())
    recording = next(r for r in data["recordings"] if float(r["rate"]) == 40.0)
    latencies = np.concatenate(
        [np.array(c["canary"] + c["stable"], dtype=float) for c in recording["chunks"]]
    )
    p99 = float(np.quantile(latencies, 1 - TAIL))
    limit = max(HYPOTHESES["p99_max_ratio"] * p99, p99 + HYPOTHESES["p99_slack_ms"])
    floor = HYPOTHESES["error_rate_floor"]
    cases: list[tuple[str, float, float, float]] = []  # name, true rate, closest allowed, risk
    for name, scenario in SCENARIOS.items():
        if name == "aa":
            cases.append(("aa (pass the error check)", BASE_ERROR_RATE, floor, BETA))
        elif scenario.latency_factor != 1.0:
            slower = float(np.mean(scenario.latency_factor * latencies > limit))
            cases.append((name, slower, TAIL, ALPHA))
        else:
            cases.append((name, scenario.canary_error_rate, floor, ALPHA))
    print(
        f"limit {limit:.1f} ms (stable p99 {p99:.1f} ms over the recording); risk {ALPHA} "
        f"(fail) / {BETA} (pass); first step {FIRST_STEP:.0%}"
    )
    print(f"{'scenario':<28}{'canary':>9}{'allowed':>9}{'requests':>10}   minutes at " +
          " / ".join(f"{r:g}" for r in RATES) + " req/s")  # fmt: skip
    rows = []
    for name, rate, allowed, risk in cases:
        requests = math.log(1 / risk) / kl(rate, allowed)
        minutes = [requests / (FIRST_STEP * r) / 60 for r in RATES]
        print(
            f"{name:<28}{rate:>9.2%}{allowed:>9.2%}{requests:>10.0f}   "
            + " / ".join(f"{m:.1f}" for m in minutes)
        )
        rows.append(
            {
                "measurement": f"judge floor {name}: canary requests any valid test needs",
                "value": round(requests),
                "baseline": None,
                "unit": f"requests (minutes at 5% of {'/'.join(f'{r:g}' for r in RATES)} req/s: "
                + "/".join(f"{m:.1f}" for m in minutes)
                + ")",
                "ratio": None,
                "goal": "",
            }
        )
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
