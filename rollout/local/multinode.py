"""A Ray cluster of several nodes on one machine, for the multi-node tests and benchmarks.

A head with no CPU (the control plane: GCS, dashboard, Serve controller, the HTTP proxy; no
replica or router lands there, as on a cluster launcher's CPU head) and worker nodes, each a
raylet of its own started by ``ray start`` with its own logical CPUs, ports, working directory
and artifact cache (``RANKER_CACHE_DIR`` in its raylet's environment). Token auth is on, as on
a real cluster (the token is the user's ``~/.ray/auth_token``, made when missing).

Nothing here calls ``ray.init``: the caller may be attached to another cluster already. It
talks to this one over the dashboard's REST API, Serve's HTTP ingress and the ``rollout``
CLI. The processes of the cluster are those that name its temp dir on their command line and
their children (Ray renames its workers): ``stop`` ends only those, and ``kill_worker`` only
one node's (never ``ray stop``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.cache import NODE_CACHE_DIR_ENV
from app.errors import WaitTimeout
from app.polling import wait_until
from rollout.cluster import HEAD_NODE_RESOURCE
from rollout.local.cluster import free_port
from rollout.serve_control import ServeControl, ServeUnreachable

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120.0


@dataclass
class WorkerNode:
    index: int
    node_manager_port: int
    metrics_port: int
    work_dir: Path
    alive: bool = True
    # What its `ray start` left running (the raylet, the log monitor); the raylet's children
    # (agents, workers) are found when it is killed.
    pids: list[int] = field(default_factory=list)


@dataclass
class MultiNodeCluster:
    temp_dir: str
    gcs_port: int
    dashboard_port: int
    http_port: int
    head_metrics_port: int
    env: dict[str, str]
    worker_cpus: str | None = None
    workers: list[WorkerNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_urls(self) -> list[str]:
        ports = [self.head_metrics_port, *(w.metrics_port for w in self.workers if w.alive)]
        return [f"http://127.0.0.1:{p}/metrics" for p in ports]

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def start(
        cls,
        work: Path,
        *,
        workers: int = 2,
        cpus_per_worker: int = 4,
        metrics_report_interval_ms: int = 1000,
        env: Mapping[str, str] | None = None,
        head_cpus: str | None = None,
        worker_cpus: str | None = None,
    ) -> MultiNodeCluster:
        """The head, then ``workers`` worker nodes joined to it; raises if a node does not
        come up (what did come up is stopped). ``head_cpus`` / ``worker_cpus``: the cores
        (``taskset -c`` lists) the head's and the workers' processes run on, as on machines
        of their own (every process a raylet starts inherits its affinity)."""
        ensure_token()
        node_env = {**os.environ, **(env or {}), "RAY_AUTH_MODE": "token"}
        node_env.pop("RAY_ADDRESS", None)
        cluster = cls(
            # Short: Ray's Unix socket paths live under it, and have a length limit.
            temp_dir=tempfile.mkdtemp(prefix="rmn-", dir="/tmp"),
            gcs_port=free_port(),
            dashboard_port=free_port(),
            http_port=free_port(),
            head_metrics_port=free_port(),
            env=node_env,
            worker_cpus=worker_cpus,
        )
        try:
            system_config = {
                "metrics_report_interval_ms": metrics_report_interval_ms,
                # A lost node is declared dead within a few seconds (Ray's default: ~30 s).
                "health_check_period_ms": 1000,
                "health_check_failure_threshold": 3,
            }
            cluster._ray_start(
                [
                    "--head",
                    f"--port={cluster.gcs_port}",
                    "--num-cpus=0",
                    "--num-gpus=0",
                    "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={cluster.dashboard_port}",
                    f"--metrics-export-port={cluster.head_metrics_port}",
                    f"--ray-client-server-port={free_port()}",
                    f"--system-config={json.dumps(system_config)}",
                ],
                cwd=work,
                cpus=head_cpus,
            )
            for i in range(workers):
                cluster.add_worker(work / f"node-{i + 1}", cpus=cpus_per_worker)
            control = ServeControl(cluster.dashboard_url)
            try:
                wait_until(
                    lambda: control.details() is not None,
                    START_TIMEOUT_S,
                    "dashboard REST API up",
                    retry_on=(Exception,),
                )
            finally:
                control.close()
            wait_until(
                lambda: len(cluster.worker_node_ids()) == workers,
                START_TIMEOUT_S,
                f"{workers} worker nodes alive",
            )
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_worker(self, work_dir: Path, *, cpus: int, attempts: int = 2) -> WorkerNode:
        """A worker node joined to the head. On a loaded machine a raylet can miss Ray's
        start-up deadline: what that attempt left running is stopped, and it is tried again
        with new ports (``attempts`` in all)."""
        work_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, attempts + 1):
            node = WorkerNode(
                index=len(self.workers) + 1,
                node_manager_port=free_port(),
                metrics_port=free_port(),
                work_dir=work_dir,
            )
            before = {pid for pid, _ in _processes_naming(self.temp_dir)}
            try:
                self._ray_start(
                    [
                        f"--address={self.address}",
                        f"--num-cpus={cpus}",
                        "--num-gpus=0",
                        f"--node-manager-port={node.node_manager_port}",
                        f"--metrics-export-port={node.metrics_port}",
                    ],
                    cwd=work_dir,
                    # Node-local: its replicas' artifact cache.
                    env={NODE_CACHE_DIR_ENV: str(work_dir / "cache")},
                    cpus=self.worker_cpus,
                )
            except RuntimeError:
                left = [pid for pid, _ in _processes_naming(self.temp_dir) if pid not in before]
                for victim in {*left, *(c for p in left for c in _descendants(p))}:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                if attempt == attempts:
                    raise
                continue
            # Its raylet and log monitor: what `ray start` leaves running for a worker node (the
            # head's raylet may start workers meanwhile; those are not this node's).
            node.pids = [
                pid
                for pid, cmdline in _processes_naming(self.temp_dir)
                if pid not in before and ("/raylet " in cmdline or "log_monitor.py" in cmdline)
            ]
            self.workers.append(node)
            return node
        raise AssertionError("unreachable")

    def _ray_start(
        self,
        args: list[str],
        *,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        cpus: str | None = None,
    ) -> None:
        isolation = [
            f"--temp-dir={self.temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--object-manager-port={free_port()}",
            "--disable-usage-stats",
        ]
        done = subprocess.run(
            [*(["taskset", "-c", cpus] if cpus else []), RAY, "start", *args, *isolation],
            cwd=cwd, env={**self.env, **(env or {})}, capture_output=True, text=True,
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args[:2])} failed: {done.stderr[-3000:]}")

    def kill_worker(self, node: WorkerNode) -> list[int]:
        """SIGKILL one worker node's raylet and every process it started (its replicas among
        them), as when the machine is lost. Returns the PIDs killed."""
        flag = f"--node_manager_port={node.node_manager_port}"
        raylets = [pid for pid, cmdline in _processes_naming(self.temp_dir) if flag in cmdline]
        if len(raylets) != 1:
            raise RuntimeError(f"node {node.index}: {len(raylets)} raylets found, expected 1")
        victims = sorted({*node.pids, raylets[0], *_descendants(raylets[0])})
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.alive = False
        return victims

    def stop(self) -> None:
        """Ends this cluster's processes only (TERM, then KILL), and removes its temp dir.
        Ray renames its workers and agents (``ray::...``), so they are found as the children
        of the processes that name the temp dir, collected before any of those ends."""
        stop_cluster_processes(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # ------------------------------------------------------------------ Serve

    def serve_control(self) -> ServeControl:
        return ServeControl(self.dashboard_url)

    def deploy(self, applications: list[dict[str, Any]], timeout_s: float = 240.0) -> None:
        """Deploy declaratively with the HTTP proxy on the head only, and wait for RUNNING."""
        control = self.serve_control()
        try:
            control.apply(
                {
                    "proxy_location": "HeadOnly",
                    "http_options": {"host": "127.0.0.1", "port": self.http_port},
                    "applications": applications,
                }
            )
            names = [a["name"] for a in applications]

            def running() -> bool:
                apps = control.details().get("applications") or {}
                statuses = [(apps.get(n) or {}).get("status") for n in names]
                if "DEPLOY_FAILED" in statuses:
                    raise RuntimeError(f"deploy failed: {apps}")
                return all(s == "RUNNING" for s in statuses)

            wait_until(
                running, timeout_s, f"applications {names} RUNNING", retry_on=(ServeUnreachable,)
            )
        finally:
            control.close()

    def replicas_by_node(self, app: str) -> dict[str, dict[str, int]]:
        """Per deployment: RUNNING replicas per node id, from Serve's own view."""
        control = self.serve_control()
        try:
            details = control.details()
        finally:
            control.close()
        out: dict[str, dict[str, int]] = {}
        deployments = ((details.get("applications") or {}).get(app) or {}).get("deployments")
        for name, deployment in (deployments or {}).items():
            counts: dict[str, int] = {}
            for replica in deployment.get("replicas") or []:
                if replica.get("state") == "RUNNING":
                    node = str(replica.get("node_id"))
                    counts[node] = counts.get(node, 0) + 1
            out[name] = counts
        return out

    def target_replicas(self, app: str) -> dict[str, int]:
        """Per deployment: the replicas Serve means to run."""
        control = self.serve_control()
        try:
            details = control.details()
        finally:
            control.close()
        deployments = ((details.get("applications") or {}).get(app) or {}).get("deployments")
        return {n: int(d.get("target_num_replicas") or 0) for n, d in (deployments or {}).items()}

    def alive_node_ids(self) -> dict[str, dict[str, Any]]:
        """Alive nodes as the cluster's driver API sees them, by node id (a subprocess
        attaches to this cluster: the caller may be attached to another one)."""
        script = (
            "import json, ray\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "alive = {n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}\n"
            "print('NODES ' + json.dumps(alive), flush=True)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], env=self.env, capture_output=True, text=True,
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"ray.nodes() failed: {done.stderr[-2000:]}")
        # Ray may print its own lines (a node's death among them) around ours.
        line = next(x for x in done.stdout.splitlines() if x.startswith("NODES "))
        return json.loads(line.removeprefix("NODES "))

    def head_node_id(self) -> str:
        (head,) = (
            n for n, resources in self.alive_node_ids().items() if HEAD_NODE_RESOURCE in resources
        )
        return head

    def worker_node_ids(self) -> set[str]:
        """Alive nodes that can take replicas (the head has no CPU)."""
        return {n for n, resources in self.alive_node_ids().items() if resources.get("CPU")}


def pinned_layout(
    work: Path, *, cpus_per_worker: int = 4, metrics_report_interval_ms: int = 10_000
) -> MultiNodeCluster:
    """The production-like layout of the benchmarks on a machine of two cores or more: the
    head on the first core this process may use, one worker node on the second, and this
    process (and, inherited, whatever it starts next: a load generator) moved to the head's
    core. Token auth for this process too, set before anything reads Ray's config."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("the pinned layout needs two cores: one for the head, one for a worker")
    os.environ["RAY_AUTH_MODE"] = "token"
    cluster = MultiNodeCluster.start(
        work,
        workers=1,
        cpus_per_worker=cpus_per_worker,
        metrics_report_interval_ms=metrics_report_interval_ms,
        head_cpus=str(cores[0]),
        worker_cpus=str(cores[1]),
    )
    os.sched_setaffinity(0, {cores[0]})
    return cluster


def ensure_token() -> None:
    """The user's cluster token (``~/.ray/auth_token``), made as docs/deploying.md says when
    missing."""
    if (Path.home() / ".ray" / "auth_token").is_file():
        return
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)


def stop_cluster_processes(temp_dir: str, grace_s: float = 3.0, timeout_s: float = 20.0) -> None:
    """End the processes of the Ray cluster whose temp dir is ``temp_dir`` (TERM, ``grace_s``
    for them to end, then KILL what is left), and no other: those with an option naming it,
    and their children (Ray renames its workers and agents ``ray::...``), collected before
    any of them ends.

    The grace is short because waiting longer buys nothing: measured on Ray 2.60, the GCS
    server and the autoscaler's monitor do not end on TERM at all (still running 25 s later)
    and raylets take about 11 s, so a longer grace only delayed the KILL by its whole length
    (20 s per cluster stopped). The clusters stopped here are throwaway ones (tests,
    benchmarks); a KILL leaves nothing behind in /dev/shm, and the temp dir goes next."""
    found = [pid for pid, _ in _processes_naming(temp_dir)]
    pids = sorted({*found, *(c for pid in found for c in _descendants(pid))})
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, timeout_s)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            wait_until(lambda: not any(map(_running, pids)), wait_s, "cluster processes gone")
            return
        except WaitTimeout:
            continue


def _processes_naming(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process with an option naming ``text`` (``--temp-dir=``,
    ``--session_dir=``, ...): Ray's own processes, not a ``tail`` of one of its logs."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.startswith("--") and text in a for a in args):
            found.append((int(proc.name), " ".join(args)))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds only its exit status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # The parent is the 4th field after the command name, which is in parentheses.
            stat = (proc / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@contextlib.contextmanager
def multinode_cluster(work: Path, **kwargs: Any) -> Iterator[MultiNodeCluster]:
    cluster = MultiNodeCluster.start(work, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()
