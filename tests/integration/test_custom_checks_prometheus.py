"""Custom checks read from a real Prometheus server (Debian's binary, tests/prometheus.py): a
team's own exporter with a checkout counter and a queue gauge per cohort, scraped every
second; the controller's reader fills in each query per cohort and window
(rollout/custom_checks.py) and the sequential judge decides on what it read.

About 12 s: the server's start, then 8 s of the exporter's counts (a window of 3 s holds two
or three scrapes, what ``increase`` needs)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from app.polling import wait_until
from rollout.analysis import CohortStats, Outcome, WindowStats
from rollout.custom_checks import CustomCheckReader
from rollout.local.cluster import free_port
from rollout.metrics import PromQLSource
from rollout.plan import RolloutPlan
from rollout.sequential import judge_sequential
from tests.prometheus import running_server

APP = "shop"


class Exporter:
    """The team's exporter: checkouts and their failures, and a queue's depth, by cohort."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.attempts = Counter(
            "checkout_attempts", "Checkouts.", ("application", "cohort"), registry=self.registry
        )
        self.failures = Counter(
            "checkout_failures", "Failed checkouts.", ("application", "cohort"),
            registry=self.registry,
        )  # fmt: skip
        self.queue = Gauge(
            "queue_depth", "Queue.", ("application", "cohort"), registry=self.registry
        )
        self.port = free_port()
        self.server, self.thread = start_http_server(
            self.port, addr="127.0.0.1", registry=self.registry
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    exporting = Exporter()
    try:
        yield exporting
    finally:
        exporting.close()


@pytest.fixture(scope="module")
def prometheus(exporter: Exporter, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sd_file = tmp_path_factory.mktemp("sd") / "targets.json"
    sd_file.write_text(json.dumps([{"targets": [f"127.0.0.1:{exporter.port}"]}]))
    with running_server(Path(sd_file), scrape_interval_s=1.0) as server:
        yield server.url


PLAN = RolloutPlan.model_validate(
    {
        "steps": [50, 100],
        "min_requests": 10,
        "checks": {"p99_max_ms": None, "error_rate_max_ratio": None, "p99_max_ratio": None},
        "custom_checks": [
            {
                "name": "checkout_errors",
                "events": 'sum(increase(checkout_failures_total{application="{{app}}", '
                'cohort="{{cohort}}"}[{{window}}]))',
                "trials": 'sum(increase(checkout_attempts_total{application="{{app}}", '
                'cohort="{{cohort}}"}[{{window}}]))',
                "max_rate": 0.02,
            },
            {
                "name": "queue",
                "query": 'max(queue_depth{application="{{app}}", cohort="{{cohort}}"})',
                "max": 100.0,
                "failure_limit": 2,
                "advisory": True,
            },
        ],
    }
)


def test_custom_checks_from_prometheus_roll_back_a_bad_canary_and_watch_an_advisory_one(
    exporter: Exporter, prometheus: str
) -> None:
    source = PromQLSource(prometheus, application=APP)
    reader = CustomCheckReader(source, app=APP)
    # The canary fails 30% of its checkouts, stable none; the canary's queue is deep.
    exporter.queue.labels(APP, "canary").set(250)
    exporter.queue.labels(APP, "stable").set(12)
    started = time.time()
    while time.time() - started < 8:
        exporter.attempts.labels(APP, "canary").inc(20)
        exporter.failures.labels(APP, "canary").inc(6)
        exporter.attempts.labels(APP, "stable").inc(20)
        time.sleep(0.25)

    def scraped() -> bool:
        return bool(source.query('checkout_attempts_total{cohort="canary"}', time.time()))

    wait_until(scraped, 20, "prometheus scraped the exporter", every=0.5)
    end = time.time()
    read = reader.read(PLAN.custom_checks, end - 3.0, end)
    checkout, queue = read["checkout_errors"], read["queue"]
    # increase() over 3 s of 80 checkouts a second: about 240, 30% of them failed.
    assert 150 <= checkout.trials["canary"] <= 330, checkout
    assert checkout.events["canary"] == pytest.approx(0.3 * checkout.trials["canary"], rel=0.1)
    assert checkout.events.get("stable", 0) == 0 and checkout.trials["stable"] > 100
    assert queue.value == {"canary": 250.0, "stable": 12.0}

    healthy = CohortStats(1000)
    window = WindowStats(end - 3.0, end, healthy, healthy, custom=read)
    verdict, evidence = judge_sequential(window, None, PLAN, canary_bp=5000, step_index=0)
    assert verdict.outcome is Outcome.FAIL, verdict.summary()
    assert any(r.startswith("checkout_errors: canary 3") for r in verdict.reasons), verdict.reasons
    # The advisory gate is out of bounds and shown, but is not among the reasons it failed.
    gate = next(c for c in verdict.checks if c.name == "queue")
    assert gate.advisory and gate.reason.startswith("queue (advisory): canary 250 (stable 12)")
    assert not any(r.startswith("queue") for r in verdict.reasons)
    assert evidence.checks["checkout_errors"].e_against >= 2 / PLAN.alpha


def test_a_query_with_no_series_reads_as_no_value(prometheus: str) -> None:
    reader = CustomCheckReader(PromQLSource(prometheus, application=APP), app=APP)
    now = time.time()
    read = reader.read(PLAN.custom_checks, now - 3.0, now)
    # Another app's series: nothing for this one's placeholders to match.
    other = CustomCheckReader(PromQLSource(prometheus, application="other"), app="other")
    nothing = other.read(PLAN.custom_checks, now - 3.0, now)
    assert nothing["checkout_errors"].trials == {} and nothing["queue"].value == {}
    assert read["queue"].value  # while this app's are there
