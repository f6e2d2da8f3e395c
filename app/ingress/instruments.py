"""The router's metrics as the ingress core uses them, made from ``app.telemetry.METRICS``.

The core records through these three small protocols (Ray's ``ray.serve.metrics`` classes
satisfy them); the Serve shell builds them with Ray's classes, the unit tests with recorders.
Each group maps its attribute names to names in the telemetry table, so the name, kind,
description, labels and buckets of a metric are written once, there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Protocol, Self, TypeVar

from app import telemetry as t
from app.ingress.shadow import Comparison

Tags = dict[str, str]
InstrumentsT = TypeVar("InstrumentsT")


class Counter(Protocol):
    def inc(self, value: float = 1.0, tags: Tags | None = None) -> None: ...


class Gauge(Protocol):
    def set(self, value: float, tags: Tags | None = None) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float, tags: Tags | None = None) -> None: ...


# Makes one metric from its row of the table (the shell: Ray's classes).
MetricFactory = Callable[[t.MetricSpec], Any]


def _build(cls: type[InstrumentsT], names: Mapping[str, str], make: MetricFactory) -> InstrumentsT:
    missing = {f.name for f in fields(cls)} ^ set(names)  # type: ignore[arg-type]
    if missing:
        raise AssertionError(f"{cls.__name__}: no metric named for {sorted(missing)}")
    return cls(**{attr: make(t.METRIC_SPECS[name]) for attr, name in names.items()})


_ROUTER: Final = {
    "requests": t.ROUTER_REQUESTS,
    "latency": t.ROUTER_LATENCY_MS,
    "failovers": t.ROUTER_FAILOVERS,
    "body_read": t.ROUTER_BODY_READ_MS,
    "rejections": t.ROUTER_REJECTIONS,
    "canary_weight": t.ROUTER_CANARY_WEIGHT_BP,
    "in_flight": t.ROUTER_IN_FLIGHT,
    "batch": t.ROUTER_BATCH_SIZE,
}
_SHADOW: Final = {
    "requests": t.ROUTER_SHADOW_REQUESTS,
    "rbo": t.ROUTER_SHADOW_RBO,
    "overlap": t.ROUTER_SHADOW_OVERLAP,
    "score_diff": t.ROUTER_SHADOW_SCORE_DIFF,
    "top1_changed": t.ROUTER_SHADOW_TOP1_CHANGED,
    "in_flight": t.ROUTER_SHADOW_IN_FLIGHT,
    "fraction_bp": t.ROUTER_SHADOW_FRACTION_BP,
}
_STANDBY: Final = {
    "breaker_state": t.ROUTER_BREAKER_STATE,
    "serving_from_fallback": t.ROUTER_SERVING_FROM_FALLBACK,
    "primaries_down": t.ROUTER_PRIMARIES_DOWN,
    "ready": t.ROUTER_FALLBACK_READY,
    "allowed": t.ROUTER_FALLBACK_ALLOWED,
    "waiting": t.ROUTER_FALLBACK_WAITING,
}


@dataclass
class RouterInstruments:
    """Requests, their latency and outcome, failovers, rejections, weights, batches."""

    requests: Counter
    latency: Histogram
    failovers: Counter
    body_read: Histogram
    rejections: Counter
    canary_weight: Gauge
    in_flight: Gauge
    batch: Histogram

    @classmethod
    def build(cls, make: MetricFactory) -> Self:
        return _build(cls, _ROUTER, make)


@dataclass
class ShadowInstruments:
    """Shadow traffic: what the comparisons of mirrored copies found (app.ingress.shadow)."""

    requests: Counter
    rbo: Histogram
    overlap: Histogram
    score_diff: Histogram
    top1_changed: Counter
    in_flight: Gauge
    fraction_bp: Gauge

    @classmethod
    def build(cls, make: MetricFactory) -> Self:
        return _build(cls, _SHADOW, make)

    def compared(self, comparison: Comparison) -> None:
        tags = {t.ARTIFACT: comparison.canary_artifact}
        d = comparison.divergence
        self.rbo.observe(d.rbo, tags=tags)
        self.overlap.observe(d.overlap, tags=tags)
        self.score_diff.observe(d.max_score_diff, tags=tags)
        if d.top1_changed:
            self.top1_changed.inc(tags=tags)


@dataclass
class StandbyInstruments:
    """The hot standby's gauges: made only for a router with a fallback deployment."""

    breaker_state: Gauge
    serving_from_fallback: Gauge
    primaries_down: Gauge
    ready: Gauge
    allowed: Gauge
    waiting: Gauge

    @classmethod
    def build(cls, make: MetricFactory) -> Self:
        return _build(cls, _STANDBY, make)


# Which table rows each group makes (the layering test checks that the router's metrics in
# the table are exactly these).
ROUTER_METRIC_NAMES: Final = frozenset({*_ROUTER.values(), *_SHADOW.values(), *_STANDBY.values()})
