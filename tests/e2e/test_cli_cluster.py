"""Commands that talk to the cluster, as the installed binary: they never create the
controller (only `rollout controller start` and `rollout start` do), and they end with one
line within `--timeout` when no cluster answers. Each subprocess has its own timeout as a
hang guard: a hang fails the test instead of stalling the suite.

The cluster is a real local Ray (no Serve), started by a child process of this test and
stopped with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.cluster import CONTROLLER_MISSING
from rollout.local.cluster import free_port

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
HANG_GUARD_S = 90
# A new local Ray cluster turns token auth on (Ray 2.60); a client attaching by address
# needs the mode said (the token is the user's ~/.ray/auth_token).
TOKEN_AUTH = {"RAY_AUTH_MODE": "token"}

# Starts a Ray node of its own on a free GCS port, says it is up, and stops it (ray.shutdown
# at exit) when its stdin closes.
CLUSTER_SCRIPT = """
import logging, os, sys
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="rollout",
         log_to_driver=False, logging_level=logging.WARNING)
print("up", flush=True)
sys.stdin.read()
"""

CONTROLLER_COMMANDS = (
    ("status",),
    ("status", "--watch"),
    ("pause", "--reason", "r"),
    ("resume",),
    ("promote",),
    ("abort",),
    ("rollback",),
    ("controller", "status"),
    ("controller", "stop"),
)


def rollout(*args: str, cwd: Path, env: dict[str, str] | None = None):
    return subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


def one_line(done: subprocess.CompletedProcess[str], code: int, category: str) -> str:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error[{category}]: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-c", CLUSTER_SCRIPT],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **TOKEN_AUTH, "RAY_GCS_SERVER_PORT": str(port)},
        cwd=tmp_path_factory.mktemp("ray"),
    )  # fmt: skip
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "up"
        yield f"127.0.0.1:{port}"
    finally:
        assert node.stdin is not None
        node.stdin.close()
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()  # only the process this test started
            node.wait()


def test_no_command_creates_the_controller(ray_address: str, tmp_path: Path) -> None:
    """Each of CONTROLLER_COMMANDS as its own process, all at once (each attaches to the
    cluster: about 4 s apiece one after another, with a CPU idle most of it). With a dashboard
    and a registry given, everything a controller needs is there: still none is created, and
    no registry file either."""
    runs = []
    for i, args in enumerate(CONTROLLER_COMMANDS):
        cwd = tmp_path / f"command-{i}"
        cwd.mkdir()
        db = cwd / "registry.db"
        creatable = ("--dashboard", "http://127.0.0.1:9", "--db", f"sqlite:///{db}")
        child = subprocess.Popen(
            [ROLLOUT, *args, "--address", ray_address, *creatable], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **TOKEN_AUTH},
        )  # fmt: skip
        runs.append((args, db, child))
    for args, db, child in runs:
        try:
            out, err = child.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            child.kill()  # only the process this test started
            out, err = child.communicate()
        done = subprocess.CompletedProcess(child.args, child.returncode, out, err)
        line = one_line(done, 5, "controller.not_found")
        assert line == f"error[controller.not_found]: {CONTROLLER_MISSING}", args
        assert not db.exists(), args
    # Still none: no command above left one behind.
    again = rollout("controller", "status", "--address", ray_address, cwd=tmp_path, env=TOKEN_AUTH)
    one_line(again, 5, "controller.not_found")


def test_nothing_listening_at_the_address_fails_at_once_in_one_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    for args in (("status",), ("controller", "status"), ("pause",), ("controller", "start")):
        done = rollout(*args, "--address", address, cwd=tmp_path)
        line = one_line(done, 7, "cluster.unavailable")
        assert address in line and "Traceback" not in done.stderr


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP port that accepts connections and never says a word (not a Ray GCS)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_cluster_that_does_not_answer_fails_after_the_timeout(
    silent_server: str, tmp_path: Path
) -> None:
    done = rollout("status", "--address", silent_server, "--timeout", "3", cwd=tmp_path)
    line = one_line(done, 7, "cluster.unavailable")
    assert "within 3s" in line, line


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e9", "x"])
def test_a_bad_timeout_is_a_usage_error(tmp_path: Path, value: str) -> None:
    done = rollout("status", "--timeout", value, cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "--timeout" in done.stderr and "Traceback" not in done.stderr


def test_keep_creates_the_controller_whenever_it_is_gone_and_stops_on_sigterm(
    ray_address: str, tmp_path: Path
) -> None:
    """`rollout controller keep`, as the RayService's sidecar runs it: the controller is
    created, created again after it was stopped (as on a new head without GCS fault
    tolerance), and SIGTERM (the pod stopping) ends the command with 0."""
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    keep = subprocess.Popen(
        [ROLLOUT, "controller", "keep", "--every", "1", "--address", ray_address,
         "--dashboard", "http://127.0.0.1:9", "--db", db],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **TOKEN_AUTH},
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(keep.stdout.readline, "")), daemon=True
    )
    reader.start()
    try:

        def said(n: int) -> list[dict]:
            deadline = time.monotonic() + HANG_GUARD_S
            while len(lines) < n:
                assert keep.poll() is None, (keep.returncode, keep.stderr.read())
                assert time.monotonic() < deadline, f"{n} lines not said: {lines}"
                time.sleep(0.2)
            return [json.loads(line) for line in lines[:n]]

        (first,) = said(1)
        assert first["controller"] == "created" and first["pid"] > 0, first
        running = rollout("controller", "status", "--address", ray_address, "--json",
                          cwd=tmp_path, env=TOKEN_AUTH)  # fmt: skip
        assert running.returncode == 0 and json.loads(running.stdout)["pid"] == first["pid"]

        stopped = rollout("controller", "stop", "--address", ray_address, cwd=tmp_path,
                          env=TOKEN_AUTH)  # fmt: skip
        assert stopped.returncode == 0, stopped.stderr
        _, second = said(2)
        assert second["controller"] == "created" and second["pid"] != first["pid"], second
        assert len(lines) == 2, lines  # nothing said while the same controller runs

        keep.send_signal(signal.SIGTERM)
        assert keep.wait(timeout=HANG_GUARD_S) == 0, keep.stderr.read()
    finally:
        if keep.poll() is None:
            keep.kill()  # only the process this test started
            keep.wait()
        # The module's other tests need a cluster without a controller.
        rollout("controller", "stop", "--address", ray_address, cwd=tmp_path, env=TOKEN_AUTH)
