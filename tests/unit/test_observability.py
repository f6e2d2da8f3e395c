"""The Grafana dashboard and Prometheus config name only metrics the service declares.

The static half: names against app.telemetry's table of metrics (``METRICS``), the one the
router and the replicas make their metrics from. That a deployment really creates
and exports each of them is checked on a running app, in a real scrape:
tests/e2e/test_serving.py::test_every_metric_the_dashboard_queries_is_exported (a declared
but never created gauge passed here and failed there)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from app import telemetry
from app.ingress.instruments import ROUTER_METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2] / "configs" / "observability"
# Every metric the service exports, with its kind: the table the deployments build them from.
KINDS = {spec.name: spec.kind for spec in telemetry.METRICS}
RAY_BUILTINS = {"ray_serve_deployment_replica_healthy"}


def exported_series() -> set[str]:
    names = set(RAY_BUILTINS)
    for name, kind in KINDS.items():
        base = telemetry.exported_name(name, kind=kind)
        names.add(base)
        if kind == "histogram":
            names.update({f"{base}_bucket", f"{base}_sum", f"{base}_count"})
    return names


def test_the_table_names_each_metric_once_with_buckets_for_histograms_only():
    names = [spec.name for spec in telemetry.METRICS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for spec in telemetry.METRICS:
        assert spec.description, spec.name
        assert bool(spec.boundaries) == (spec.kind == "histogram"), spec.name
        assert list(spec.boundaries) == sorted(spec.boundaries), spec.name


def test_the_router_makes_every_router_metric_of_the_table():
    """The ingress core's instrument groups cover the table's router rows, no more, no less
    (a row no group makes would never be exported)."""
    router_rows = {s.name for s in telemetry.METRICS if s.name.startswith("ranker_router_")}
    assert router_rows == ROUTER_METRIC_NAMES


def test_dashboard_queries_use_exported_metrics_only():
    dashboard = json.loads((ROOT / "grafana-rollout-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    known = exported_series()
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b(ray_[a-z0-9_]+)\b", expr):
            assert name in known, f"{name} in {expr!r} is not exported by the service"
            used.add(name)
    # Everything the controller judges is on the dashboard, and how it judged it.
    assert telemetry.exported_name(telemetry.ROLLOUT_EVIDENCE, kind="gauge") in used
    # And what an alert on configs deployed behind the controller's back reads.
    assert telemetry.exported_name(telemetry.ROLLOUT_DRIFT_REPAIRS, kind="counter") in used
    # And the hot standby: breakers, the fallback's state, the alert's series.
    for name in telemetry.STANDBY_GAUGES:
        assert telemetry.exported_name(name, kind="gauge") in used, name
    assert telemetry.exported_name(telemetry.ROUTER_REQUESTS, kind="counter") in used
    # And a panel per divergence measure of the shadow phase.
    rbo = telemetry.exported_name(telemetry.ROUTER_SHADOW_RBO, kind="histogram")
    overlap = telemetry.exported_name(telemetry.ROUTER_SHADOW_OVERLAP, kind="histogram")
    diff = telemetry.exported_name(telemetry.ROUTER_SHADOW_SCORE_DIFF, kind="histogram")
    for name in (
        f"{rbo}_sum",
        f"{overlap}_sum",
        f"{diff}_bucket",
        telemetry.exported_name(telemetry.ROUTER_SHADOW_TOP1_CHANGED, kind="counter"),
        telemetry.exported_name(telemetry.ROUTER_SHADOW_REQUESTS, kind="counter"),
    ):
        assert name in used, name
    assert (
        telemetry.exported_name(telemetry.ROUTER_LATENCY_MS, kind="histogram") + "_bucket" in used
    )


def test_prometheus_config_uses_rays_service_discovery_file():
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    files = config["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert files == ["/tmp/ray/prom_metrics_service_discovery.json"]
