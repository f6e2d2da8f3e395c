"""A local Ray cluster with Serve on ports of its own, for the demo and the tests.

``ray.init()`` with no address attaches to whatever cluster runs on the machine, and two
Serve instances can both bind 127.0.0.1:8000 without an error (the kernel then splits
connections between them), so this always starts a new cluster (``address="local"``) on free
ports: GCS, dashboard, metrics export and HTTP. It stops only what it started
(``ray.shutdown()``), never other Ray processes on the machine.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from app.errors import WaitTimeout
from app.polling import wait_until
from rollout.serve_control import ServeControl

# Ports this process has handed out. The kernel may give a port that was just closed again
# to the next bind: two of one node's components on the same port and `ray start` refuses.
_GIVEN_PORTS: set[int] = set()
_GIVEN_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A port free on 127.0.0.1 now, and never one this process was given before."""
    with _GIVEN_PORTS_LOCK:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _GIVEN_PORTS:
                _GIVEN_PORTS.add(port)
                return port


@dataclass(frozen=True)
class LocalCluster:
    dashboard_url: str
    metrics_url: str
    http_url: str
    http_port: int

    @classmethod
    def start(
        cls,
        *,
        num_cpus: float = 8,
        metrics_report_interval_ms: int = 1000,
        namespace: str = "rollout",
    ) -> LocalCluster:
        """Start Ray and Serve. ``num_cpus`` is logical: replicas ask for fractions of it, so
        a 2-core machine can host the router, both cohorts and the controller."""
        import ray
        from ray import serve

        os.environ["RAY_GCS_SERVER_PORT"] = str(free_port())
        dashboard_port, metrics_port, http_port = free_port(), free_port(), free_port()
        context = ray.init(
            address="local",
            num_cpus=int(num_cpus),
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard_port,
            namespace=namespace,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _metrics_export_port=metrics_port,
            _system_config={"metrics_report_interval_ms": metrics_report_interval_ms},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        url = getattr(context, "dashboard_url", None) or f"127.0.0.1:{dashboard_port}"
        return cls(
            dashboard_url=url if url.startswith("http") else f"http://{url}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            http_url=f"http://127.0.0.1:{http_port}",
            http_port=http_port,
        )

    def serve_control(self) -> ServeControl:
        return ServeControl(self.dashboard_url)

    def deploy(self, applications: list[dict[str, Any]], timeout_s: float = 180.0) -> None:
        """Deploy declaratively (REST PUT) and wait until every application is RUNNING: a
        declaratively deployed app is one whose user_configs the controller may change."""
        control = self.serve_control()
        try:
            control.apply(
                {
                    "http_options": {"host": "127.0.0.1", "port": self.http_port},
                    "applications": applications,
                }
            )
            names = [app["name"] for app in applications]
            apps: dict[str, Any] = {}

            def not_up() -> RuntimeError:
                statuses = {n: (apps.get(n) or {}).get("status") for n in names}
                messages = {n: (apps.get(n) or {}).get("message") for n in names}
                return RuntimeError(f"deploy did not come up: {statuses} {messages}")

            def running() -> bool:
                apps.clear()
                apps.update(control.details().get("applications") or {})
                statuses = [(apps.get(name) or {}).get("status") for name in names]
                if "DEPLOY_FAILED" in statuses:  # not in retry_on: ends the wait at once
                    raise not_up()
                return all(status == "RUNNING" for status in statuses)

            try:
                wait_until(running, timeout_s, f"applications {names} RUNNING")
            except WaitTimeout:
                raise not_up() from None
        finally:
            control.close()

    @staticmethod
    def stop(*, graceful: bool = True) -> None:
        """Stop what ``start`` started. ``graceful``: Serve's applications are deleted first
        (each replica drains its requests); without it the cluster's processes end at once,
        which a test session that is done with every application can afford."""
        import ray
        from ray import serve

        try:
            if graceful:
                serve.shutdown()
        finally:
            ray.shutdown()
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
