"""One real Ray cluster + Serve app per session, on ports this session picks.

- ``ray.init(address="local")`` so the tests never attach to somebody else's cluster; GCS,
  dashboard, metrics export and HTTP ports are picked free here (two Serve instances could
  otherwise share 127.0.0.1:8000, RAY_FACTS.md).
- The app is deployed declaratively through the dashboard REST API (token auth), exactly as
  the rollout controller does it, so user_config changes reach live replicas via reconfigure.
- A ``ReportCollector`` actor stands in for the rollout controller: replicas push their
  instance reports to it by name.
- Per test: a cheap reset (stable and canary back to their baseline artifacts under a fresh,
  higher revision; router weights and flags back to baseline; no injected faults), not a
  redeploy.
- Fault injection (``faults`` in a ranker's user_config) is allowed in this cluster: the
  driver sets ROLLOUT_FAULT_INJECTION=allow before ``ray.init``, and the raylet and every
  worker it starts inherit the driver's environment.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import ray

from app.demo_artifacts import make_demo_artifacts
from app.features import NUM_FEATURES
from app.packing import PackResult
from app.replica import FAULT_INJECTION_ALLOWED, FAULT_INJECTION_ENV
from rollout.local_cluster import LocalCluster
from rollout.serve_control import ServeControl

APP = "ranker"
REPORTS_ACTOR = "e2e-reports"
REPORTS_NAMESPACE = "e2e"
STABLE_REPLICAS = 2


def wait_for(
    predicate: Callable[[], Any], timeout: float = 30.0, desc: str = "condition", every: float = 0.1
) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned) or raise, naming ``desc``
    and the predicate's last exception. Predicates may assert."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # an assert inside the predicate: try again
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {desc}; last: {last!r}")
        time.sleep(every)  # polling interval of a condition, not a timing window


@ray.remote(num_cpus=0)
class ReportCollector:
    """Stands in for the rollout controller's ``report_instance`` endpoint."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self.history: list[dict[str, Any]] = []

    def report_instance(self, report: dict[str, Any]) -> None:
        self.latest[report["replica_id"]] = report
        self.history.append(report)
        del self.history[:-5000]

    def get_latest(self) -> dict[str, dict[str, Any]]:
        return self.latest

    def get_history(self) -> list[dict[str, Any]]:
        return self.history


def candidate(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    features: list[float | None] = [float(x) for x in rng.normal(size=NUM_FEATURES)]
    features[3] = None  # a missing feature
    return {"id": f"c{i}", "features": features}


def rank_body(user: str | None = None, n: int = 8, top_n: int = 5) -> dict[str, Any]:
    body: dict[str, Any] = {
        "candidates": [candidate(i) for i in range(n)],
        "top_n": top_n,
        "context": {"surface": "search", "hour_of_day": 13},
    }
    if user is not None:
        body["user_id"] = user
    return body


@dataclass
class Answer:
    status: int
    artifact: str | None
    revision: int | None
    cohort: str | None
    failover: bool
    replica: str | None
    user: str | None
    at: float  # monotonic time the answer arrived
    started: float = 0.0  # monotonic time the request was sent


@dataclass
class Load:
    """Concurrent rank requests from a background thread until stopped; records every answer.

    Uses plain httpx (no retries): every non-2xx the service returns is counted.
    """

    url: str
    concurrency: int = 4
    users: int = 200
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        wait_for(lambda: len(self.answers) >= 5, 60, "load generator warmed up")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(60)

    async def _main(self) -> None:
        bodies = [rank_body(f"user-{u}") for u in range(self.users)]
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as client:

            async def worker(k: int) -> None:
                for i in itertools.count(k, self.concurrency):
                    if self._stop.is_set():
                        return
                    body = bodies[i % len(bodies)]
                    started = time.monotonic()
                    try:
                        r = await client.post("/v1/rank", json=body)
                    except httpx.HTTPError as exc:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                        continue
                    model = r.json().get("model", {}) if r.status_code == 200 else {}
                    self.answers.append(
                        Answer(
                            r.status_code,
                            model.get("artifact_id"),
                            model.get("revision"),
                            model.get("cohort"),
                            bool(r.status_code == 200 and r.json().get("failover")),
                            model.get("replica"),
                            body.get("user_id"),
                            time.monotonic(),
                            started,
                        )
                    )

            await asyncio.gather(*(worker(k) for k in range(self.concurrency)))

    def count(self) -> int:
        return len(self.answers)

    def assert_all_ok(self) -> None:
        bad = [a for a in self.answers if not 200 <= a.status < 300]
        assert not self.errors, f"transport errors: {self.errors[:5]}"
        assert not bad, f"{len(bad)} of {len(self.answers)} non-2xx: {bad[:5]}"


@dataclass
class Cluster:
    http_url: str
    dashboard_url: str
    metrics_url: str
    rest: ServeControl
    work: Path
    demo: dict[str, PackResult]
    reports: Any  # ActorHandle of ReportCollector
    _revisions: Iterator[int] = field(default_factory=lambda: itertools.count(100))

    def revision(self) -> int:
        """A fresh revision, higher than every one used before in this session."""
        return next(self._revisions)

    def target(self, packed: PackResult, revision: int | None = None) -> dict[str, Any]:
        return {
            "revision": revision or self.revision(),
            "artifact_id": packed.artifact_id,
            "manifest_uri": packed.manifest_uri,
            "manifest_sha256": packed.manifest_sha256,
            "feature_schema": "ranker-features-v3",
        }

    def set_target(self, cohort: str, target: dict[str, Any]) -> None:
        self.rest.update_user_configs(APP, {cohort: lambda cfg: {**cfg, "target": target}})

    def set_faults(self, cohort: str, faults: dict[str, float] | None) -> None:
        """Inject (or, with None, remove) faults in a cohort's rank calls (app.replica)."""
        self.rest.update_user_configs(APP, {cohort: lambda cfg: {**cfg, "faults": faults}})

    def set_router(self, **changes: Any) -> None:
        self.rest.update_user_configs(APP, {"router": lambda cfg: {**cfg, **changes}})

    def latest_reports(self, cohort: str) -> dict[str, dict[str, Any]]:
        live = {r["replica_id"] for r in self.rest.replicas(APP, cohort) if r["state"] == "RUNNING"}
        latest = ray.get(self.reports.get_latest.remote())
        return {rid: rep for rid, rep in latest.items() if rid in live}

    def wait_cohort_serving(self, cohort: str, artifact: str, revision: int, timeout=60) -> None:
        def all_there() -> bool:
            reps = self.latest_reports(cohort)
            expected = STABLE_REPLICAS if cohort == "stable" else 1
            assert len(reps) == expected, f"{len(reps)} reports of {expected} replicas"
            for rep in reps.values():
                assert (rep["actual_artifact"], rep["actual_revision"]) == (artifact, revision), rep
            return True

        wait_for(all_there, timeout, f"{cohort} serving {artifact} at revision {revision}")

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.http_url}/v1/status", timeout=10).json()


def app_args(work: Path, demo: dict[str, PackResult]) -> dict[str, Any]:
    def target(name: str) -> dict[str, Any]:
        p = demo[name]
        return {
            "revision": 1,
            "artifact_id": p.artifact_id,
            "manifest_uri": p.manifest_uri,
            "manifest_sha256": p.manifest_sha256,
        }

    return {
        "stable": {
            "num_replicas": STABLE_REPLICAS,
            "num_cpus": 0.1,
            "target": target("ranker-v41"),
        },
        "canary": {"num_replicas": 1, "num_cpus": 0.1, "target": target("ranker-v42")},
        "router": {
            "canary_bp": 0,
            "allow_cohort_header": True,
            "probe_interval_s": 0.5,
            "request_timeout_s": 5.0,
        },
        "router_num_cpus": 0.1,
        "cache_dir": str(work / "cache"),
        "retry": {"initial_s": 0.05, "cap_s": 0.2, "max_attempts": 3},
        "controller": {"name": REPORTS_ACTOR, "namespace": REPORTS_NAMESPACE},
        "report_interval_s": 1.0,
    }


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("e2e")
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    os.environ[FAULT_INJECTION_ENV] = FAULT_INJECTION_ALLOWED  # inherited by every worker
    # Free ports for GCS, dashboard, metrics and HTTP; logical CPUs so that replicas asking
    # for fractions fit on 2 cores (RAY_FACTS.md).
    local = LocalCluster.start(num_cpus=4, namespace=REPORTS_NAMESPACE)
    rest = local.serve_control()
    try:
        reports = ReportCollector.options(name=REPORTS_ACTOR, lifetime="detached").remote()
        wait_for(lambda: rest.details() is not None, 60, "dashboard REST API up")
        local.deploy(
            [
                {
                    "name": APP,
                    "route_prefix": "/",
                    "import_path": "app.main:build_app",
                    "args": app_args(work, demo),
                }
            ]
        )
        c = Cluster(
            http_url=local.http_url,
            dashboard_url=local.dashboard_url,
            metrics_url=local.metrics_url,
            rest=rest,
            work=work,
            demo=demo,
            reports=reports,
        )
        wait_for(
            lambda: httpx.get(f"{c.http_url}/readyz", timeout=5).status_code == 200,
            60,
            "router ready",
        )
        yield c
    finally:
        rest.close()
        LocalCluster.stop()
        os.environ.pop(FAULT_INJECTION_ENV, None)


BASELINE_ROUTER = {
    "canary_bp": 0,
    "draining": False,
    "allow_cohort_header": True,
    "failover": True,
}


@pytest.fixture
def serving(cluster: Cluster) -> Iterator[Cluster]:
    """Cheap reset: baseline router flags; stable v41 and canary v42 under fresh revisions
    (replicas ignore lower revisions, so a reset always moves forward); no injected faults."""
    stable_rev, canary_rev = cluster.revision(), cluster.revision()
    stable = cluster.target(cluster.demo["ranker-v41"], stable_rev)
    canary = cluster.target(cluster.demo["ranker-v42"], canary_rev)
    cluster.rest.update_user_configs(
        APP,
        {
            "router": lambda cfg: {**cfg, **BASELINE_ROUTER},
            "stable": lambda cfg: {**cfg, "target": stable, "faults": None},
            "canary": lambda cfg: {**cfg, "target": canary, "faults": None},
        },
    )
    wait_for(lambda: cluster.rest.app_status(APP) == "RUNNING", 120, "app RUNNING")
    cluster.wait_cohort_serving("stable", "ranker-v41", stable_rev)
    cluster.wait_cohort_serving("canary", "ranker-v42", canary_rev)
    yield cluster


def pytest_configure(config: pytest.Config) -> None:
    # Ray Serve's own pydantic models warn on import; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:ray.*")
    config.addinivalue_line("filterwarnings", "ignore:Using extra keyword arguments on `Field`")


# The rollout controller's environment (a second application driven by the real controller).
from tests.e2e.rollout_env import env, rollout_env  # noqa: E402, F401
