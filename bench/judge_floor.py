"""The least evidence any valid test needs to decide bench_judge's scenarios, from the same
recording and hypotheses: what no judge can beat, beside what the judges do.

For each scenario and each check that could decide it, the canary's true rate and the closest
rate its hypothesis allows, and the expected number of canary requests a sequential
probability ratio test that knows both rates in advance needs: Wald's approximation,
``ln(1/risk) / KL`` with KL the information one request carries. Every valid test needs at
least about that many; the sequential judge also pays for not knowing the alternative and for
sharing alpha over four checks.

- a regression's floor is the fastest check's, at alpha: any check that fails the canary
  rolls it back. The error check fails only when both its parts do (the canary's rate above
  ``error_rate_max_ratio`` x stable's and above the floor), so its floor is the slower part's;
- an A/A canary's floor is the slowest check's, at beta: a step passes only when every check
  shows the canary inside its bound. The error check passes when either part does, so its
  floor is the faster part's.

The checks, as the judge reads them: latency is the share of canary requests slower than a
limit against the 1% a p99 allows (the relative limit: 1.25x stable's p99 + 5 ms, stable's p99
taken over the whole recording; the ceiling: 1000 ms); errors are the canary's error rate
against the floor (0.5%) and against 2x stable's rate (each error is a trial: the canary's
with probability its share of the errors), and against the success rate's 2%. The first step
(5%) sets the share. Then the same in minutes of that step at each simulated rate.

    .venv/bin/python bench/judge_floor.py
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_judge import BASE_ERROR_RATE, DATA, HYPOTHESES, SCENARIOS, Scenario

from app.telemetry import LATENCY_BOUNDARIES_MS
from rollout.plan import DEFAULT_SUCCESS_RATE_MIN

ALPHA, BETA, TAIL = 0.01, 0.05, 0.01
FIRST_STEP = 0.05
RATES = (40.0, 200.0, 1000.0)


def kl(p: float, q: float) -> float:
    """Information per Bernoulli observation for telling rate ``p`` from ``q`` (nats)."""
    if p <= 0:
        return -math.log(1 - q)
    if p >= 1:
        return -math.log(q)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def sprt(
    rate: float, bound: float, risk: float, *, above: bool, trials_per_request: float = 1.0
) -> float:
    """Canary requests a test knowing ``rate`` needs to show it ``above`` ``bound`` (or
    below it) at ``risk``; inf where it is not."""
    if (rate <= bound) if above else (rate >= bound):
        return math.inf
    return math.log(1 / risk) / (kl(rate, bound) * trials_per_request)


@dataclass(frozen=True)
class Floor:
    requests: float
    check: str  # the check that sets it
    rate: float  # the canary's true rate for that check
    bound: float  # the closest rate its hypothesis allows
    # The same for a test that reads latencies from the router's buckets, as the judges do:
    # a request is certainly slower than a limit only above the first bound past it, and
    # possibly slower above the last bound below it.
    bucketed_requests: float = math.nan


def latency_limit(latencies: np.ndarray) -> float:
    p99 = float(np.quantile(latencies, 1 - TAIL))
    return max(HYPOTHESES["p99_max_ratio"] * p99, p99 + HYPOTHESES["p99_slack_ms"])


def floor_of(scenario: Scenario, latencies: np.ndarray, weight: float = FIRST_STEP) -> Floor:
    """The floor of one scenario (see the module docstring); ``latencies`` are stable's."""
    limit = latency_limit(latencies)
    bad = scenario.regression
    canary_latencies = latencies * scenario.latency_factor
    p = scenario.canary_error_rate
    k, floor = HYPOTHESES["error_rate_max_ratio"], HYPOTHESES["error_rate_floor"]
    # The error check's ratio part: errors are its trials, each the canary's with probability
    # its share of them; its bound is the share 2x stable's rate would give.
    errors_per_canary = p + BASE_ERROR_RATE * (1 - weight) / weight
    share = p * weight / (p * weight + BASE_ERROR_RATE * (1 - weight))
    share_bound = k * weight / (k * weight + 1 - weight)
    slower = float(np.mean(canary_latencies > limit))
    ceiling_slower = float(np.mean(canary_latencies > HYPOTHESES["p99_max_ms"]))
    # What the buckets let a test count: past the next bound up (to fail the canary) or the
    # next bound down (to pass it).
    bounds = np.array(LATENCY_BOUNDARIES_MS, dtype=float)
    edge = (
        bounds[np.searchsorted(bounds, limit)]
        if bad
        else bounds[np.searchsorted(bounds, limit, side="right") - 1]
    )
    bucketed_slower = float(np.mean(canary_latencies > edge))
    success_bound = 1 - DEFAULT_SUCCESS_RATE_MIN
    risk = ALPHA if bad else BETA
    ratio = sprt(share, share_bound, risk, above=bad, trials_per_request=errors_per_canary)
    parts = sorted(
        (
            Floor(sprt(p, floor, risk, above=bad), "error_rate_vs_stable (floor)", p, floor),
            Floor(ratio, "error_rate_vs_stable (ratio)", share, share_bound),
        ),
        key=lambda f: f.requests,
    )
    by_check = [
        Floor(sprt(p, success_bound, risk, above=bad), "success_rate", p, success_bound),
        Floor(sprt(ceiling_slower, TAIL, risk, above=bad), "p99_ceiling", ceiling_slower, TAIL),
        Floor(
            sprt(slower, TAIL, risk, above=bad),
            "p99_vs_stable",
            slower,
            TAIL,
            sprt(bucketed_slower, TAIL, risk, above=bad),
        ),
    ]
    by_check = [
        f if not math.isnan(f.bucketed_requests) else replace(f, bucketed_requests=f.requests)
        for f in (*by_check, parts[-1] if bad else parts[0])  # both parts fail; either passes
    ]
    pick = min if bad else max
    found = pick(by_check, key=lambda f: f.requests)
    return replace(found, bucketed_requests=pick(f.bucketed_requests for f in by_check))


def recorded_latencies(data: dict) -> np.ndarray:
    recording = next(r for r in data["recordings"] if float(r["rate"]) == 40.0)
    return np.concatenate(
        [np.array(c["canary"] + c["stable"], dtype=float) for c in recording["chunks"]]
    )


def floors(data: dict) -> dict[str, Floor]:
    latencies = recorded_latencies(data)
    return {name: floor_of(scenario, latencies) for name, scenario in SCENARIOS.items()}


def main() -> None:
    data = json.loads(DATA.read_text())
    latencies = recorded_latencies(data)
    p99 = float(np.quantile(latencies, 1 - TAIL))
    print(
        f"limit {latency_limit(latencies):.1f} ms (stable p99 {p99:.1f} ms over the recording); "
        f"risk {ALPHA} (roll back) / {BETA} (pass); first step {FIRST_STEP:.0%}"
    )
    print(f"{'scenario':<22}{'check':<32}{'canary':>9}{'allowed':>9}{'requests':>10}"
          f"{'bucketed':>10}   minutes at " + " / ".join(f"{r:g}" for r in RATES)
          + " req/s")  # fmt: skip
    rows = []
    for name, found in floors(data).items():
        minutes = [found.requests / (FIRST_STEP * r) / 60 for r in RATES]
        print(
            f"{name:<22}{found.check:<32}{found.rate:>9.2%}{found.bound:>9.2%}"
            f"{found.requests:>10.0f}{found.bucketed_requests:>10.0f}   "
            + " / ".join(f"{m:.1f}" for m in minutes)
        )
        decision = "pass every check" if name == "aa" else "roll back"
        rows.append(
            {
                "measurement": f"judge floor {name}: canary requests any valid test needs to "
                f"{decision} ({found.check})",
                "value": round(found.requests),
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
