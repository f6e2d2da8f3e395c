"""The PromQL metrics source against a real Prometheus server, compared with the direct scrape.

A throwaway Prometheus (tests/prometheus.py) scrapes the session cluster through Ray's own
service-discovery file while the router carries steady load with a canary weight > 0 and a
canary that fails a fraction of its rank calls (the router fails those over to stable, so the
clients see no error, but the canary's ``outcome="error"`` series moves). Over one window
[t0, t1] the direct scrape (two ``RayScrapeSource`` snapshots through ``SnapshotWindows``) and
``PromQLSource.window_between(t0, t1)`` must agree: requests and errors per cohort within the
tolerance below, p99 per cohort inside the histogram bucket that holds the direct p99 (or a
neighbour, when the window's tail is so thin that the edge tolerance reaches it: p99_range).

Why there is a tolerance at all (the two sources read the same counters): the router flushes
its counts and Ray exports them once per ``metrics_report_interval_ms`` (1 s here), so the
endpoint's value moves in steps of about one interval's traffic. The direct source reads the
step in force at t0 and at t1; Prometheus samples every ``SCRAPE_INTERVAL_S`` and ``increase()``
extrapolates linearly from the first/last sample inside the range to its edges. Each edge can
therefore be off by up to ``EDGE_STEPS`` export steps of that series, plus rounding. The
direct source snapshots once per export step around and through the window, so each edge's
steps are measured (``edge_allowance``) rather than assumed from the window's average rate:
diverted requests and slow ones come in bursts. Exact equality of error counts is not to be
had under steady load for the same reason; the set of error outcomes per cohort must be equal
(a starved machine may add stable timeouts: counted alike).
The test prints its numbers (and how Prometheus' scrapes went) on every run.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

from app import telemetry
from app.polling import wait_until
from rollout.analysis import CohortStats, WindowStats
from rollout.metrics import (
    REQUESTS_SERIES,
    CohortCounts,
    MetricsSnapshot,
    PromQLSource,
    RayScrapeSource,
    SnapshotWindows,
    cohort_window,
    quantile_from_buckets,
    window_increase,
)
from tests.e2e.harness import APP, Cluster, client_load
from tests.prometheus import PrometheusServer, running_server

pytestmark = pytest.mark.e2e

CANARY_BP = 3000  # 30% of keyed traffic to the canary
CANARY_ERROR_RATE = 0.15  # fraction of canary rank calls that fail (then fail over to stable)
# 10 s at LOAD_RATE: about 400 answers, some 120 of them the canary's (30%) with about 18
# injected errors; the assertions need 50 requests per cohort and an error outcome on each
# side. The edge allowances do not grow with the window, so a longer one only costs time.
WINDOW_S = 10.0
LOAD_RATE = 40.0  # requests/s, open loop
EXPORT_INTERVAL_S = 1.0  # the session cluster's metrics_report_interval_ms (LocalCluster's)
# Prometheus scrapes every 2 s with a 2 s timeout (it may not exceed the interval). Late in a
# session the node's export holds the series of every replica the session started, and on a
# busy machine Ray's agent took over a second to render it: at 1 s, 19 of a window's 22
# scrapes timed out in one CI run and increase() had 3 samples to go on.
SCRAPE_INTERVAL_S = 2.0
# Export steps at each edge that Prometheus' first or last sample in the range may be off by.
EDGE_STEPS = math.ceil(SCRAPE_INTERVAL_S / EXPORT_INTERVAL_S)
# Half a count of rounding per source.
ROUNDING = 1


def session_sd_file() -> Path:
    """This cluster's service-discovery file.

    Ray 2.60 writes it into the session directory and keeps the legacy path
    /tmp/ray/prom_metrics_service_discovery.json as a symlink to it, which every cluster on the
    machine re-points at its own file every 5 s (PrometheusServiceDiscoveryWriter.write): on a
    shared machine the legacy path names whichever cluster wrote last. The session file is
    Ray's own discovery for exactly this cluster."""
    node = ray._private.worker._global_node
    assert node is not None, "not connected to a Ray cluster"
    return Path(node.get_session_dir_path()) / PROMETHEUS_SERVICE_DISCOVERY_FILE


def our_metrics_target(cluster: Cluster) -> str:
    """host:port of this cluster's node metrics endpoint, as Ray's discovery file names it."""
    port = int(httpx.URL(cluster.metrics_url).port or 0)
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort") == port]
    assert len(nodes) == 1, f"no alive node of this cluster exports metrics on port {port}"
    return f"{nodes[0]['NodeManagerAddress']}:{port}"


def sd_targets(sd_file: Path) -> list[str]:
    groups = json.loads(sd_file.read_text())
    return [target for group in groups for target in group["targets"]]


def prom_scalar(source: PromQLSource, promql: str) -> float:
    rows = source.query(promql, time.time())
    return max((float(row["value"][1]) for row in rows), default=0.0)


def target_up(server: PrometheusServer, target: str) -> bool:
    for t in server.targets():
        if t["labels"].get("instance") == target:
            assert t["health"] != "down", f"scraping {target} fails: {t.get('lastError')}"
            return t["health"] == "up"
    return False


def scrape_health(source: PromQLSource, target: str, t0: float, t1: float) -> dict[str, float]:
    """How Prometheus' scrapes of ``target`` went in [t0, t1] (for the report: failed or slow
    scrapes leave gaps that increase() bridges by extrapolation)."""
    span = f"{round((t1 - t0) * 1000)}ms"
    up = f'up{{instance="{target}"}}'
    duration = f'scrape_duration_seconds{{instance="{target}"}}'

    def one(promql: str) -> float:
        rows = source.query(promql, t1)
        return round(float(rows[0]["value"][1]), 3) if rows else math.nan

    return {
        "scrapes": one(f"count_over_time({up}[{span}])"),
        "up": one(f"sum_over_time({up}[{span}])"),
        "max_duration_s": one(f"max_over_time({duration}[{span}])"),
    }


def bucket_holding(value: float) -> tuple[float, float]:
    """(lower, upper] of the latency histogram bucket that holds ``value``."""
    lower = 0.0
    for upper in (*telemetry.LATENCY_BOUNDARIES_MS, math.inf):
        if value <= upper:
            return lower, upper
        lower = upper
    raise AssertionError(f"no bucket holds {value}")


class RecordingScrape(RayScrapeSource):
    """The direct source, keeping the snapshots it hands to ``SnapshotWindows`` so the test can
    read the window's bucket counts (``SnapshotWindows`` keeps only quantiles in its output)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taken: list[MetricsSnapshot] = []

    def snapshot(self) -> MetricsSnapshot:
        snap = super().snapshot()
        self.taken.append(snap)
        return snap


def p99_range(
    buckets: dict[float, float], tail_slack: float, total_slack: float
) -> tuple[float, float]:
    """Where PromQL's p99 may fall, given the direct window's cumulative bucket counts.

    The p99 is fixed by the ~1% of observations above it. The sources may count that tail
    differently by ``tail_slack`` (the tail's edge allowance) and the total by
    ``total_slack``, of which 1% moves the rank; so the direct quantiles at the ranks that far
    from the top bound it; the range is from the lower edge of the bucket holding the lower one
    to the upper edge of the bucket holding the upper one. With a thick tail this is the single
    bucket that holds the direct p99; with a thin one (a few slow requests at an edge move the
    p99 a bucket) a neighbour is allowed too."""
    total = max(buckets.values())
    tail = 0.01 * total
    slack = tail_slack + 0.01 * total_slack
    q_low = 1 - (tail + slack) / total
    q_high = 1 - max(tail - slack, 0.0) / total
    low = quantile_from_buckets(max(q_low, 0.0), buckets)
    high = quantile_from_buckets(min(q_high, 1.0), buckets)
    assert low is not None and high is not None, buckets
    return bucket_holding(low)[0], bucket_holding(high)[1]


def observed(counts: CohortCounts) -> float:
    """Observations in the latency histogram (its +Inf bucket, the largest cumulative one)."""
    return max(counts.buckets.values(), default=0.0)


def edge_allowance(
    taken: list[MetricsSnapshot],
    first: int,
    last: int,
    cohort: str,
    measure: Callable[[CohortCounts], float],
) -> float:
    """How far the two sources may disagree on ``measure`` of ``cohort`` over the window
    between snapshots ``first`` and ``last``: at each edge, what the series moved in the
    ``EDGE_STEPS`` export steps before or after it (the larger), plus rounding. Measured, not
    assumed from the window's average rate: the router's breaker diverts in bursts, and slow
    requests come together, so one step at an edge can hold several times its share."""

    def step(a: int, b: int) -> float:
        increases = window_increase(taken[a], taken[b])
        return measure(cohort_window(increases, application=APP)[cohort])

    allowance = ROUNDING
    for edge in (first, last):
        allowance += max(step(edge - EDGE_STEPS, edge), step(edge, edge + EDGE_STEPS))
    return allowance


def describe(stats: WindowStats) -> dict[str, Any]:
    def one(c: CohortStats | None) -> Any:
        if c is None:
            return None
        return {"requests": c.requests, "errors": c.errors, "p50": c.p50_ms, "p99": c.p99_ms}

    return {"stable": one(stats.stable), "canary": one(stats.canary)}


def test_promql_source_agrees_with_the_direct_scrape(
    serving: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = serving
    sd_file = session_sd_file()
    target = our_metrics_target(cluster)
    # Ray rewrites the file every 5 s; by now (app RUNNING) it exists and lists this node.
    wait_until(
        lambda: target in sd_targets(sd_file), 30, f"{target} in {sd_file}", retry_on=(Exception,)
    )

    scrape = RecordingScrape(lambda: [cluster.metrics_url], application=APP)
    direct = SnapshotWindows(scrape)
    with running_server(sd_file, scrape_interval_s=SCRAPE_INTERVAL_S) as server:
        promql = PromQLSource(server.url, application=APP)
        try:
            # The discovery manager hands new targets to the scraper at most every 5 s.
            wait_until(
                lambda: target_up(server, target),
                60,
                f"Prometheus scraping {target}",
                retry_on=(Exception,),
            )
            cluster.set_router(canary_bp=CANARY_BP)
            cluster.set_faults("canary", {"error_rate": CANARY_ERROR_RATE})
            # Open loop at a steady rate the 2 cores carry with room to spare: a closed loop
            # drives them to saturation, where the router's flushes and Ray's exports lose
            # their one-second rhythm and the edges of a window move by more than a step.
            with client_load(cluster.http_url, rate=LOAD_RATE) as load:
                # Every series of the window (canary errors included) must exist in Prometheus
                # for a few scrapes before t0: increase() over a series born inside the range
                # misses its first value, which the direct source would count.
                errors_series = (
                    f'{REQUESTS_SERIES}{{application="{APP}",cohort="canary",outcome="error"}}'
                )
                held = round(4 * SCRAPE_INTERVAL_S + 1)  # four scrapes' span, and a second
                wait_until(
                    lambda: prom_scalar(promql, f"count_over_time({errors_series}[{held}s])") >= 4,
                    60,
                    "canary error series in four of Prometheus' scrapes",
                    retry_on=(Exception,),
                )
                # One direct snapshot per export step, from EDGE_STEPS before t0 to EDGE_STEPS
                # after t1: the steps around each edge measure how much the two sources'
                # edges may differ (edge_allowance).
                direct.observe()
                for _ in range(EDGE_STEPS):
                    time.sleep(EXPORT_INTERVAL_S)
                    direct.observe()
                first = len(scrape.taken) - 1  # the snapshot at t0
                answers_at_t0 = len(load.records)
                opened = time.time()
                while time.time() - opened < WINDOW_S:
                    time.sleep(EXPORT_INTERVAL_S)  # the pace of the snapshots, not a wait
                    direct.observe()
                last = len(scrape.taken) - 1  # the snapshot at t1
                answers_in_window = len(load.records) - answers_at_t0
                for _ in range(EDGE_STEPS):
                    time.sleep(EXPORT_INTERVAL_S)
                    direct.observe()
                non_2xx = sum(1 for a in load.records[answers_at_t0:] if not 200 <= a.status < 300)
                t0, t1 = scrape.taken[first].taken_at, scrape.taken[last].taken_at
                window = direct.window_between(t0, t1)
                assert window is not None, "direct scrape: no window between the two snapshots"
                # Query only after Prometheus holds a sample newer than t1: every sample of
                # the range is then stored.
                wait_until(
                    lambda: prom_scalar(promql, f"max(timestamp({errors_series}))") > t1 + 1,
                    30,
                    "a Prometheus sample after t1",
                    retry_on=(Exception,),
                )
            # No assert_all_ok(load.records): zero failed requests is test_serving's subject; here
            # any outcome only has to be counted alike by both sources.
            from_prom = promql.window_between(t0, t1)
            scrapes = scrape_health(promql, target, t0, t1)
            # The selector really selects: another application's window is empty.
            other_app = PromQLSource(server.url, application=f"not-{APP}").window_between(t0, t1)
        finally:
            cluster.set_faults("canary", None)
            cluster.set_router(canary_bp=0)
            promql.close()
            direct.close()

    report = {
        "window_s": round(t1 - t0, 3),
        "answers_seen_by_clients": answers_in_window,
        "client_non_2xx": non_2xx,
        "direct": describe(window),
        "promql": describe(from_prom),
        "prometheus_scrapes": scrapes,
    }
    with capsys.disabled():
        print(f"\nPromQL vs direct scrape: {json.dumps(report)}")

    assert other_app.stable is None and other_app.canary is None, describe(other_app)
    for cohort in ("stable", "canary"):
        d: CohortStats | None = getattr(window, cohort)
        p: CohortStats | None = getattr(from_prom, cohort)
        assert d is not None and d.requests >= 50, f"direct {cohort}: too little traffic: {d}"
        assert p is not None, f"PromQL found no {cohort} series in Prometheus: {report}"
        edge = functools.partial(edge_allowance, scrape.taken, first, last, cohort)
        allowed = edge(lambda c: sum(c.outcomes.values()))
        assert abs(p.requests - d.requests) <= allowed, (
            f"{cohort} requests: PromQL {p.requests} vs direct {d.requests} "
            f"(allowed +/- {allowed:.1f}): {report}"
        )
        assert set(p.errors) == set(d.errors), f"{cohort} error outcomes differ: {report}"
        for outcome, n in d.errors.items():
            allowed = edge(lambda c, o=outcome: c.outcomes.get(o, 0.0))
            assert abs(p.errors[outcome] - n) <= allowed, (
                f"{cohort} {outcome}: PromQL {p.errors[outcome]} vs direct {n} "
                f"(allowed +/- {allowed:.1f}): {report}"
            )
        assert d.p99_ms is not None and p.p99_ms is not None, report
        buckets = cohort_window(
            window_increase(scrape.taken[first], scrape.taken[last]), application=APP
        )[cohort].buckets
        # The tail: observations above the lower edge of the bucket holding the direct p99.
        floor = bucket_holding(d.p99_ms)[0]
        tail_slack = edge(lambda c, f=floor: observed(c) - c.buckets.get(f, 0.0))
        total_slack = edge(observed)
        lower, upper = p99_range(buckets, tail_slack, total_slack)
        assert lower <= p.p99_ms <= upper, (
            f"{cohort} p99: PromQL {p.p99_ms:.1f} ms outside [{lower}, {upper}], the buckets "
            f"that hold the direct p99 {d.p99_ms:.1f} ms and its neighbours within the edge "
            f"allowance: {report}"
        )
    # Errors are counted where they happen (the canary); their failovers answer as stable ok.
    assert window.canary is not None and window.canary.errors.get("error", 0) > 0, report
