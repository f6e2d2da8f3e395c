"""A throwaway Prometheus server for tests: Debian's ``prometheus`` binary scraping a Ray
cluster through a file_sd service-discovery file.

The configuration is generated from the one we ship (configs/observability/prometheus.yml), so
the test exercises that file's shape (job ``ray``, ``file_sd_configs``), with two changes: the
discovery file is the one of the cluster under test, and the scrape interval is short (1 s) so
a window of a few seconds holds enough samples. Storage, config and log live in a fresh
directory directly under /tmp; the server listens on a free loopback port. Prometheus runs as
root without complaint (unlike PostgreSQL), so no ``runuser``. A missing binary is an error,
never a skip: a PromQL source tested against nothing proves nothing.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.errors import WaitTimeout
from app.polling import wait_until
from rollout.local.cluster import free_port

PROMETHEUS_BIN = Path("/usr/bin/prometheus")
SHIPPED_CONFIG = Path(__file__).resolve().parent.parent / "configs/observability/prometheus.yml"
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 10.0


class PrometheusUnavailable(RuntimeError):
    """The Prometheus binary is not installed, or the server would not start."""


def find_binary() -> Path:
    if PROMETHEUS_BIN.is_file():
        return PROMETHEUS_BIN
    raise PrometheusUnavailable(
        f"{PROMETHEUS_BIN} not found. Install Debian's Prometheus server: "
        "apt-get install -y --no-install-recommends prometheus (scripts/test.sh does this)."
    )


def scrape_config(sd_file: Path, *, scrape_interval_s: float = 1.0) -> dict[str, Any]:
    """The shipped config with its ``ray`` job reading ``sd_file`` and a short interval."""
    config = copy.deepcopy(yaml.safe_load(SHIPPED_CONFIG.read_text()))
    interval = f"{round(scrape_interval_s * 1000)}ms"
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    config["global"]["scrape_timeout"] = interval  # may not exceed the interval
    ray_jobs = [job for job in config["scrape_configs"] if job.get("job_name") == "ray"]
    if len(ray_jobs) != 1:
        raise PrometheusUnavailable(f"{SHIPPED_CONFIG}: expected one scrape job named 'ray'")
    sd_configs = ray_jobs[0]["file_sd_configs"]
    if len(sd_configs) != 1:
        raise PrometheusUnavailable(f"{SHIPPED_CONFIG}: expected one file_sd_configs entry")
    # Prometheus watches the file (inotify) and also re-reads it every refresh_interval.
    sd_configs[0]["files"] = [str(sd_file)]
    sd_configs[0]["refresh_interval"] = interval
    return config


@dataclass(frozen=True)
class PrometheusServer:
    root: Path
    port: int
    process: subprocess.Popen[bytes]
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def log_file(self) -> Path:
        return self.root / "log"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (``/api/v1/targets``): scrapeUrl, health, lastError..."""
        body = httpx.get(f"{self.url}/api/v1/targets", timeout=5).json()
        return list(body["data"]["activeTargets"])


def _ready(server: PrometheusServer) -> bool:
    try:
        return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _launch(binary: Path, root: Path, config: dict[str, Any]) -> PrometheusServer:
    port = free_port()
    (root / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    with open(root / "log", "ab") as log:
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
    server = PrometheusServer(root=root, port=port, process=process)

    def ready() -> bool:
        if _ready(server):
            return True
        if process.poll() is not None:  # not in retry_on: ends the wait at once
            raise PrometheusUnavailable(
                f"prometheus exited with {process.returncode} on port {port}:\n{server.log_tail()}"
            )
        return False

    try:
        wait_until(ready, _START_TIMEOUT_S, f"prometheus ready on port {port}", every=0.1)
    except WaitTimeout:
        _terminate(process)
        raise PrometheusUnavailable(
            f"prometheus not ready after {_START_TIMEOUT_S}s:\n{server.log_tail()}"
        ) from None
    return server


def start_server(sd_file: Path, *, scrape_interval_s: float = 1.0) -> PrometheusServer:
    """Start a server scraping the targets of ``sd_file``. The caller must call
    :func:`stop_server`."""
    binary = find_binary()
    config = scrape_config(sd_file, scrape_interval_s=scrape_interval_s)
    root = Path(tempfile.mkdtemp(prefix="rollout-prom-", dir="/tmp"))
    # A free port can be taken by someone else between our probe and Prometheus' bind: the
    # server then exits at once, and another port is tried.
    errors: list[str] = []
    for _ in range(3):
        try:
            return _launch(binary, root, config)
        except PrometheusUnavailable as exc:
            errors.append(str(exc))
    shutil.rmtree(root, ignore_errors=True)
    raise PrometheusUnavailable("\n---\n".join(errors))


def _terminate(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_TIMEOUT_S)


def stop_server(server: PrometheusServer) -> None:
    """Stop exactly the process this module started (by its Popen handle), then remove its
    directory."""
    _terminate(server.process)
    shutil.rmtree(server.root, ignore_errors=True)


@contextmanager
def running_server(sd_file: Path, *, scrape_interval_s: float = 1.0) -> Iterator[PrometheusServer]:
    server = start_server(sd_file, scrape_interval_s=scrape_interval_s)
    try:
        yield server
    finally:
        stop_server(server)
