"""The e2e harness: one real Ray cluster with Serve per session, the two applications the tests
drive on it, and the traffic they send. tests/e2e/conftest.py makes fixtures of it;
tests/e2e/dsl.py builds the acceptance scenarios' Given / When / Then on it.

The session cluster (``session_cluster``, fixtures ``serve_cluster`` and ``cluster``):

- ``ray.init(address="local")`` so the tests never attach to somebody else's cluster; GCS,
  dashboard, metrics export and HTTP ports are picked free here (two Serve instances could
  otherwise share 127.0.0.1:8000 without an error: the kernel splits connections).
- The ``ranker`` app (``deploy_ranker_app``, when the first test asks for fixture
  ``cluster``) is deployed declaratively through the dashboard REST API (token auth), exactly
  as the rollout controller does it, so user_config changes reach live replicas via
  reconfigure.
- A ``ReportCollector`` actor stands in for the rollout controller: replicas push their
  instance reports to it by name.
- Per test (``reset_serving``, fixture ``serving``): a cheap reset (stable and canary back to
  their baseline artifacts under a fresh, higher revision; router weights and flags back to
  baseline; no injected faults), not a redeploy.
- Fault injection (``faults`` in a ranker's user_config) is allowed in this cluster: the
  driver sets ROLLOUT_FAULT_INJECTION=allow before ``ray.init``, and the raylet and every
  worker it starts inherit the driver's environment.

The rollout application (``rollout_application``, fixtures ``env`` and ``rollout_env``): a
second Serve application in the session cluster, ``rollout-e2e`` at ``/rollout``, with its own
router, stable and canary replicas, so revisions start from the registry's (1, 2, ...) and
its replicas report to the real controller actor (``rollout-controller``), while the first
application keeps serving the data-plane tests. Deployed once per session for the controller
tests, the acceptance, autoscaling and shadow scenarios (tests/e2e/conftest.py runs those
modules first and removes the app after them): a test finds the registry with earlier
modules' rollouts in it. The controller
ticks every 0.5 s (its default is 1 s): each tick reads Serve's config over REST and, during a
rollout, scrapes the metrics endpoint; at 0.3 s its process took about a fifth of a core.

Traffic is rollout.local.traffic.TrafficRun, the generator behind bench/loadgen.py and the demo:
``client_load`` (closed loop, plain client: every non-2xx counted; the data-plane tests),
``steady_traffic`` (open loop at a fixed rate from 500 keyed users, plain client) and
``retrying_clients`` (closed loop through app/client.py's retrying client).

Waits poll through app.polling.wait_until. A predicate that asserts, or reads the cluster
(REST, HTTP, Ray) while it changes, waits with ``retry_on=(Exception,)``: its failures mean
"not yet", and the last one is named if the wait times out.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import numpy as np
import ray

from app.client import RetryPolicy
from app.contracts import ControllerSettings, InstanceReport
from app.demo_artifacts import make_demo_artifacts
from app.faults import FAULT_INJECTION_ALLOWED, FAULT_INJECTION_ENV
from app.models.ranker_mlp.features import NUM_FEATURES
from app.packing import PackResult
from app.polling import wait_until
from app.registry import Registry, open_registry
from rollout.actor import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    ensure_controller,
    get_controller,
)
from rollout.local.cluster import LocalCluster
from rollout.local.traffic import RequestRecord, TrafficRun, TrafficSpec
from rollout.serve_control import ServeControl

# The session's data-plane application.
APP = "ranker"
REPORTS_ACTOR = "e2e-reports"
REPORTS_NAMESPACE = "e2e"
STABLE_REPLICAS = 2
BASELINE_ROUTER = {
    "canary_bp": 0,
    "draining": False,
    "allow_cohort_header": True,
    "reveal_cohort": True,  # the scenarios check which cohort answered
    "failover": True,
    "shadow": {},  # no mirroring
}

# The hot standby's application (tests/e2e/test_standby.py): stable, canary and a fallback.
STANDBY_APP = "standby-e2e"
STANDBY_PREFIX = "/standby"
FALLBACK_ARTIFACT = "ranker-lite-v1"

# The application the real rollout controller drives.
ROLLOUT_APP = "rollout-e2e"
ROLLOUT_PREFIX = "/rollout"
BASELINE, CANDIDATE = "ranker-v41", "ranker-v42"

# The machine's and the serving path's scenarios use the threshold judge: one short window
# decides, so they take seconds. The sequential judge's scenarios (tests/e2e/test_acceptance.py)
# give it the traffic it needs. A 2 s window at 20% of 30 requests a second holds about 12
# canary requests, over min_requests (5); a step is its window plus the wait for the old
# weights' metrics (1.45 s at the session's 1 s export) and a tick or two.
FAST_PLAN: dict[str, Any] = {
    "judge": "threshold",
    "steps": [20, 50, 100],
    "interval_s": 2,
    "min_requests": 5,
    "threshold": 2,
    "progress_deadline_s": 60,
    "promotion": "shift",
    "checks": {
        "success_rate_min": 0.99,
        "p99_max_ms": 3000,
        "error_rate_max_ratio": 3.0,
        "error_rate_floor": 0.02,
        "p99_max_ratio": 4.0,
        "p99_slack_ms": 150,
    },
    "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
}
# For a rollout whose assertions are about what it serves and what promotion leaves (another
# family, a head swap), not about its steps: one step at 50% (both cohorts judged, about 7 s
# of a run), then promotion.
ONE_STEP_PLAN: dict[str, Any] = {**FAST_PLAN, "steps": [50]}


# ====================================================================== requests and traffic


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


@contextmanager
def client_load(
    url: str, *, concurrency: int = 4, users: int = 200, rate: float | None = None
) -> Iterator[TrafficRun]:
    """Closed-loop rank requests (``concurrency`` workers, each sending its next request when
    the previous answer came), or open-loop at ``rate`` requests/s when it is given, from a
    background thread while the block runs, once 5 answers came back. A plain client, no
    retries: every non-2xx the service returns is recorded.

    Requests as ``rank_body`` makes them (8 candidates, top 5) from ``users`` keyed users;
    bounded only far beyond what a test runs (pytest's own timeout is 600 s)."""
    spec = TrafficSpec(
        url=url,
        rate=rate,
        concurrency=concurrency,
        max_requests=1_000_000,
        max_seconds=600,
        users=users,
        candidates=8,
        top_n=5,
        timeout_s=60,
    )
    run = TrafficRun(spec).start()
    try:
        wait_until(lambda: len(run.records) >= 5, 60, "load generator warmed up")
        yield run
    finally:
        run.stop(60)


def steady_traffic(url: str, rate: float, **spec: Any) -> TrafficRun:
    """Open-loop traffic at ``rate`` requests/s from 500 users keyed by user id, started; a
    plain client (no retries): every non-2xx the service returns is recorded. ``spec``:
    other TrafficSpec fields (connections, timeouts)."""
    return TrafficRun(
        TrafficSpec(url=url, rate=rate, max_requests=50_000, max_seconds=600, users=500, **spec)
    ).start()


def retrying_clients(url: str, concurrency: int = 4) -> TrafficRun:
    """``concurrency`` closed-loop clients, started, each calling app/client.py's retrying
    client (503/429/5xx and connection errors retried, Retry-After honoured, backoff with
    jitter) for 200 keyed users; a record is one call, with its attempts (status 0: the client
    gave up)."""
    policy = RetryPolicy(max_attempts=20, initial_s=0.1, cap_s=2.0, deadline_s=60.0)
    spec = TrafficSpec(
        url=url,
        rate=None,
        concurrency=concurrency,
        max_requests=1_000_000,
        max_seconds=600,
        users=200,
        user_prefix="retrying-user",
        candidates=8,
        top_n=5,
        timeout_s=30.0,
        retry=policy,
    )
    return TrafficRun(spec).start()


def failed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Requests without a 2xx answer (status 0: no HTTP answer at all), or whose 2xx was not
    a rank answer (the load generator says what was wrong with it)."""
    return [r for r in records if not 200 <= r.status < 300 or r.error is not None]


def assert_all_ok(records: Sequence[RequestRecord]) -> None:
    bad = failed(records)
    assert not bad, (
        f"{len(bad)} of {len(records)} requests failed: {dict(Counter(r.status for r in bad))} "
        f"(0: no HTTP answer), first {bad[:5]}"
    )


T = TypeVar("T")


class Sampler(Generic[T]):
    """Calls ``sample`` every ``every_s`` on a thread of its own until stopped, keeping
    ``(clock(), value)`` pairs stamped when the call began (the value shows the state at that
    moment or later, never earlier); a call that raises (a service busy for a moment) leaves a
    gap, not a value."""

    def __init__(self, sample: Callable[[], T], every_s: float, clock: Callable[[], float]):
        self.samples: list[tuple[float, T]] = []
        self._sample, self._every_s, self._clock = sample, every_s, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            at = self._clock()
            try:
                value = self._sample()
            except Exception:
                continue
            self.samples.append((at, value))

    def stop(self, timeout_s: float = 30.0) -> list[tuple[float, T]]:
        self._stop.set()
        self._thread.join(timeout_s)
        return self.samples


# ====================================================================== the session cluster


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
        return packed.target(revision or self.revision()).model_dump(mode="json")

    def set_target(self, cohort: str, target: dict[str, Any]) -> None:
        self.rest.update_user_configs(APP, {cohort: lambda cfg: {**cfg, "target": target}})

    def set_faults(self, cohort: str, faults: dict[str, float] | None) -> None:
        """Inject (or, with None, remove) faults in a cohort's rank calls (app.faults)."""
        self.rest.update_user_configs(APP, {cohort: lambda cfg: {**cfg, "faults": faults}})

    def set_router(self, **changes: Any) -> None:
        self.rest.update_user_configs(APP, {"router": lambda cfg: {**cfg, **changes}})

    def latest_reports(self, cohort: str) -> dict[str, InstanceReport]:
        """The last report of each RUNNING replica of ``cohort``, read as the controller
        reads them."""
        live = {r["replica_id"] for r in self.rest.replicas(APP, cohort) if r["state"] == "RUNNING"}
        latest = ray.get(self.reports.get_latest.remote())
        return {
            rid: InstanceReport.model_validate(rep) for rid, rep in latest.items() if rid in live
        }

    def wait_cohort_serving(self, cohort: str, artifact: str, revision: int, timeout=60) -> None:
        def all_there() -> bool:
            reps = self.latest_reports(cohort)
            expected = STABLE_REPLICAS if cohort == "stable" else 1
            assert len(reps) == expected, f"{len(reps)} reports of {expected} replicas"
            for rep in reps.values():
                assert (rep.actual_artifact, rep.actual_revision) == (artifact, revision), rep
            return True

        wait_until(
            all_there,
            timeout,
            f"{cohort} serving {artifact} at revision {revision}",
            retry_on=(Exception,),
        )

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.http_url}/v1/status", timeout=10).json()


# Serve notices a killed replica at its next health check and only then starts another: at
# Serve's 10 s period a scenario that kills a replica waited 0-10 s for nothing (a CI run: the
# canary's replacement 17 s, the stable's 5.5 s). A check costs the replica one cheap call.
QUICK_HEALTH_CHECKS: dict[str, Any] = {"health_check_period_s": 1.0}


def app_args(work: Path, demo: dict[str, PackResult]) -> dict[str, Any]:
    def target(name: str) -> dict[str, Any]:
        return demo[name].target(1).model_dump(mode="json")

    return {
        "stable": {
            "num_replicas": STABLE_REPLICAS,
            "num_cpus": 0.1,
            "target": target("ranker-v41"),
            **QUICK_HEALTH_CHECKS,
        },
        "canary": {
            "num_replicas": 1,
            "num_cpus": 0.1,
            "target": target("ranker-v42"),
            **QUICK_HEALTH_CHECKS,
        },
        "router": {
            "canary_bp": 0,
            "allow_cohort_header": True,
            "reveal_cohort": True,
            "probe_interval_s": 0.5,
            "request_timeout_s": 5.0,
        },
        "router_num_cpus": 0.1,
        "cache_dir": str(work / "cache"),
        "retry": {"initial_s": 0.05, "cap_s": 0.2, "max_attempts": 3},
        "controller": {"name": REPORTS_ACTOR, "namespace": REPORTS_NAMESPACE},
        "report_interval_s": 1.0,
    }


@contextmanager
def session_cluster(work: Path) -> Iterator[Cluster]:
    """Ray and Serve on free ports with the report collector and no application yet
    (``deploy_ranker_app`` adds the data-plane app); stopped (only what this started) at the
    end."""
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    os.environ[FAULT_INJECTION_ENV] = FAULT_INJECTION_ALLOWED  # inherited by every worker
    # Free ports for GCS, dashboard, metrics and HTTP; logical CPUs so that replicas asking
    # for fractions fit on 2 cores (a replica asks for 1 CPU unless told otherwise).
    local = LocalCluster.start(num_cpus=4, namespace=REPORTS_NAMESPACE)
    rest = local.serve_control()
    try:
        reports = ReportCollector.options(name=REPORTS_ACTOR, lifetime="detached").remote()
        wait_until(
            lambda: rest.details() is not None, 60, "dashboard REST API up", retry_on=(Exception,)
        )
        yield Cluster(
            http_url=local.http_url,
            dashboard_url=local.dashboard_url,
            metrics_url=local.metrics_url,
            rest=rest,
            work=work,
            demo=demo,
            reports=reports,
        )
    finally:
        rest.close()
        # Nothing is served any more: Serve's graceful deletion of every app would only add
        # seconds to the session's end (ray.shutdown ends the processes this started).
        LocalCluster.stop(graceful=False)
        os.environ.pop(FAULT_INJECTION_ENV, None)


def add_application(control: ServeControl, application: dict[str, Any]) -> None:
    """``application`` added to the declarative config (the other apps as they are) and
    RUNNING."""
    name = application["name"]
    control.update(lambda config: config["applications"].append(application))
    wait_until(
        lambda: control.app_status(name) == "RUNNING", 180, f"{name} RUNNING", retry_on=(Exception,)
    )


def remove_application(control: ServeControl, name: str, *, wait: bool = True) -> None:
    """The app ``name`` out of the declarative config, and gone (``wait``: waited for; else
    Serve deletes it while the caller goes on)."""
    control.update(
        lambda config: config.update(
            applications=[a for a in config["applications"] if a["name"] != name]
        )
    )
    if not wait:
        return
    wait_until(
        lambda: name not in (control.details().get("applications") or {}),
        120,
        f"{name} deleted",
        retry_on=(Exception,),
    )


def deploy_ranker_app(cluster: Cluster) -> None:
    """The ``ranker`` app RUNNING at ``/`` and its router ready. Deployed when the first test
    that uses it starts, not with the cluster: idle, its replicas' reports and the router's
    probes took about a tenth of a core (5% of this machine) from the modules before it."""
    application = {
        "name": APP,
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": app_args(cluster.work, cluster.demo),
    }
    add_application(cluster.rest, application)
    wait_until(
        lambda: httpx.get(f"{cluster.http_url}/readyz", timeout=5).status_code == 200,
        60,
        "router ready",
        retry_on=(Exception,),
    )


@contextmanager
def ranker_application(cluster: Cluster) -> Iterator[None]:
    """The data-plane ``ranker`` app for the block (``deploy_ranker_app``); removed after it
    without waiting for Serve to finish deleting it (the next module deploys its own app
    meanwhile)."""
    deploy_ranker_app(cluster)
    try:
        yield
    finally:
        remove_application(cluster.rest, APP, wait=False)


def reset_serving(cluster: Cluster) -> None:
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
    wait_until(
        lambda: cluster.rest.app_status(APP) == "RUNNING",
        120,
        "app RUNNING",
        retry_on=(Exception,),
    )
    cluster.wait_cohort_serving("stable", "ranker-v41", stable_rev)
    cluster.wait_cohort_serving("canary", "ranker-v42", canary_rev)


# ====================================================================== the rollout application


@dataclass(frozen=True)
class RolloutApp:
    """Which application ``rollout_application`` deploys: the default is the ``ranker``
    family's ``rollout-e2e``; another family's app differs in its model, its artifacts, its
    controller (each app has its own, by name) and its ``args`` (families, schema)."""

    name: str = ROLLOUT_APP
    prefix: str = ROLLOUT_PREFIX
    model: str = "ranker"
    baseline: str = BASELINE
    candidate: str = CANDIDATE
    controller: str = CONTROLLER_NAME
    feature_schema: str | None = None  # of the traffic's bodies; None: the default family's
    args: Mapping[str, Any] = field(default_factory=dict)
    # Registered and approved beside baseline and candidate (heads' backbones, other
    # candidates).
    artifacts: tuple[str, ...] = ()


@dataclass
class RolloutEnv:
    cluster: Cluster
    registry: Registry
    control: ServeControl
    settings: ControllerSettings
    url: str
    app: RolloutApp = RolloutApp()
    # Undos that cost a restart of the app (sizes changed back, say), run by the next test
    # that uses it (``rollout_env``), not by the test that made the change: when none does, the
    # app is removed without paying for them.
    before_next_use: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    @property
    def controller(self) -> Any:
        return ensure_controller(self.settings, self.app.controller)

    def status(self) -> dict[str, Any]:
        return ray.get(self.controller.status.remote(), timeout=60)

    def start(self, candidate: str, plan: dict[str, Any] | None = None) -> dict[str, Any]:
        """Start a rollout with ``--force``: the traffic before it is an earlier test's, and
        the start's estimate must not refuse a plan the test chose (see dsl.When)."""
        return ray.get(
            self.controller.start_rollout.remote(candidate, plan or FAST_PLAN, "e2e", True),
            timeout=60,
        )

    def command(self, name: str, reason: str = "") -> dict[str, Any]:
        return ray.get(self.controller.command.remote(name, reason), timeout=60)

    def wait_for_phase(self, *phases: str, timeout: float = 90, finished: bool = False) -> dict:
        def reached() -> dict[str, Any] | None:
            view = self.status()
            if view.get("phase") in phases and (view.get("finished") or not finished):
                return view
            return None

        desc = f"rollout phase {'/'.join(phases)}{' (finished)' if finished else ''}"
        return wait_until(reached, timeout, desc, every=0.3, retry_on=(Exception,))

    def stable_target(self) -> str:
        return self.registry.get_target(self.app.model, "default", "stable").artifact_id

    def restore_before_next_use(self, what: str, undo: Callable[[], None]) -> None:
        self.before_next_use.append((what, undo))

    def restore_if_changed(self) -> None:
        while self.before_next_use:
            _, undo = self.before_next_use.pop()
            undo()

    def traffic(self, rate: float = 30) -> TrafficRun:
        return steady_traffic(self.url, rate, feature_schema=self.app.feature_schema)

    def replica_ids(self, deployment: str) -> set[str]:
        status = self.control.deployment_status(self.app.name, deployment)
        return {r["replica_id"] for r in status["replicas"] if r["state"] == "RUNNING"}


def register(registry: Registry, packed: Any, model: str = "ranker") -> None:
    registry.register_artifact(packed.manifest_uri, packed.manifest_sha256)
    registry.approve_artifact(model, packed.artifact_id, actor="e2e")


@contextmanager
def rollout_application(
    cluster: Cluster,
    name: str,
    app: RolloutApp = RolloutApp(),
    packed: Mapping[str, PackResult] | None = None,
) -> Iterator[RolloutEnv]:
    """``app`` RUNNING in the session cluster with stable on its baseline, its own SQLite
    registry (``name`` tells it apart) and its controller running; all removed at the end.
    ``packed``: where the app's artifacts are (default: the session's demo artifacts)."""
    packed = packed or cluster.demo
    registry_url = f"sqlite:///{cluster.work / f'rollout-registry-{name}.db'}"
    registry = open_registry(registry_url)
    for artifact in (*app.artifacts, app.baseline, app.candidate):
        register(registry, packed[artifact], app.model)
    stable = registry.publish(
        app.model, "default", "stable", app.baseline, 0, actor="e2e", reason="init"
    )
    control = ServeControl(cluster.dashboard_url)
    application = {
        "name": app.name,
        "route_prefix": app.prefix,
        "import_path": "deployments.app:build_app",
        "args": {
            "stable": {
                "num_replicas": 1,
                "num_cpus": 0.1,
                "target": stable.target().model_dump(mode="json"),
                **QUICK_HEALTH_CHECKS,
            },
            "canary": {"num_replicas": 1, "num_cpus": 0.1, **QUICK_HEALTH_CHECKS},
            "router": {"probe_interval_s": 0.5, "request_timeout_s": 10.0, "reveal_cohort": True},
            "router_num_cpus": 0.1,
            "cache_dir": str(cluster.work / f"{app.name}-cache"),
            "retry": {"initial_s": 0.05, "cap_s": 0.2, "max_attempts": 2},
            "controller": {"name": app.controller, "namespace": CONTROLLER_NAMESPACE},
            "report_interval_s": 0.5,
            **app.args,
        },
    }
    add_application(control, application)
    settings = ControllerSettings(
        registry_url=registry_url,
        dashboard_url=cluster.dashboard_url,
        app_name=app.name,
        model=app.model,
        metrics_endpoints=(cluster.metrics_url,),
        tick_interval_s=0.5,
        metrics_delay_s=1.2,
        report_stale_s=10,
    )
    environment = RolloutEnv(
        cluster, registry, control, settings, cluster.http_url + app.prefix, app
    )
    # Every test finds the controller running, whichever test of the module runs first.
    ensure_controller(settings, app.controller)
    try:
        yield environment
    finally:
        handle = get_controller(app.controller)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        remove_application(control, app.name)
        control.close()
        registry.close()


def reset_rollout(env: RolloutEnv) -> None:
    """Back to stable on the baseline and no rollout running (a test's teardown)."""
    view = env.status()
    if view.get("rollout") and not view.get("finished"):
        env.command("abort", "test teardown")
        env.wait_for_phase("aborted", "rolled_back", "failed", "succeeded", finished=True)
    baseline = env.app.baseline
    if env.stable_target() != baseline:
        ray.get(env.controller.rollback_stable.remote(baseline, "e2e", "reset"), timeout=60)


# ====================================================================== the standby application


@dataclass
class StandbyEnv:
    cluster: Cluster
    url: str
    router: dict[str, Any]  # the router's user_config as deployed

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/status", timeout=10).json()

    def standby(self) -> dict[str, Any]:
        return self.status()["standby"]

    def set_standby(self, **changes: Any) -> None:
        """Change the router's standby config (a live reconfigure)."""
        self.cluster.rest.update_user_configs(
            STANDBY_APP,
            {"router": lambda cfg: {**cfg, "standby": {**cfg.get("standby", {}), **changes}}},
        )

    def set_target(self, deployment: str, target: dict[str, Any] | None) -> None:
        self.cluster.rest.update_user_configs(
            STANDBY_APP, {deployment: lambda cfg: {**cfg, "target": target}}
        )

    def fail_primaries(self, faults: dict[str, float] | None) -> None:
        """Inject (None: remove) faults in every stable and canary rank call, in one PUT: an
        outage that lasts until it is removed (a killed replica comes back by itself)."""
        self.cluster.rest.update_user_configs(
            STANDBY_APP,
            {d: (lambda cfg: {**cfg, "faults": faults}) for d in ("stable", "canary")},
        )

    def running(self, deployment: str) -> list[dict[str, Any]]:
        replicas = self.cluster.rest.replicas(STANDBY_APP, deployment)
        return [r for r in replicas if r["state"] == "RUNNING"]

    def kill_primaries(self) -> list[str]:
        """``ray.kill`` every RUNNING stable and canary replica actor; Serve replaces them."""
        killed = []
        for deployment in ("stable", "canary"):
            for replica in self.running(deployment):
                ray.kill(ray.get_actor(replica["actor_name"], namespace="serve"), no_restart=True)
                killed.append(replica["replica_id"])
        return killed

    def wait_breakers(self, state: str, timeout: float = 90) -> dict[str, Any]:
        """Until stable's breaker is in ``state``; the standby view then. (The idle canary's
        opens when its replica is killed and stays open until it serves a model.)"""

        def there() -> dict[str, Any] | None:
            view = self.standby()
            states = {b["cohort"]: b["state"] for b in view["breakers"]}
            return view if states["stable"] == state else None

        desc = f"stable's breaker {state}"
        return wait_until(there, timeout, desc, every=0.2, retry_on=(Exception,))


@contextmanager
def standby_application(cluster: Cluster, router: dict[str, Any]) -> Iterator[StandbyEnv]:
    """``standby-e2e`` RUNNING in the session cluster: stable on ranker-v41, an idle canary
    pool, and a fallback deployment on the smaller ranker-lite-v1, with the router config
    ``router``; removed at the end."""

    def target(name: str) -> dict[str, Any]:
        return cluster.demo[name].target(1).model_dump(mode="json")

    app = {
        "name": STANDBY_APP,
        "route_prefix": STANDBY_PREFIX,
        "import_path": "deployments.app:build_app",
        "args": {
            "stable": {"num_replicas": 1, "num_cpus": 0.1, "target": target(BASELINE)},
            # The canary pool idle, as between rollouts: a healthy canary beside a recovering
            # stable would (rightly) lift stable's hysteresis, see app/ingress/standby.py.
            # (Serve's own 10 s health checks, not QUICK_HEALTH_CHECKS: the breakers' scenario
            # needs a killed replica's outage to last until the breakers open.)
            "canary": {"num_replicas": 1, "num_cpus": 0.1},
            "fallback": {"num_replicas": 1, "num_cpus": 0.1, "target": target(FALLBACK_ARTIFACT)},
            "router": router,
            "router_num_cpus": 0.1,
            "cache_dir": str(cluster.work / "standby-cache"),
            "retry": {"initial_s": 0.05, "cap_s": 0.2, "max_attempts": 3},
            "controller": {"name": REPORTS_ACTOR, "namespace": REPORTS_NAMESPACE},
            "report_interval_s": 1.0,
        },
    }
    control = cluster.rest
    env = StandbyEnv(cluster, cluster.http_url + STANDBY_PREFIX, router)
    try:
        add_application(control, app)
        wait_until(
            lambda: env.standby()["ready"] and env.status()["cohorts"][0]["serving"],
            60,
            "fallback ready and stable serving",
            retry_on=(Exception,),
        )
        yield env
    finally:
        remove_application(control, STANDBY_APP)
