"""Rollouts on a Ray cluster of three nodes: a head with no CPU (control plane and the HTTP
proxy) and two worker nodes, each a raylet of its own with its own artifact cache, started
by ``rollout.local.multinode`` on this machine. Driven as a user drives a cluster: Serve's HTTP
ingress, the dashboard's REST API and the installed ``rollout`` binary (this test process
never attaches to the cluster; it may be attached to the session cluster already).

Marker ``multinode`` (``pytest -m multinode`` runs it alone). The nodes share two cores with
everything else here, so plans are short and the counts, not the times, are asserted.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.demo_artifacts import make_demo_artifacts
from app.polling import wait_until
from app.registry import open_registry
from rollout.cli.exit_codes import exit_code_for_phase
from rollout.cluster import CONTROLLER_NAME, CONTROLLER_NAMESPACE
from rollout.local.multinode import MultiNodeCluster, multinode_cluster
from tests.e2e.harness import (
    FAST_PLAN,
    QUICK_HEALTH_CHECKS,
    Sampler,
    failed,
    retrying_clients,
    steady_traffic,
)

pytestmark = [pytest.mark.e2e, pytest.mark.multinode]

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
BASELINE, CANDIDATE = "ranker-v41", "ranker-v42"
PLAN = {
    **FAST_PLAN,
    "steps": [20, 50, 100],
    "interval_s": 2,
    "progress_deadline_s": 120,
    # Two canary replicas: one per worker node.
    "canary_scaling": {"min_replicas": 2, "max_replicas": 2, "idle_replicas": 2},
}


class MultiNodeEnv:
    def __init__(self, cluster: MultiNodeCluster, work: Path, db: str) -> None:
        self.cluster = cluster
        self.work = work
        self.db = db
        self.plan = work / "plan.yaml"
        self.plan.write_text(yaml.safe_dump(PLAN))
        # For a rollout whose claims are about where replicas run and what it promotes, not
        # about its steps: one step with both cohorts taking traffic, then promotion.
        self.one_step_plan = work / "one-step-plan.yaml"
        self.one_step_plan.write_text(yaml.safe_dump({**PLAN, "steps": [50, 100]}))

    def common(self) -> list[str]:
        return [
            *("--address", self.cluster.address, "--db", self.db),
            *("--dashboard", self.cluster.dashboard_url, "--timeout", "60", "--json"),
        ]

    def rollout(self, *args: str, check: bool = True) -> Any:
        done = subprocess.run(
            [ROLLOUT, *args, *self.common()], capture_output=True, text=True, timeout=180,
            cwd=self.work, env={**os.environ, "RAY_AUTH_MODE": "token"},
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
        if not check and done.returncode != 0:
            return None
        assert done.returncode == 0, (args, done.returncode, done.stderr[-4000:])
        return json.loads(done.stdout)

    def controller_pid(self) -> int | None:
        ping = self.rollout("controller", "status", check=False)
        return None if ping is None else int(ping["pid"])

    def controller_node(self) -> str:
        return self.rollout("controller", "status")["node_id"]

    def status(self) -> dict[str, Any]:
        return self.rollout("status")

    def watch(self) -> StatusWatch:
        """``rollout status --watch --json``, as CI gates on a rollout: one process for the
        rollout's views (a ``rollout status`` per poll attached to the cluster each time, about
        3 s of the two cores the nodes run on)."""
        return StatusWatch([ROLLOUT, "status", "--watch", "--interval", "1", *self.common()],
                           self.work)  # fmt: skip

    def watch_to_the_end(self, *phases: str, timeout: float = 240) -> dict[str, Any]:
        with self.watch() as watch:
            return watch.to_the_end(*phases, timeout=timeout)

    def wait_canary_weight(self, timeout: float = 180) -> dict[str, Any]:
        with self.watch() as watch:
            return watch.until_canary_weight(timeout)

    def stable_artifact(self, view: dict[str, Any] | None = None) -> str:
        """Stable's artifact in ``view`` (a ``rollout status`` of its own when None)."""
        targets = (view or self.status()).get("targets") or []
        return next(t["artifact_id"] for t in targets if t["cohort"] == "stable")


class StatusWatch:
    """A running ``rollout status --watch --json``: its views, read as they come."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in __exit__
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self._stderr, text=True, cwd=cwd,
            env={**os.environ, "RAY_AUTH_MODE": "token"},
        )  # fmt: skip
        self._views: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip():
                self._views.put(json.loads(line))
        self._views.put(None)  # the process ended

    def errors(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def until(self, wanted: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> Any:
        """The first view from now on for which ``wanted`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                view = self._views.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{what}: not within {timeout}s; {self.seen[-1:]}") from None
            if view is None:
                self._proc.wait(timeout=30)
                raise AssertionError(f"{what}: the watch ended first; {self.seen[-1:]}; "
                                     f"exit {self._proc.returncode}: {self.errors()}")  # fmt: skip
            self.seen.append(view)
            if wanted(view):
                return view

    def until_canary_weight(self, timeout: float) -> dict[str, Any]:
        return self.until(
            lambda v: (
                v.get("phase") == "progressing" and (v.get("weights") or {}).get("canary_bp", 0) > 0
            ),
            timeout,
            "canary taking traffic",
        )

    def to_the_end(self, *phases: str, timeout: float) -> dict[str, Any]:
        """The rollout's last view (its phase one of ``phases``); the watch's exit code is
        the outcome's."""
        last = self.until(lambda v: bool(v.get("finished")), timeout, "the rollout's end")
        code = self._proc.wait(timeout=30)
        assert "Traceback" not in self.errors(), self.errors()
        assert last.get("phase") in phases, (last, self.errors())
        assert code == exit_code_for_phase(last["phase"]), code
        return last

    def __enter__(self) -> StatusWatch:
        return self

    def __exit__(self, *_: object) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=30)
        self._stderr.close()


@pytest.fixture(scope="module")
def mn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeEnv]:
    work = tmp_path_factory.mktemp("multinode")
    demo = {p.artifact_id: p for p in make_demo_artifacts(work / "store")}
    db = f"sqlite:///{work / 'registry.db'}"
    registry = open_registry(db)
    for artifact in (BASELINE, CANDIDATE):
        registry.register_artifact(demo[artifact].manifest_uri, demo[artifact].manifest_sha256)
        registry.approve_artifact("ranker", artifact, actor="e2e")
    stable = registry.publish("ranker", "default", "stable", BASELINE, 0, actor="e2e", reason="i")
    registry.close()
    with multinode_cluster(work, workers=2, cpus_per_worker=2) as cluster:
        cluster.deploy(
            [
                {
                    "name": "ranker",
                    "route_prefix": "/",
                    "import_path": "deployments.app:build_app",
                    "args": {
                        "stable": {
                            "num_replicas": 2,
                            "num_cpus": 0.2,
                            "target": stable.target().model_dump(mode="json"),
                            **QUICK_HEALTH_CHECKS,
                        },
                        "canary": {"num_replicas": 2, "num_cpus": 0.2, **QUICK_HEALTH_CHECKS},
                        "router": {
                            "probe_interval_s": 0.5,
                            "request_timeout_s": 10.0,
                            "reveal_cohort": True,
                        },
                        "router_replicas": 2,
                        "router_num_cpus": 0.2,
                        # Each node's own cache (RANKER_CACHE_DIR) wins over this one.
                        "cache_dir": str(work / "unused-cache"),
                        "retry": {"initial_s": 0.05, "cap_s": 0.2, "max_attempts": 3},
                        "controller": {"name": CONTROLLER_NAME, "namespace": CONTROLLER_NAMESPACE},
                        "report_interval_s": 1.0,
                    },
                }
            ]
        )
        env = MultiNodeEnv(cluster, work, db)
        env.rollout("controller", "start")
        yield env


def spread(cluster: MultiNodeCluster) -> dict[str, dict[str, int]]:
    return cluster.replicas_by_node("ranker")


# How old the controller's view of Serve may be when it records a weight change: one tick
# (the default tick_interval_s, 1 s, here) and the tick's own reads and writes.
VIEW_AGE_S = 2.0


class CanaryCapacity:
    """Serve's own count of RUNNING canary replicas, sampled once a second from the dashboard
    (what Serve says, not what the controller was told) until stopped."""

    def __init__(self, cluster: MultiNodeCluster) -> None:
        self._sampler = Sampler(
            lambda: sum((spread(cluster).get("canary") or {}).values()), 1.0, time.time
        )
        self.samples = self._sampler.samples

    def stop(self) -> list[tuple[float, int]]:
        return self._sampler.stop()

    def short_throughout(self, start: float, end: float, needed: int) -> bool:
        """Serve ran fewer than ``needed`` canary replicas from ``start`` (the last sample at
        or before it) through every sample up to ``end``."""
        before = [n for t, n in self.samples if t <= start]
        during = [n for t, n in self.samples if start < t <= end]
        return bool(before) and all(n < needed for n in (before[-1], *during))


def test_a_rollout_with_both_cohorts_on_both_workers(mn: MultiNodeEnv) -> None:
    """A rollout driven by the binary promotes with stable, canary and routers spread over
    both workers, each worker fetching into its own cache. (An operator's rollback by the
    binary is tests/e2e/test_rollout.py's ``test_operator_rollback_is_weights_first``; the
    weights it writes reach every router as the steps' do here.)"""
    workers = mn.cluster.worker_node_ids()
    assert len(workers) == 2
    traffic = steady_traffic(mn.cluster.http_url, rate=15)
    try:
        mn.rollout("start", "ranker", CANDIDATE, "--plan", str(mn.one_step_plan))
        with mn.watch() as watch:
            watch.until_canary_weight(180)
            # Serve spreads replicas over nodes (best effort): each deployment on both workers.
            wait_until(
                lambda: all(
                    set(spread(mn.cluster).get(d) or {}) == workers
                    for d in ("stable", "canary", "router")
                ),
                60,
                "stable, canary and router replicas on both workers",
                every=1.0,
            )
            done = watch.to_the_end("succeeded", timeout=240)
        assert mn.stable_artifact(done) == CANDIDATE, done
    finally:
        records = traffic.stop()
    assert len(records) > 100
    assert failed(records) == [], failed(records)[:5]
    cohorts = {r.cohort for r in records}
    assert {"stable", "canary"} <= cohorts, cohorts
    # Every node fetched into its own cache, and none into the config's.
    for node in mn.cluster.workers:
        assert list((node.work_dir / "cache").rglob("*.safetensors")), node
    assert not (mn.work / "unused-cache").exists()


def test_a_worker_lost_mid_step_then_the_controller_killed(mn: MultiNodeEnv) -> None:
    """Worker 2 (its replicas and a router among them) is SIGKILLed while the canary takes
    traffic, then the controller's process (on the head node, so the node's loss left it
    running) while the node is still gone. Clients that retry as app/client.py does lose
    nothing; Serve starts the lost replicas again on worker 1, and each serves its desired
    target; while Serve runs fewer canary replicas than the step needs, the canary's weight
    does not go up; the controller comes back, resumes the rollout from the registry and ends
    it by its rules."""
    assert mn.stable_artifact() == CANDIDATE
    traffic = retrying_clients(mn.cluster.http_url, concurrency=4)
    capacity: CanaryCapacity | None = None
    try:
        mn.rollout("start", "ranker", BASELINE, "--plan", str(mn.plan))
        mn.wait_canary_weight()
        _, lost = mn.cluster.workers
        before = mn.controller_pid()
        assert before is not None
        at_kill = mn.status()
        capacity = CanaryCapacity(mn.cluster)
        killed_at = time.time()
        mn.cluster.kill_worker(lost)
        wait_until(
            lambda: len(mn.cluster.worker_node_ids()) == 1, 60, "the lost node declared dead"
        )
        assert mn.controller_pid() == before  # on the head: the worker's loss did not touch it
        os.kill(before, signal.SIGKILL)
        wait_until(
            lambda: mn.controller_pid() not in (None, before),
            120,
            "the controller restarted",
            every=1.0,
        )
        ended = mn.watch_to_the_end("succeeded", "rolled_back", "aborted", "failed")
        assert ended["phase"] in ("succeeded", "rolled_back"), ended
        only = mn.cluster.worker_node_ids()
        assert len(only) == 1

        def replaced() -> bool:
            placed, wanted = spread(mn.cluster), mn.cluster.target_replicas("ranker")
            return all(
                set(placed.get(d) or {}) <= only and sum((placed.get(d) or {}).values()) == n
                for d, n in wanted.items()
            )

        wait_until(replaced, 120, "every replica again, on the surviving worker", every=1.0)

        def serving_their_targets() -> bool:
            rows = mn.status().get("replicas") or []
            return bool(rows) and all(r["actual"] == r["desired"] for r in rows if r["desired"])

        wait_until(serving_their_targets, 120, "every replica on its desired target", every=1.0)
    finally:
        records = traffic.stop()
        samples = capacity.stop() if capacity is not None else []
    # Capacity before traffic, while a node is gone: the canary's weight went up only once
    # Serve ran as many canary replicas as the step needs (PLAN: 2), never on the strength of
    # the lost node's replicas. The controller decides on its tick's read of Serve, which may
    # be up to VIEW_AGE_S old when the raise is recorded (a tick, then its writes on two busy
    # cores): a CI run saw a raise 0.3 s after Serve first counted one canary replica, read
    # before that. So only what Serve said in the VIEW_AGE_S before a raise is what the
    # controller may have read; a raise when Serve said capacity was short all through the
    # VIEW_AGE_S before it (so on the lost replicas' reports, which stay fresh for
    # report_stale_s, 10 s) fails here.
    assert any(n < PLAN["canary_scaling"]["min_replicas"] for _, n in samples), samples
    registry = open_registry(mn.db)
    try:
        events = registry.get_rollout(at_kill["rollout"]).state.get("events", [])
    finally:
        registry.close()
    at_kill_bp = (at_kill.get("weights") or {}).get("canary_bp", 0)
    needed = PLAN["canary_scaling"]["min_replicas"]
    raises = [
        e
        for e in events
        if e["event"] == "weights"
        and e["at"] > killed_at
        and (e.get("canary_bp") or 0) > at_kill_bp
    ]
    for event in raises:
        assert capacity is not None
        at = event["at"]
        assert not capacity.short_throughout(at - VIEW_AGE_S, at, needed), (event, samples)
    print(
        f"multinode: canary replicas Serve ran after the loss {[n for _, n in samples]}; "
        f"weight raises after it (s, bp) "
        f"{[(round(e['at'] - killed_at, 1), e['canary_bp']) for e in raises]}"
    )
    assert len(records) > 50
    gave_up = [r for r in records if not 200 <= r.status < 300]
    assert gave_up == [], gave_up[:5]
    retried = sum(1 for r in records if r.attempts > 1)
    print(f"multinode: {len(records)} calls, {retried} retried at least once")
