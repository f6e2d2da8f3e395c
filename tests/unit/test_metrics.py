"""The metrics reader: window increases, counter resets, quantiles, a real scrape of
Prometheus text written by prometheus_client."""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app import telemetry
from app.errors import MetricsUnavailable
from rollout.metrics import (
    LATENCY_SERIES,
    REQUESTS_SERIES,
    SCRAPED_SERIES,
    MetricsSnapshot,
    PromQLSource,
    RayScrapeSource,
    SnapshotWindows,
    parse_exposition,
    quantile_from_buckets,
    scrape_spacing_s,
    wanted_lines,
    window_increase,
    windows_for,
)
from rollout.sequential import slower_than

INF = math.inf


def test_quantile_interpolates_inside_the_bucket():
    # 100 observations: 50 in (0, 10], 40 in (10, 20], 10 in (20, 50]
    buckets = {10.0: 50, 20.0: 90, 50.0: 100, INF: 100}
    assert quantile_from_buckets(0.5, buckets) == pytest.approx(10.0)
    assert quantile_from_buckets(0.7, buckets) == pytest.approx(15.0)
    assert quantile_from_buckets(0.99, buckets) == pytest.approx(20 + 30 * 0.9)


def test_quantile_beyond_last_finite_bucket_and_empty():
    assert quantile_from_buckets(0.99, {10.0: 1, INF: 100}) == 10.0
    assert quantile_from_buckets(0.99, {10.0: 0, INF: 0}) is None
    assert quantile_from_buckets(0.99, {}) is None


def key(name, **labels):
    return (name, tuple(sorted(labels.items())))


def test_window_increase_handles_resets_new_and_vanished_series():
    a, b, c = key("x", replica="a"), key("x", replica="b"), key("x", replica="c")
    before = MetricsSnapshot(0, {a: 100, b: 50, c: 7})
    after = MetricsSnapshot(10, {a: 130, b: 4, key("x", replica="d"): 3})  # b restarted, c died
    inc = window_increase(before, after)
    assert inc[a] == 30
    assert inc[b] == 4  # reset: the new process counted 4 since it started
    assert inc[key("x", replica="d")] == 3
    assert c not in inc


class Exporter:
    """A real Prometheus endpoint with the router's metric names (as Ray exports them)."""

    def __init__(
        self,
        buckets: tuple[float, ...] = telemetry.LATENCY_BOUNDARIES_MS,
        replica: str = "r1",
    ) -> None:
        self.bounds, self.replica = buckets, replica
        self.reset()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = generate_latest(exporter.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reset(self) -> None:
        """A restarted router replica: every series starts again at zero."""
        self.registry = CollectorRegistry()
        labels = ["application", "deployment", "replica", "cohort", "outcome"]
        self.requests = Counter(
            "ray_" + telemetry.ROUTER_REQUESTS, "", labels, registry=self.registry
        )
        self.latency = Histogram(
            "ray_" + telemetry.ROUTER_LATENCY_MS,
            "",
            labels,
            buckets=self.bounds,
            registry=self.registry,
        )

    def serve(self, cohort: str, latency_ms: float, n: int, outcome: str = "ok") -> None:
        labels = ("ranker", "router", self.replica, cohort, outcome)
        self.requests.labels(*labels).inc(n)
        for _ in range(n):
            self.latency.labels(*labels).observe(latency_ms)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def exporter():
    e = Exporter()
    yield e
    e.close()


def test_scrape_source_reports_per_cohort_windows(exporter):
    clock = iter(range(0, 1000, 10))
    windows = SnapshotWindows(
        RayScrapeSource(lambda: [exporter.url], application="ranker", clock=lambda: next(clock))
    )
    exporter.serve("stable", 12, 500)  # before the first window: not counted
    windows.observe()  # t=0
    assert windows.window_between(0, 0) is None  # one snapshot is no window yet

    exporter.serve("stable", 12, 190)
    exporter.serve("canary", 40, 95)
    exporter.serve("canary", 40, 5, outcome="error")
    windows.observe()  # t=10
    w = windows.window_between(0, 10)
    assert (w.start, w.end) == (0, 10)
    assert w.stable.requests == 190 and w.stable.error_count == 0
    assert w.canary.requests == 100 and w.canary.errors == {"error": 5}
    assert 10 < w.stable.p99_ms <= 15  # 12 ms lies in the (10, 15] bucket
    assert 30 < w.canary.p99_ms <= 40

    # The router restarts: counters begin again at zero; the window still counts right.
    exporter.reset()
    exporter.serve("canary", 40, 7)
    windows.observe()  # t=20
    w = windows.window_between(10, 20)
    assert w.canary.requests == 7
    assert w.stable is None  # no stable series moved... and none exists after the reset


def test_routers_with_different_bucket_bounds_are_read_at_the_bounds_they_share():
    # A rolling upgrade: the old router has no 250 ms bound, the new one has. Summed bound by
    # bound, 250 would hold only the new router's requests: the old one's would read as
    # certainly slower than 250 ms, although every request here took 245 ms.
    old_bounds = tuple(b for b in telemetry.LATENCY_BOUNDARIES_MS if b != 250)
    old, new = Exporter(old_bounds, replica="old"), Exporter(replica="new")
    try:
        clock = iter(range(0, 1000, 10))
        windows = SnapshotWindows(
            RayScrapeSource(
                lambda: [old.url, new.url], application="ranker", clock=lambda: next(clock)
            )
        )
        windows.observe()
        old.serve("canary", 245, 60)
        new.serve("canary", 245, 40)
        new.serve("stable", 245, 10)  # only the new router serves stable: all its bounds
        windows.observe()
        w = windows.window_between(0, 10)
        canary = w.canary.latency_buckets
        assert 250 not in canary and canary[275] == 100 and canary[240] == 0
        assert slower_than(canary, 250) == (0, 100)  # possibly slower, never certainly
        assert w.stable.latency_buckets[250] == 10
    finally:
        old.close()
        new.close()


def test_a_window_starts_at_the_first_snapshot_taken_at_or_after_its_start(exporter):
    clock = iter(range(0, 1000, 10))
    windows = SnapshotWindows(
        RayScrapeSource(lambda: [exporter.url], application="ranker", clock=lambda: next(clock))
    )
    for n in (10, 20, 30):  # snapshots at t=0, 10, 20; n requests served after each
        windows.observe()
        exporter.serve("canary", 5, n)
    windows.observe()  # t=30
    w = windows.window_between(5, 30)  # from the snapshot at t=10 to the one at t=30
    assert (w.start, w.end) == (10, 30) and w.canary.requests == 20 + 30
    assert windows.window_between(25, 40) is None  # one snapshot inside: no window


def test_ticks_faster_than_the_export_scrape_once_per_export(exporter):
    # The controller ticks every 0.5 s; Ray exports every 1 s. A scrape per tick would read
    # every export twice (each scrape costs the agent its whole export): one per export.
    now = [0.0]
    scrapes = []

    def clock() -> float:
        return now[0]

    def endpoints() -> list[str]:
        scrapes.append(now[0])
        return [exporter.url]

    source = RayScrapeSource(endpoints, application="ranker", clock=clock)
    windows = SnapshotWindows(source, min_interval_s=scrape_spacing_s(1.0), clock=clock)
    for tick in range(9):  # t = 0, 0.5, ... 4.0
        now[0] = tick * 0.5 + (0.02 if tick % 2 else -0.02) * (tick > 0)  # ticks jitter
        windows.observe()
        exporter.serve("canary", 5, 10)
    assert scrapes == [0.0, 0.98, 1.98, 2.98, 3.98]
    w = windows.window_between(0.5, 4.0)  # snapshots at 0.98 and 3.98: three exports apart
    assert w is not None and (w.start, w.end) == (0.98, 3.98)
    assert w.canary.requests == 60  # served after the ticks at 0.98 ... 3.48

    # Where the interval is unknown, every tick scrapes.
    every = SnapshotWindows(RayScrapeSource(endpoints, application="ranker", clock=clock))
    scrapes.clear()
    for tick in range(3):
        now[0] = 10 + tick * 0.5
        every.observe()
    assert scrapes == [10.0, 10.5, 11.0]
    assert scrape_spacing_s(None) == 0.0
    # The controller's windows get the spacing from Ray's interval.
    scraped = windows_for(application="ranker", endpoints=(exporter.url,), export_interval_s=10)
    assert isinstance(scraped, SnapshotWindows) and scraped.min_interval_s == 9.0


def test_scrape_source_with_every_endpoint_down_is_unavailable_not_empty():
    source = RayScrapeSource(lambda: ["http://127.0.0.1:9/metrics"], timeout_s=0.5)
    with pytest.raises(MetricsUnavailable):
        source.snapshot()
    with pytest.raises(MetricsUnavailable):
        SnapshotWindows(source).observe()


def test_series_of_other_applications_are_ignored(exporter):
    clock = iter(range(0, 1000, 10))
    windows = SnapshotWindows(
        RayScrapeSource(lambda: [exporter.url], application="other", clock=lambda: next(clock))
    )
    windows.observe()
    exporter.serve("canary", 5, 10)
    windows.observe()
    w = windows.window_between(0, 10)
    assert w.canary is None
    assert REQUESTS_SERIES.endswith("_total")


def test_the_controller_uses_promql_when_a_server_is_named_else_scrapes():
    assert isinstance(
        windows_for(application="ranker", prometheus_url="http://p:9090"), PromQLSource
    )
    scraped = windows_for(application="ranker", endpoints=("http://127.0.0.1:9/metrics",))
    assert isinstance(scraped, SnapshotWindows)
    assert scraped.source.application == "ranker"


def test_only_the_wanted_lines_are_parsed_and_they_give_the_full_texts_samples():
    """A node's export is mostly other metrics (Ray's own, every worker's): the parse sees the
    wanted samples' lines and their families' comments, and gets exactly what parsing the
    whole text and keeping the wanted samples gets."""
    registry = CollectorRegistry()
    requests = Counter(REQUESTS_SERIES.removesuffix("_total"), "r", ["cohort", "outcome"],
                       registry=registry)  # fmt: skip
    latency = Histogram(LATENCY_SERIES, "l", ["cohort"], buckets=(5, 50), registry=registry)
    # Names that share a prefix with the wanted ones, and label values with braces and spaces.
    near = Counter(REQUESTS_SERIES.removesuffix("_total") + "_other", "n", ["x"],
                   registry=registry)  # fmt: skip
    other = Histogram("ray_component_rpc_latency_ms", "o", ["WorkerId"], registry=registry)
    requests.labels("canary", 'ok {"a b"}').inc(3)
    requests.labels("stable", "error").inc(2)
    latency.labels("canary").observe(7)
    near.labels("y").inc(9)
    for worker in range(200):
        other.labels(f"{worker:040d}").observe(worker)
    text = generate_latest(registry).decode()

    kept = wanted_lines(text, SCRAPED_SERIES)
    names = {line.partition("{")[0].partition(" ")[0] for line in kept.splitlines()}
    assert names - {"#"} == {REQUESTS_SERIES, LATENCY_SERIES + "_bucket"}
    assert len(kept.splitlines()) < len(text.splitlines()) / 20
    everything = {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in SCRAPED_SERIES
    }
    parsed = parse_exposition(text, SCRAPED_SERIES)
    assert parsed == everything and len(parsed) == 2 + 3  # two counters, three buckets
