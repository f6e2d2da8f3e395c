"""The exit codes docs/operating.md documents, from the installed ``rollout`` binary run as a
subprocess, as scripts and pipelines run it (SQLite registry; no cluster needed)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollout.local.cluster import free_port
from tests.integration.manifests import ManifestRef
from tests.integration.servable_manifests import write_servable_manifest

ROLLOUT = str(Path(sys.executable).with_name("rollout"))


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def registry(tmp_path: Path) -> tuple[str, ManifestRef]:
    """An SQLite registry with ranker-v41 registered and approved."""
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    ref = write_servable_manifest(tmp_path / "ranker-v41", "ranker-v41")
    for args in (
        ("init",),
        ("register", ref.uri, "--sha256", ref.sha256),
        ("approve", "ranker-v41", "--reason", "eval ok"),
    ):
        done = rollout("registry", "--db", db, *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    return db, ref


def test_a_lost_compare_and_set_exits_4_and_says_so(
    registry: tuple[str, ManifestRef], tmp_path: Path
) -> None:
    db, _ = registry
    publish = ("registry", "--db", db, "publish", "stable", "ranker-v41", "--reason", "r")
    first = rollout(*publish, "--expected-revision", "0", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    stale = rollout(*publish, "--expected-revision", "0", cwd=tmp_path)
    assert stale.returncode == 4, (stale.returncode, stale.stderr)
    assert stale.stderr.startswith("error[registry.conflict]:") and "Traceback" not in stale.stderr


def test_of_racing_publishers_at_one_revision_one_wins_and_the_others_exit_4(
    registry: tuple[str, ManifestRef], tmp_path: Path
) -> None:
    db, _ = registry
    publish = (
        "registry", "--db", db, "publish", "stable", "ranker-v41",
        "--expected-revision", "0", "--reason", "race",
    )  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(lambda _: rollout(*publish, cwd=tmp_path).returncode, range(8)))
    assert codes == [0] + [4] * 7


@pytest.mark.parametrize(
    ("args", "code", "category"),
    [
        (("publish", "stable", "ranker-v99", "--expected-revision", "0", "--reason", "r"), 5, None),
        (("approve", "ranker-v99"), 5, "registry.not_found"),
        (("nosuch-command",), 2, None),
        (("publish", "stable", "ranker-v41", "--reason", "r"), 2, None),  # no revision
    ],
)
def test_registry_refusals_exit_with_their_category(
    registry: tuple[str, ManifestRef],
    tmp_path: Path,
    args: tuple[str, ...],
    code: int,
    category: str | None,
) -> None:
    db, _ = registry
    done = rollout("registry", "--db", db, *args, cwd=tmp_path)
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    if category is not None:
        assert done.stderr.startswith(f"error[{category}]:"), done.stderr


def test_re_registering_an_id_with_another_digest_exits_5(
    registry: tuple[str, ManifestRef], tmp_path: Path
) -> None:
    db, _ = registry
    other = write_servable_manifest(tmp_path / "again", "ranker-v41", weights_digest="cd" * 32)
    done = rollout(
        "registry", "--db", db, "register", other.uri, "--sha256", other.sha256, cwd=tmp_path
    )
    assert done.returncode == 5, (done.returncode, done.stderr)
    assert done.stderr.startswith("error[registry.digest_mismatch]:"), done.stderr


def test_an_unknown_registry_scheme_is_a_configuration_error(tmp_path: Path) -> None:
    for args in (
        ("registry", "--db", "mysql://x/y", "targets"),
        ("history", "--db", "mysql://x/y"),
    ):
        done = rollout(*args, cwd=tmp_path)
        assert done.returncode == 6, (args, done.returncode, done.stderr)
        assert done.stderr.startswith("error[config]:"), done.stderr


def test_a_rejected_artifact_exits_3_with_one_line(
    registry: tuple[str, ManifestRef], tmp_path: Path
) -> None:
    _, ref = registry
    done = rollout(
        "verify", ref.uri, "--sha256", "0" * 64, "--cache", str(tmp_path / "cache"), cwd=tmp_path
    )
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert done.stderr.startswith("rejected: manifest_digest:"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_registry_out_of_reach_exits_7_from_every_command_in_one_line(tmp_path: Path) -> None:
    # Nothing listens on the port: the driver's refusal is an outage, retryable, the same
    # code from the registry's own history and from the rollout history.
    down = f"postgresql://ranker@127.0.0.1:{free_port()}/registry"
    for args in (("registry", "--db", down, "history"), ("history", "--db", down)):
        done = rollout(*args, cwd=tmp_path)
        assert done.returncode == 7, (args, done.returncode, done.stderr)
        assert done.stderr.startswith("error[registry.unavailable]:"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("port", ["pa", "99999"])
def test_a_registry_url_the_driver_can_never_use_is_a_config_error(
    tmp_path: Path, port: str
) -> None:
    # "Retry later" (7) would be wrong: no retry makes the port a number.
    done = rollout("registry", "--db", f"postgresql://u:pw@127.0.0.1:{port}/x", "history",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 6, (done.returncode, done.stderr)
    assert done.stderr.startswith("error[config]: registry URL refused by the driver"), done.stderr


def test_a_registry_server_that_is_down_is_unavailable(tmp_path: Path) -> None:
    done = rollout(
        "registry", "--db", f"postgresql://u:pw@127.0.0.1:{free_port()}/x", "history", cwd=tmp_path
    )
    assert done.returncode == 7, (done.returncode, done.stderr)
    assert done.stderr.startswith("error[registry.unavailable]:"), done.stderr


def test_the_binary_and_python_dash_m_say_the_installed_version() -> None:
    from importlib.metadata import version

    expected = f"rollout, version {version('ray-rollout')}"
    for argv in ([ROLLOUT, "--version"], [sys.executable, "-m", "rollout", "--version"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (argv, proc.stderr)
        assert proc.stdout.strip() == expected, (argv, proc.stdout)
    # The same command as the binary: its usage errors exit 2 the same way.
    unknown = subprocess.run([sys.executable, "-m", "rollout", "no-such-command"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert unknown.returncode == 2 and "No such command" in unknown.stderr
