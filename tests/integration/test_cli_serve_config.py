"""`rollout registry serve-config`, as the installed binary: the Serve config and the
RayService manifest that get deployed are rendered from the registry's targets, and pass
Ray's own schema and the replicas' argument contract; a template deployed unrendered, or a
registry with nothing to serve, is refused with its field or its cause named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from app.contracts import AppArgs
from deployments.app import PROJECT_ROOT
from tests.integration.servable_manifests import write_servable_manifest

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
SERVE_YAML = str(PROJECT_ROOT / "configs" / "serve.yaml")
RAYSERVICE_YAML = str(PROJECT_ROOT / "configs" / "kuberay" / "rayservice.yaml")


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert "Traceback" not in done.stderr
    return done


@pytest.fixture
def db(tmp_path: Path) -> tuple[str, ...]:
    """A registry whose stable target moved on from the template's: ranker-v42 at revision
    2 (v41 before it), and ranker-lite-v1 ready."""
    db = ("registry", "--db", f"sqlite:///{tmp_path / 'registry.db'}")
    assert rollout(*db, "init", cwd=tmp_path).returncode == 0
    for artifact_id in ("ranker-v41", "ranker-v42", "ranker-lite-v1"):
        ref = write_servable_manifest(tmp_path / artifact_id, artifact_id)
        done = rollout(*db, "register", ref.uri, "--sha256", ref.sha256, "--ready", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    for revision, artifact_id in enumerate(("ranker-v41", "ranker-v42")):
        done = rollout(*db, "publish", "stable", artifact_id, "--expected-revision",
                       str(revision), "--reason", "r", cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
    return db


def registry_digest(db: tuple[str, ...], artifact_id: str, cwd: Path) -> str:
    import json

    records = json.loads(rollout(*db, "--json", "artifacts", cwd=cwd).stdout)
    return next(r["manifest_sha256"] for r in records if r["artifact_id"] == artifact_id)


def test_the_template_as_shipped_is_refused_naming_the_digest() -> None:
    doc = yaml.safe_load(Path(SERVE_YAML).read_text())
    with pytest.raises(ValueError) as refused:
        AppArgs.model_validate(doc["applications"][0]["args"])
    assert "stable.target.manifest_sha256" in str(refused.value)


def test_the_rendered_serve_config_deploys_what_the_registry_says(
    db: tuple[str, ...], tmp_path: Path
) -> None:
    out = tmp_path / "serve.deploy.yaml"
    done = rollout(*db, "serve-config", SERVE_YAML, "--fallback", "ranker-lite-v1",
                   "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("# Rendered from serve.yaml by `rollout registry serve-config`")
    doc = yaml.safe_load(text)
    ServeDeploySchema.model_validate(doc)
    args = AppArgs.model_validate(doc["applications"][0]["args"])
    assert args.stable.target is not None and args.fallback is not None
    assert args.fallback.target is not None
    assert (args.stable.target.artifact_id, args.stable.target.revision) == ("ranker-v42", 2)
    assert args.stable.target.manifest_sha256 == registry_digest(db, "ranker-v42", tmp_path)
    assert args.fallback.target.manifest_sha256 == registry_digest(db, "ranker-lite-v1", tmp_path)
    assert args.canary.target is None
    # Everything else is the template's.
    template = yaml.safe_load(Path(SERVE_YAML).read_text())["applications"][0]["args"]
    rendered = doc["applications"][0]["args"]
    for key in ("router", "batching", "memory", "cache_dir", "trust_key"):
        assert rendered[key] == template[key]


def test_the_rayservice_is_rendered_inside_its_serve_config(
    db: tuple[str, ...], tmp_path: Path
) -> None:
    done = rollout(*db, "serve-config", RAYSERVICE_YAML, "--fallback", "ranker-lite-v1",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load(done.stdout)
    original = yaml.safe_load(Path(RAYSERVICE_YAML).read_text())
    assert manifest["kind"] == "RayService"
    assert manifest["spec"]["rayClusterConfig"] == original["spec"]["rayClusterConfig"]
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    args = AppArgs.model_validate(serve["applications"][0]["args"])
    assert args.stable.target is not None and args.stable.target.revision == 2
    assert args.stable.target.manifest_sha256 == registry_digest(db, "ranker-v42", tmp_path)


def test_nothing_to_serve_or_no_fallback_named_is_refused_in_one_line(tmp_path: Path) -> None:
    db = ("registry", "--db", f"sqlite:///{tmp_path / 'registry.db'}")
    assert rollout(*db, "init", cwd=tmp_path).returncode == 0
    empty = rollout(*db, "serve-config", SERVE_YAML, "--fallback", "x", cwd=tmp_path)
    assert empty.returncode == 5 and empty.stdout == "", (empty.returncode, empty.stderr)
    assert empty.stderr.startswith("error[registry.not_found]: ") and "stable" in empty.stderr

    ref = write_servable_manifest(tmp_path / "v41", "ranker-v41")
    rollout(*db, "register", ref.uri, "--sha256", ref.sha256, "--ready", cwd=tmp_path)
    rollout(*db, "publish", "stable", "ranker-v41", "--expected-revision", "0",
            "--reason", "first", cwd=tmp_path)  # fmt: skip
    no_fallback = rollout(*db, "serve-config", SERVE_YAML, cwd=tmp_path)
    assert no_fallback.returncode == 6, no_fallback.stderr
    assert no_fallback.stderr.startswith("error[config]: ") and "--fallback" in no_fallback.stderr
