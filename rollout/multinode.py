"""A Ray cluster of several nodes on one machine, for the multi-node tests and benchmarks.

A head with no CPU (the control plane: GCS, dashboard, Serve controller, the HTTP proxy; no
replica or router lands there, as on a cluster launcher's CPU head) and worker nodes, each a
raylet of its own started by ``ray start`` with its own logical CPUs, ports, working directory
and artifact cache (``RANKER_CACHE_DIR`` in its raylet's environment). Token auth is on, as on
a real cluster (the token is the user's ``~/.ray/auth_token``, made when missing).

Nothing here calls ``ray.init``: the caller may be attached to another cluster already. It
talks to this one over the dashboard's REST API, Serve's HTTP ingress and the ``rollout``
CLI. Every process of the cluster names its temp dir on its command line: ``stop`` ends only
those, and ``kill_worker`` only one raylet and what it started (never ``ray stop``).
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
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.polling import WaitTimeout, wait_until
from app.replica import NODE_CACHE_DIR_ENV
from rollout.local_cluster import free_port
from rollout.serve_control import ServeControl

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120.0


@dataclass
class WorkerNode:
    index: int
    node_manager_port: int
    metrics_port: int
    work_dir: Path
    alive: bool = True


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
            wait_until(
                lambda: ServeControl(cluster.dashboard_url).details() is not None,
                START_TIMEOUT_S,
                "dashboard REST API up",
                retry_on=(Exception,),
            )
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_worker(self, work_dir: Path, *, cpus: int) -> WorkerNode:
        work_dir.mkdir(parents=True, exist_ok=True)
        node = WorkerNode(
            index=len(self.workers) + 1,
            node_manager_port=free_port(),
            metrics_port=free_port(),
            work_dir=work_dir,
        )
        cache = work_dir / "cache"  # node-local: its replicas' artifact cache
        self._ray_start(
            [
                f"--address={self.address}",
                f"--num-cpus={cpus}",
                "--num-gpus=0",
                f"--node-manager-port={node.node_manager_port}",
                f"--metrics-export-port={node.metrics_port}",
            ],
            cwd=work_dir,
            env={NODE_CACHE_DIR_ENV: str(cache)},
            cpus=self.worker_cpus,
        )
        self.workers.append(node)
        return node

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
        victims = [raylets[0], *_descendants(raylets[0])]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.alive = False
        return victims

    def stop(self) -> None:
        """Ends this cluster's processes only (TERM, then KILL), and removes its temp dir."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid, _ in _processes_naming(self.temp_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            try:
                wait_until(
                    lambda: not _processes_naming(self.temp_dir), 20, "cluster processes gone"
                )
                break
            except WaitTimeout:
                continue
        time.sleep(0.2)
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

            wait_until(running, timeout_s, f"applications {names} RUNNING", retry_on=(OSError,))
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


def ensure_token() -> None:
    """The user's cluster token (``~/.ray/auth_token``), made as the README says when missing."""
    if (Path.home() / ".ray" / "auth_token").is_file():
        return
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)


def _processes_naming(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line contains ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append((int(proc.name), cmdline))
    return found


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
