"""Ray Serve metrics made from their rows of ``app.telemetry.METRICS`` (the one table of the
names, kinds, descriptions, labels and buckets every exported metric has)."""

from __future__ import annotations

from typing import Any, Final

from ray.serve import metrics

from app import telemetry as t

_RAY_METRICS: Final = {
    "counter": metrics.Counter,
    "gauge": metrics.Gauge,
    "histogram": metrics.Histogram,
}


def ray_metric(spec: t.MetricSpec) -> Any:
    """A Ray Serve metric from its row of the telemetry table."""
    options: dict[str, Any] = {"description": spec.description, "tag_keys": spec.labels}
    if spec.kind == "histogram":
        options["boundaries"] = list(spec.boundaries)
    return _RAY_METRICS[spec.kind](spec.name, **options)


def serve_metric(name: str) -> Any:
    """The Ray Serve metric of that name in the table."""
    return ray_metric(t.METRIC_SPECS[name])
