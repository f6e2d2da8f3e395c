"""Per-cohort window statistics from Ray's metrics, for the judge.

Two sources give the same output (``analysis.WindowStats``):

- ``RayScrapeSource`` scrapes every node's Prometheus endpoint (nodes discovered through Ray,
  or given explicitly); ``SnapshotWindows`` keeps its snapshots, one per controller tick, and
  a window is the difference of two of them. Counter resets (a replica restarted: its series
  starts again at 0) count the new value as the increase; series of dead replicas stop moving
  and add nothing.
- ``PromQLSource`` asks a Prometheus server that scrapes the cluster (``increase`` and
  bucket sums over the window), for clusters that run one.

The router exports, per answering cohort (app/telemetry.py): a request counter by outcome and an
end-to-end latency histogram. Quantiles are interpolated from bucket counts the way
Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app import telemetry
from app.contracts import COHORTS
from app.divergence import DivergenceSums
from app.errors import MetricsUnavailable
from rollout.analysis import CohortStats, ShadowStats, WindowStats, quantile_from_buckets

REQUESTS_SERIES = telemetry.exported_name(telemetry.ROUTER_REQUESTS, kind="counter")
LATENCY_SERIES = telemetry.exported_name(telemetry.ROUTER_LATENCY_MS, kind="histogram")
OK_OUTCOME = "ok"
# Shadow traffic (the router's comparisons of mirrored copies).
SHADOW_REQUESTS_SERIES = telemetry.exported_name(telemetry.ROUTER_SHADOW_REQUESTS, kind="counter")
SHADOW_RBO_SERIES = telemetry.exported_name(telemetry.ROUTER_SHADOW_RBO, kind="histogram")
SHADOW_OVERLAP_SERIES = telemetry.exported_name(telemetry.ROUTER_SHADOW_OVERLAP, kind="histogram")
SHADOW_SCORE_DIFF_SERIES = telemetry.exported_name(
    telemetry.ROUTER_SHADOW_SCORE_DIFF, kind="histogram"
)
SHADOW_TOP1_SERIES = telemetry.exported_name(telemetry.ROUTER_SHADOW_TOP1_CHANGED, kind="counter")
SCRAPED_SERIES = (
    REQUESTS_SERIES,
    LATENCY_SERIES + "_bucket",
    SHADOW_REQUESTS_SERIES,
    SHADOW_RBO_SERIES + "_sum",
    SHADOW_RBO_SERIES + "_count",
    SHADOW_OVERLAP_SERIES + "_sum",
    SHADOW_SCORE_DIFF_SERIES + "_bucket",
    SHADOW_TOP1_SERIES,
)

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class MetricsSnapshot:
    taken_at: float
    values: Mapping[SeriesKey, float]


BucketSource = tuple[tuple[str, str], ...]


@dataclass
class CohortCounts:
    """Increases over one window for one cohort. Latency buckets are kept per source (a
    router replica's label set, ``le`` aside) until they are read, because sources need not
    export the same bounds: during a rolling upgrade that changes them, a bound that one
    router lacks would otherwise read as a cumulative count short of that router's requests,
    that is, as requests slower than the bound (what the judge counts against a canary)."""

    outcomes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sources: dict[BucketSource, dict[float, float]] = field(default_factory=dict)

    def add_bucket(self, source: BucketSource, le: float, value: float) -> None:
        counts = self.sources.setdefault(source, {})
        counts[le] = counts.get(le, 0.0) + value

    @property
    def buckets(self) -> dict[float, float]:
        """The cumulative histogram summed over sources, at the bounds every source that
        observed something in the window exports (+Inf is one of them): each count then
        holds every source's requests at or below its bound."""
        observed = [c for c in self.sources.values() if c.get(math.inf, 0.0) > 0]
        contributing = observed or list(self.sources.values())
        if not contributing:
            return {}
        common = set.intersection(*(set(c) for c in contributing))
        return {le: sum(c[le] for c in contributing) for le in sorted(common)}

    def to_stats(self) -> CohortStats:
        buckets = self.buckets
        requests = round(sum(self.outcomes.values()))
        errors = {
            outcome: round(n) for outcome, n in self.outcomes.items() if outcome != OK_OUTCOME
        }
        return CohortStats(
            requests=requests,
            errors={k: v for k, v in errors.items() if v},
            p50_ms=quantile_from_buckets(0.5, buckets),
            p99_ms=quantile_from_buckets(0.99, buckets),
            latency_buckets=buckets,
        )


@dataclass
class ShadowCounts(DivergenceSums):
    """Increases over one window of one canary artifact's comparisons."""

    compared: float = 0.0
    rbo_sum: float = 0.0
    overlap_sum: float = 0.0
    top1_changed: float = 0.0
    score_diff_buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))

    def to_stats(self) -> ShadowStats:
        compared, rbo_sum, overlap_sum, top1_changed = self.clamped()
        return ShadowStats(
            compared=compared,
            rbo_sum=rbo_sum,
            overlap_sum=overlap_sum,
            top1_changed=top1_changed,
            max_score_diff_p99=quantile_from_buckets(0.99, self.score_diff_buckets),
        )


@dataclass
class ShadowWindow:
    by_artifact: dict[str, ShadowCounts] = field(default_factory=lambda: defaultdict(ShadowCounts))
    outcomes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, name: str, labels: Mapping[str, str], value: float) -> bool:
        """Count one series' increase if it is a shadow series; False if it is not."""
        if name == SHADOW_REQUESTS_SERIES:
            self.outcomes[labels.get(telemetry.OUTCOME, "")] += value
            return True
        artifact = labels.get(telemetry.ARTIFACT)
        if artifact is None:
            return False
        counts = self.by_artifact[artifact]
        if name == SHADOW_RBO_SERIES + "_count":
            counts.compared += value
        elif name == SHADOW_RBO_SERIES + "_sum":
            counts.rbo_sum += value
        elif name == SHADOW_OVERLAP_SERIES + "_sum":
            counts.overlap_sum += value
        elif name == SHADOW_TOP1_SERIES:
            counts.top1_changed += value
        elif name == SHADOW_SCORE_DIFF_SERIES + "_bucket":
            counts.score_diff_buckets[float(labels["le"])] += value
        else:
            return False
        return True


# A histogram's or counter's samples carry these after the family's name.
_SAMPLE_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def wanted_lines(text: str, names: Iterable[str]) -> str:
    """The lines of Prometheus text that can hold a sample named in ``names``: those samples
    and their families' ``# HELP``/``# TYPE`` lines, in order.

    A node's export carries every Ray worker's metrics (and, for a while, a dead process's:
    the e2e tests see a killed controller's series linger), so it grows with the cluster. The
    text parser costs about 30 microseconds a line (a synthetic 18,000-line export, 300
    histogram families of 10 workers, took 0.6 s to parse on a 2-core machine; filtered first,
    0.008 s), so only the few hundred lines the windows need are parsed: a sample line is kept
    by its name (what comes before ``{`` or the space), never by a guess, so the samples parsed
    are exactly the full text's."""
    wanted = set(names)
    families = wanted | {
        name[: -len(suffix)]
        for name in wanted
        for suffix in _SAMPLE_SUFFIXES
        if name.endswith(suffix)
    }
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in families:
                kept.append(line)
        elif line.partition("{")[0].partition(" ")[0] in wanted:
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_exposition(text: str, wanted: Iterable[str]) -> dict[SeriesKey, float]:
    """The samples named in ``wanted`` from Prometheus text, keyed by name + full label set."""
    names = set(wanted)
    out: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(wanted_lines(text, names)):
        for sample in family.samples:
            if sample.name in names:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def window_increase(previous: MetricsSnapshot, current: MetricsSnapshot) -> dict[SeriesKey, float]:
    """Per-series increase from ``previous`` to ``current``.

    A series whose value went down was reset (a new replica process): its whole current value
    is the increase. A series first seen in ``current`` started within the window (a new
    replica): likewise. A series that vanished (a dead node no longer scraped) adds nothing.
    """
    increases: dict[SeriesKey, float] = {}
    for key, value in current.values.items():
        before = previous.values.get(key)
        if before is None or value < before:
            increases[key] = value
        else:
            increases[key] = value - before
    return increases


def shadow_window(
    increases: Mapping[SeriesKey, float], *, application: str | None = None
) -> ShadowWindow:
    window = ShadowWindow()
    for (name, label_items), value in increases.items():
        labels = dict(label_items)
        if application is not None and labels.get("application", application) != application:
            continue
        window.add(name, labels, value)
    return window


def cohort_window(
    increases: Mapping[SeriesKey, float], *, application: str | None = None
) -> dict[str, CohortCounts]:
    by_cohort: dict[str, CohortCounts] = {c: CohortCounts() for c in COHORTS}
    for (name, label_items), value in increases.items():
        labels = dict(label_items)
        if application is not None and labels.get("application", application) != application:
            continue
        cohort = labels.get(telemetry.COHORT)
        if cohort not in by_cohort:
            continue
        counts = by_cohort[cohort]
        if name == REQUESTS_SERIES:
            counts.outcomes[labels.get(telemetry.OUTCOME, OK_OUTCOME)] += value
        elif name == LATENCY_SERIES + "_bucket":
            source = tuple((k, v) for k, v in label_items if k != "le")
            counts.add_bucket(source, float(labels["le"]), value)
    return by_cohort


def to_window(
    counts: Mapping[str, CohortCounts],
    start: float,
    end: float,
    shadow: ShadowWindow | None = None,
) -> WindowStats:
    def stats(cohort: str) -> CohortStats | None:
        c = counts.get(cohort)
        if c is None or not c.outcomes:
            return None
        return c.to_stats()

    shadow = shadow or ShadowWindow()
    return WindowStats(
        start=start,
        end=end,
        canary=stats("canary"),
        stable=stats("stable"),
        shadow={a: c.to_stats() for a, c in shadow.by_artifact.items() if c.compared > 0},
        shadow_outcomes={o: round(n) for o, n in shadow.outcomes.items() if round(n) > 0},
    )


def ray_metrics_endpoints() -> list[str]:
    """Every alive node's metrics endpoint, from Ray's node table (call inside Ray)."""
    import ray

    endpoints = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            endpoints.append(f"http://{node['NodeManagerAddress']}:{port}/metrics")
    return endpoints


class RayScrapeSource:
    """Scrapes Ray's per-node Prometheus endpoints directly."""

    def __init__(
        self,
        endpoints: Callable[[], Sequence[str]] = ray_metrics_endpoints,
        *,
        application: str | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 5.0,
    ) -> None:
        self._endpoints = endpoints
        self.application = application
        self._clock = clock
        self._client = httpx.Client(timeout=timeout_s)

    def snapshot(self) -> MetricsSnapshot:
        wanted = SCRAPED_SERIES
        values: dict[SeriesKey, float] = {}
        errors = []
        endpoints = list(self._endpoints())
        for url in endpoints:
            try:
                response = self._client.get(url)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                errors.append(f"{url}: {exc}")
                continue
            for (name, labels), value in parse_exposition(response.text, wanted).items():
                # One node's series are told apart from another's by the endpoint.
                values[(name, (*labels, ("_endpoint", url)))] = value
        if endpoints and len(errors) == len(endpoints):
            raise MetricsUnavailable("; ".join(errors))
        return MetricsSnapshot(self._clock(), values)

    def close(self) -> None:
        self._client.close()


# A snapshot at most this share of an export interval after the last one: a tick that comes a
# little early still scrapes once per export, not once per two.
SCRAPE_SPACING_FACTOR = 0.9


def scrape_spacing_s(export_interval_s: float | None) -> float:
    """The least time between two scrapes of Ray's endpoints: its values change once per
    metrics export, so a scrape per tick at a shorter tick repeats them, and each scrape costs
    the node's agent its whole export (measured on the 2-core test machine, one node with two
    small apps: 1.1-1.4 MB of text, about 140 ms of wall time and 70 ms of the agent's CPU a
    scrape; at a 0.5 s tick, 0.14 of a core). 0 where the interval is unknown: every tick."""
    return 0.0 if not export_interval_s else SCRAPE_SPACING_FACTOR * export_interval_s


class SnapshotWindows:
    """Windows between arbitrary times from a scrape source: the controller offers a snapshot
    every tick (``observe``; taken unless the last one is younger than ``min_interval_s``)
    and asks for the increase between the first snapshot taken at or after ``start`` and the
    latest one."""

    def __init__(
        self,
        source: RayScrapeSource,
        *,
        keep: int = 4096,
        min_interval_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self._snapshots: list[MetricsSnapshot] = []
        self._keep = keep
        self.min_interval_s = min_interval_s
        self._clock = clock

    def observe(self) -> None:
        if (
            self.min_interval_s > 0
            and self._snapshots
            and self._clock() - self._snapshots[-1].taken_at < self.min_interval_s
        ):
            return  # nothing new on the endpoints since the last scrape
        self._snapshots.append(self.source.snapshot())
        del self._snapshots[: -self._keep]

    def window_between(self, start: float, end: float) -> WindowStats | None:
        first = next((s for s in self._snapshots if s.taken_at >= start), None)
        last = next((s for s in reversed(self._snapshots) if s.taken_at <= end), None)
        if first is None or last is None or last.taken_at <= first.taken_at:
            return None
        increases = window_increase(first, last)
        application = self.source.application
        counts = cohort_window(increases, application=application)
        shadow = shadow_window(increases, application=application)
        return to_window(counts, first.taken_at, last.taken_at, shadow)

    def close(self) -> None:
        self.source.close()


class PromQLSource:
    """Asks a Prometheus server for the same window stats."""

    def __init__(
        self,
        base_url: str,
        *,
        application: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._application = application
        self._client = httpx.Client(timeout=timeout_s)

    def _selector(self) -> str:
        return f'{{application="{self._application}"}}' if self._application else ""

    def query(self, promql: str, at: float) -> list[dict]:
        try:
            response = self._client.get(
                f"{self._base}/api/v1/query", params={"query": promql, "time": at}
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"{self._base}: {exc}") from exc
        body = response.json()
        if body.get("status") != "success":
            raise MetricsUnavailable(f"{self._base}: {body.get('error', body)}")
        return body["data"]["result"]

    def window_between(self, start: float, end: float) -> WindowStats:
        # The range is exactly [start, end], to the millisecond: whole seconds would stretch or
        # shrink a 20 s window by up to 2.5% (increase() scales with the range it is given).
        span = f"{max(1, round((end - start) * 1000))}ms"
        sel = self._selector()
        counts: dict[str, CohortCounts] = {c: CohortCounts() for c in COHORTS}
        requests = self.query(
            f"sum by (cohort, outcome) (increase({REQUESTS_SERIES}{sel}[{span}]))", end
        )
        for row in requests:
            cohort = row["metric"].get("cohort")
            if cohort in counts:
                counts[cohort].outcomes[row["metric"].get("outcome", OK_OUTCOME)] += float(
                    row["value"][1]
                )
        # By replica too: routers may export different bounds (see CohortCounts.buckets).
        buckets = self.query(
            f"sum by (cohort, le, replica) (increase({LATENCY_SERIES}_bucket{sel}[{span}]))", end
        )
        for row in buckets:
            labels = row["metric"]
            cohort = labels.get("cohort")
            if cohort in counts:
                source = (("replica", labels.get("replica", "")),)
                counts[cohort].add_bucket(source, float(labels["le"]), float(row["value"][1]))
        return to_window(counts, start, end, self._shadow_between(span, end))

    def _shadow_between(self, span: str, end: float) -> ShadowWindow:
        """The shadow comparisons over the same range: one query per series, summed by the
        labels the judge reads (a series nobody exports gives no rows: no copies)."""
        sel = self._selector()
        shadow = ShadowWindow()
        series = [
            (SHADOW_REQUESTS_SERIES, "outcome"),
            (SHADOW_RBO_SERIES + "_count", "artifact"),
            (SHADOW_RBO_SERIES + "_sum", "artifact"),
            (SHADOW_OVERLAP_SERIES + "_sum", "artifact"),
            (SHADOW_TOP1_SERIES, "artifact"),
            (SHADOW_SCORE_DIFF_SERIES + "_bucket", "artifact, le"),
        ]
        for name, by in series:
            for row in self.query(f"sum by ({by}) (increase({name}{sel}[{span}]))", end):
                shadow.add(name, row["metric"], float(row["value"][1]))
        return shadow

    def observe(self) -> None:
        """Nothing to keep: Prometheus holds the history."""

    def close(self) -> None:
        self._client.close()


class MetricsWindows(Protocol):
    """What the controller asks of a metrics source: ``observe`` once per tick, then the
    per-cohort stats between two instants (None: not enough snapshots to tell yet)."""

    def observe(self) -> None: ...

    def window_between(self, start: float, end: float) -> WindowStats | None: ...


def windows_for(
    *,
    application: str,
    prometheus_url: str | None = None,
    endpoints: Sequence[str] = (),
    clock: Callable[[], float] = time.time,
    export_interval_s: float | None = None,
) -> MetricsWindows:
    """PromQL when a Prometheus server is named; else scrapes of the given endpoints, or of
    every node's endpoint that Ray knows of when none is given, at most one per
    ``export_interval_s`` (Ray's metrics report interval; None: unknown, one per tick)."""
    if prometheus_url:
        return PromQLSource(prometheus_url, application=application)
    if endpoints:
        fixed = list(endpoints)
        source = RayScrapeSource(lambda: fixed, application=application, clock=clock)
    else:
        source = RayScrapeSource(application=application, clock=clock)
    return SnapshotWindows(source, min_interval_s=scrape_spacing_s(export_interval_s), clock=clock)
