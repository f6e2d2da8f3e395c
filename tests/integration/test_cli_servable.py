"""What the service cannot serve is refused from the manifest alone: `rollout verify` without
`--load`, and `rollout registry register`, run as the installed binary (exit 3, one line)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from app.packing import PackResult
from tests import artifacts
from tests.artifacts import pack_for_model

ROLLOUT = str(Path(sys.executable).with_name("rollout"))

UNSERVABLE: list[tuple[Callable[[Path], PackResult], str, str]] = [
    (artifacts.wrong_schema_artifact, "schema", "feature schema"),
    (artifacts.unknown_runtime_artifact, "runtime", "unknown runtime"),
    (artifacts.unknown_precision_artifact, "runtime", "unknown precision"),
    (artifacts.unknown_architecture_artifact, "runtime", "unknown architecture"),
    # Servable by another deployment, not by this one (`--model`, default ranker).
    (lambda root: pack_for_model(root, "fraud-scorer"), "schema", "model 'fraud-scorer'"),
]


def servable_manifest(root: Path) -> PackResult:
    """An artifact this service can serve (registration reads only its manifest)."""
    return artifacts.good_artifact(root)


def rollout(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


def imported_packages(done: subprocess.CompletedProcess[str]) -> set[str]:
    """Top-level packages a process run with PYTHONPROFILEIMPORTTIME=1 imported (its stderr)."""
    return {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def assert_rejected(done: subprocess.CompletedProcess[str], category: str, words: str) -> None:
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rejected: {category}: "), done.stderr
    assert words in lines[0], lines[0]


@pytest.mark.parametrize(("build", "category", "words"), UNSERVABLE)
def test_verify_without_load_refuses_what_the_service_cannot_serve(
    tmp_path: Path, build: Callable[[Path], PackResult], category: str, words: str
) -> None:
    result = build(tmp_path / "art")
    done = rollout(
        "verify", result.manifest_uri, "--sha256", result.manifest_sha256,
        "--cache", str(tmp_path / "cache"), cwd=tmp_path,
    )  # fmt: skip
    assert_rejected(done, category, words)


@pytest.mark.parametrize(("build", "category", "words"), UNSERVABLE)
def test_register_refuses_what_the_service_cannot_serve(
    tmp_path: Path, build: Callable[[Path], PackResult], category: str, words: str
) -> None:
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    assert rollout("registry", "--db", db, "init", cwd=tmp_path).returncode == 0
    result = build(tmp_path / "art")
    done = rollout(
        "registry", "--db", db, "register", result.manifest_uri, "--sha256",
        result.manifest_sha256, cwd=tmp_path,
    )  # fmt: skip
    assert_rejected(done, category, words)
    listed = rollout("registry", "--db", db, "--json", "artifacts", cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed


def test_a_servable_artifact_verifies_and_registers_without_importing_torch(
    tmp_path: Path,
) -> None:
    # Both read manifests only: torch's import would be most of each command's time.
    profiled = {"PYTHONPROFILEIMPORTTIME": "1"}
    result = servable_manifest(tmp_path / "art")
    verified = rollout(
        "verify", result.manifest_uri, "--sha256", result.manifest_sha256,
        "--cache", str(tmp_path / "cache"), cwd=tmp_path, env=profiled,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    assert "torch" not in imported_packages(verified)
    assert "app" in imported_packages(verified)  # the profile is there to read
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    assert rollout("registry", "--db", db, "init", cwd=tmp_path).returncode == 0
    registered = rollout(
        "registry", "--db", db, "register", result.manifest_uri, "--sha256",
        result.manifest_sha256, cwd=tmp_path, env=profiled,
    )  # fmt: skip
    assert registered.returncode == 0, registered.stderr
    assert "torch" not in imported_packages(registered)
