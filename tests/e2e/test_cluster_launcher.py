"""cluster.yaml as the Ray cluster launcher uses it: Ray's own validation, the file sync with
the launcher's own rsync arguments, and the head's and a worker's start commands run as
written on this machine (a head with token auth and the metrics interval, a worker joining it
with the synced token), then `rollout controller start` on that cluster.

What the launcher does on a VM and this test cannot (ssh, `ray stop`, which kills every Ray
process on the machine, and the autoscaler's bootstrap config, which `ray up` writes) is
left out, and the test says so where it leaves it out. The commands get only isolation
arguments on top (free ports, a temp dir, one CPU), so that this cluster shares nothing
with others on the machine; it is stopped by the PIDs of its processes, found by its temp dir
(rollout.local.multinode's way).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.app import PROJECT_ROOT
from rollout.local.cluster import free_port
from rollout.local.multinode import stop_cluster_processes

pytestmark = pytest.mark.cluster

VENV_BIN = Path(sys.executable).parent
ROLLOUT = str(VENV_BIN / "rollout")
REMOTE_VENV_RAY = "~/ranker/.venv/bin/ray"
HANG_GUARD_S = 120


def cluster_yaml() -> dict[str, Any]:
    return yaml.safe_load((PROJECT_ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_passes_the_launchers_own_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(cluster_yaml())  # what `ray up` does before it validates
    validate_config(config)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # no replica or router lands on the head


def test_files_go_under_the_ssh_users_home_with_the_token_among_them() -> None:
    """The launcher syncs as the SSH user (not root): a remote path outside its home fails
    the sync. Every local source is a path of the checkout or one docs/deploying.md makes."""
    config = cluster_yaml()
    # Where Ray's token loader looks on every node: the token `ray up` was run with.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for remote, local in config["file_mounts"].items():
        assert remote.startswith("~/"), remote
        if local == ".":
            continue
        assert local.startswith(("./var/", "~/.ray/")), local  # made by docs/deploying.md's steps


def test_the_checkout_syncs_without_local_state(tmp_path: Path) -> None:
    """rsync with the very arguments the launcher builds from cluster.yaml: the checkout
    arrives without .venv (its install stamp would skip the node's install), ./var and .git."""
    if shutil.which("rsync") is None:
        pytest.fail("rsync is missing (scripts/test.sh installs it; the launcher needs it)")
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    config = cluster_yaml()
    options = {"rsync_exclude": config["rsync_exclude"], "rsync_filter": config["rsync_filter"]}
    # A method that reads only its options: Ray's own filter arguments, no SSH involved.
    filters = SSHCommandRunner._create_rsync_filter_args(None, options)  # type: ignore[arg-type]
    dest = tmp_path / "ranker"
    assert config["file_mounts"]["~/ranker"] == "."
    # The launcher syncs a directory's contents (a trailing slash on both sides).
    subprocess.run(
        ["rsync", "-a", *filters, f"{PROJECT_ROOT}/", f"{dest}/"],
        check=True, capture_output=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert (dest / "scripts" / "setup.sh").is_file() and (dest / "pyproject.toml").is_file()
    assert (dest / "configs" / "serve.yaml").is_file()
    shipped = {p.relative_to(dest).parts[0] for p in dest.rglob("*")}
    assert not shipped & {".venv", "var", ".git"}, shipped
    assert not list(dest.rglob("__pycache__")) and not list(dest.rglob("*.egg-info"))


def _commands(key: str) -> list[str]:
    """The node's start commands without `ray stop` (which would stop every Ray process on
    this machine); each must be there, first, as on a VM."""
    commands = [" ".join(c.split()) for c in cluster_yaml()[key]]
    assert commands[0] == f"{REMOTE_VENV_RAY} stop", commands
    return commands[1:]


def _runnable(command: str, extra: list[str], ports: dict[str, str]) -> str:
    """A start command as this machine runs it: the project's venv for the node's, this
    test's ports for the fixed ones, the isolation arguments appended. The autoscaler's
    config (written by `ray up` on the head) is left out: there is no cloud to scale here."""
    command = command.replace(REMOTE_VENV_RAY, shlex.quote(str(VENV_BIN / "ray")))
    for fixed, free in ports.items():
        assert fixed in command, (fixed, command)
        command = command.replace(fixed, free)
    parts = command.split(" --autoscaling-config=~/ray_bootstrap_config.yaml")
    return " ".join([parts[0] + "".join(parts[1:]), *map(shlex.quote, extra)])


def _isolation(temp_dir: str) -> list[str]:
    return [
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}",
        "--disable-usage-stats",
    ]


@pytest.fixture
def token_home() -> Iterator[Path]:
    """The home of the machine `ray up` runs from, and of the nodes it syncs to: the token
    made as docs/deploying.md says (`ray get-auth-token --generate`) is ~/.ray/auth_token."""
    home = Path(tempfile.mkdtemp(prefix="ranker-home-"))
    try:
        done = subprocess.run(
            [str(VENV_BIN / "ray"), "get-auth-token", "--generate"],
            env={**os.environ, "HOME": str(home)}, capture_output=True, text=True,
            timeout=HANG_GUARD_S,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (home / ".ray" / "auth_token").read_text().strip() == done.stdout.strip()
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _node_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ROLLOUT_"))}
    return {**env, "HOME": str(home)}


def _run(command: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-4000:])


def _driver(address: str, env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    script = (
        "import json, ray\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n" + code + "\nray.shutdown()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True,
        timeout=HANG_GUARD_S,
    )  # fmt: skip


def test_the_start_commands_bring_up_a_token_cluster_the_controller_reads(
    token_home: Path, tmp_path: Path
) -> None:
    # Short: Ray's Unix socket paths live under it and have a length limit.
    temp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    gcs, dashboard = free_port(), free_port()
    try:
        head_env = {**_node_env(token_home), "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 0})}
        for command in _commands("head_start_ray_commands"):
            ports = {
                "--port=6379": f"--port={gcs}",
                "--metrics-export-port=8080": f"--metrics-export-port={free_port()}",
            }
            extra = [*_isolation(temp_dir), f"--dashboard-port={dashboard}",
                     f"--ray-client-server-port={free_port()}"]  # fmt: skip
            _run(_runnable(command, extra, ports), head_env)
        # The worker is another machine: a home of its own, with the token as the launcher
        # syncs it there. Its commands get RAY_HEAD_IP and its node type's resources.
        worker_home = tmp_path / "worker-home"
        (worker_home / ".ray").mkdir(parents=True)
        shutil.copy2(token_home / ".ray" / "auth_token", worker_home / ".ray" / "auth_token")
        worker_env = {
            **_node_env(worker_home),
            "RAY_HEAD_IP": "127.0.0.1",
            "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 1}),
        }
        for command in _commands("worker_start_ray_commands"):
            ports = {
                ":6379 ": f":{gcs} ",
                "--metrics-export-port=8080": f"--metrics-export-port={free_port()}",
            }
            _run(_runnable(command, _isolation(temp_dir), ports), worker_env)

        address = f"127.0.0.1:{gcs}"
        client = {**_node_env(token_home), "RAY_AUTH_MODE": "token"}
        seen = _driver(
            address,
            client,
            "nodes = [n for n in ray.nodes() if n['Alive']]\n"
            "print(json.dumps(sorted(n['Resources'].get('CPU', 0) for n in nodes)))",
        )
        assert seen.returncode == 0, seen.stderr[-4000:]
        assert json.loads(seen.stdout.strip().splitlines()[-1]) == [0, 1]  # head, worker

        # Without the cluster's token nobody gets in.
        wrong = _driver(address, {**client, "RAY_AUTH_TOKEN": "not-the-token"}, "print('in')")
        assert wrong.returncode != 0 and "in" not in wrong.stdout.split()

        # The controller on this cluster reads its metrics interval (cluster.yaml's 2 s).
        db = f"sqlite:///{tmp_path / 'registry.db'}"
        common = ["--address", address, "--timeout", "90", "--json"]
        started = subprocess.run(
            [ROLLOUT, "controller", "start", *common, "--db", db,
             "--dashboard", f"http://127.0.0.1:{dashboard}"],
            env=client, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr[-4000:]
        ping = json.loads(started.stdout)
        assert ping["metrics_export_interval_s"] == 2.0
        assert ping["window_delay_s"] == pytest.approx(2.65)  # 0.25 s flush + 1.2 x 2 s
    finally:
        stop_cluster_processes(temp_dir)
        time.sleep(0.5)
        shutil.rmtree(temp_dir, ignore_errors=True)
