"""`rollout registry ...` through click's CliRunner, on both backends: exit codes, tables,
--json, and one error line instead of a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from rollout.cli.registry import registry_group
from tests.integration.backends import Backend
from tests.integration.manifests import MakeManifest, ManifestRef
from tests.integration.servable_manifests import write_servable_manifest


@pytest.fixture
def make_manifest(tmp_path: Path) -> MakeManifest:
    """Manifests the service could serve: the CLI refuses to register anything else."""
    counter = iter(range(1_000_000))

    def make(artifact_id: str, **kwargs: Any) -> ManifestRef:
        directory = tmp_path / "manifests" / f"{artifact_id}-{next(counter)}"
        return write_servable_manifest(directory, artifact_id, **kwargs)

    return make


@pytest.fixture(autouse=True)
def initialised(request: pytest.FixtureRequest) -> None:
    """The registry exists (`init`): no other command creates one."""
    if "backend" in request.fixturenames:
        backend: Backend = request.getfixturevalue("backend")
        assert run(backend.url, "init").exit_code == 0


def run(url: str, *args: str) -> Result:
    return CliRunner().invoke(registry_group, ["--db", url, *args], catch_exceptions=False)


def test_register_approve_publish_targets_history(
    backend: Backend, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("ranker-v41")
    assert run(backend.url, "init").exit_code == 0

    registered = run(backend.url, "register", ref.uri, "--sha256", ref.sha256)
    assert registered.exit_code == 0, registered.output
    assert "ranker-v41" in registered.stdout and "pending" in registered.stdout

    approved = run(backend.url, "approve", "ranker-v41", "--actor", "bob")
    assert approved.exit_code == 0 and "ready" in approved.stdout

    published = run(
        backend.url, "publish", "stable", "ranker-v41", "--expected-revision", "0",
        "--reason", "first", "--actor", "bob", "--approval", "CHG-1",
    )  # fmt: skip
    assert published.exit_code == 0, published.output
    assert published.stdout.splitlines()[0].split() == [
        "COHORT", "REVISION", "ARTIFACT", "MANIFEST_SHA256", "UPDATED",
    ]  # fmt: skip
    assert published.stdout.splitlines()[1].split()[:3] == ["stable", "1", "ranker-v41"]

    targets = json.loads(run(backend.url, "--json", "targets").stdout)
    assert [(t["cohort"], t["revision"], t["artifact_id"]) for t in targets] == [
        ("stable", 1, "ranker-v41")
    ]
    assert targets[0]["manifest_sha256"] == ref.sha256

    history = json.loads(run(backend.url, "--json", "history").stdout)
    assert [(h["actor"], h["reason"], h["approval"], h["new_revision"]) for h in history] == [
        ("bob", "first", "CHG-1", 1)
    ]
    assert "ranker-v41" in run(backend.url, "history").stdout


def test_a_lost_compare_and_set_exits_4_and_prints_the_current_revision(
    backend: Backend, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("v1")
    run(backend.url, "register", ref.uri, "--sha256", ref.sha256, "--ready")
    args = ("publish", "stable", "v1", "--expected-revision", "0", "--reason", "r")
    assert run(backend.url, *args).exit_code == 0

    lost = run(backend.url, *args)

    assert lost.exit_code == 4
    assert lost.stderr.startswith("error[registry.conflict]: ")
    assert "current revision is 1" in lost.stderr
    assert "Traceback" not in lost.output
    as_json = run(backend.url, "--json", *args)
    assert as_json.exit_code == 4
    payload = json.loads(as_json.stdout)
    assert payload["error"] == "registry.conflict"
    assert payload["current"]["revision"] == 1


def test_unknown_unready_and_other_digest_exit_5(
    backend: Backend, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("v1")
    run(backend.url, "register", ref.uri, "--sha256", ref.sha256)
    publish = ("--expected-revision", "0", "--reason", "r")

    unknown = run(backend.url, "publish", "canary", "v9", *publish)
    assert (unknown.exit_code, unknown.stderr.split(":")[0]) == (5, "error[registry.not_found]")

    pending = run(backend.url, "publish", "canary", "v1", *publish)
    assert pending.exit_code == 5
    assert pending.stderr.startswith("error[registry.invalid_state]: ")

    other = make_manifest("v1", weights_digest="cd" * 32)
    mismatch = run(backend.url, "register", other.uri, "--sha256", other.sha256)
    assert mismatch.exit_code == 5
    assert mismatch.stderr.startswith("error[registry.digest_mismatch]: ")

    rejected = run(backend.url, "reject", "v1", "--reason", "bad eval")
    assert rejected.exit_code == 0 and "rejected" in rejected.stdout
    assert run(backend.url, "approve", "v1").exit_code == 5


def test_a_manifest_that_fails_its_pinned_digest_exits_3(
    backend: Backend, make_manifest: MakeManifest
) -> None:
    ref = make_manifest("v1")

    result = run(backend.url, "register", ref.uri, "--sha256", "f" * 64)

    assert result.exit_code == 3
    assert result.stderr.startswith("rejected: manifest_digest: ")
    assert json.loads(run(backend.url, "--json", "artifacts").stdout) == []


@pytest.mark.parametrize(
    "args",
    [
        ("publish", "blue", "v1", "--expected-revision", "0", "--reason", "r"),
        ("publish", "stable", "v1", "--expected-revision", "-1", "--reason", "r"),
        ("publish", "stable", "v1", "--expected-revision", "0"),
        ("register", "file:///x/manifest.json", "--sha256", "not-hex"),
        ("reject", "v1"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    result = CliRunner().invoke(registry_group, ["--db", f"sqlite:///{tmp_path}/r.db", *args])
    assert result.exit_code == 2, result.output


def test_db_defaults_to_rollout_db_then_var_registry_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ROLLOUT_DB", raising=False)
    assert CliRunner().invoke(registry_group, ["init"]).exit_code == 0
    assert (tmp_path / "var" / "registry.db").is_file()

    elsewhere = tmp_path / "elsewhere" / "r.db"
    monkeypatch.setenv("ROLLOUT_DB", f"sqlite:///{elsewhere}")
    result = CliRunner().invoke(registry_group, ["--json", "init"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["db"] == f"sqlite:///{elsewhere}"
    assert elsewhere.is_file()


def test_an_unsupported_url_is_one_error_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(registry_group, ["--db", "mysql://x/y", "targets"])
    assert result.exit_code == 6  # a configuration error, as from every other command
    assert result.stderr.startswith("error[config]: registry URL scheme 'mysql'")
