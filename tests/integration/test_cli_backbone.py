"""Backbone and head artifacts through the installed ``rollout`` binary, as a release
pipeline drives them: pack a backbone and a head on it, verify and load the head (its
backbone fetched from beside it), and the registry's refusal to publish a head on a backbone
that is not ready. Errors exit with their category, one line, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from app.demo_artifacts import write_split_source
from app.manifest import MANIFEST_NAME, Architecture, parse_manifest, sha256_hex

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
EXIT_REJECTED, EXIT_NOT_FOUND = 3, 5
ARCH = Architecture(
    name="ranker-mlp", version=1, params={"hidden_dim": 16, "num_layers": 2, "context_dim": 4}
)


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert "Traceback" not in done.stdout + done.stderr
    return done


def pack(tmp: Path, name: str, *extra: str) -> dict[str, str]:
    done = rollout(
        "pack", str(tmp / "src" / name), "--model", "ranker", "--artifact-id", name,
        "--feature-schema", "ranker-features-v3", "--out", str(tmp / "store" / name),
        "--json", *extra, cwd=tmp,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    packed: dict[str, str] = json.loads(done.stdout)
    return packed


def test_pack_verify_and_load_a_head_on_its_backbone(tmp_path: Path) -> None:
    write_split_source(tmp_path / "src" / "rb-1", ARCH, seed=1, kind="backbone")
    write_split_source(tmp_path / "src" / "head-a", ARCH, seed=2, kind="head")
    backbone = pack(tmp_path, "rb-1", "--backbone-only")
    assert backbone["kind"] == "backbone"
    head = pack(tmp_path, "head-a", "--backbone", str(tmp_path / "store" / "rb-1"))
    assert head["kind"] == "head"
    manifest = parse_manifest((tmp_path / "store" / "head-a" / MANIFEST_NAME).read_bytes())
    assert manifest.backbone is not None
    assert manifest.backbone.manifest_sha256 == backbone["manifest_sha256"]

    done = rollout(
        "verify", head["manifest_uri"], "--sha256", head["manifest_sha256"],
        "--cache", str(tmp_path / "cache"), "--load", "--json", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)["loaded"]
    assert loaded["backbone"] == "rb-1"

    # A head pinning a backbone that is not beside it: refused, naming the backbone.
    shutil.rmtree(tmp_path / "store" / "rb-1")
    done = rollout(
        "verify", head["manifest_uri"], "--sha256", head["manifest_sha256"],
        "--cache", str(tmp_path / "cache-2"), "--load", "--json", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EXIT_REJECTED, done.stderr
    assert done.stderr.strip().startswith("rejected: missing: head pins backbone rb-1")
    # --backbone names a directory that holds no backbone.
    done = rollout(
        "pack", str(tmp_path / "src" / "head-a"), "--model", "ranker", "--artifact-id", "h2",
        "--feature-schema", "ranker-features-v3", "--out", str(tmp_path / "store" / "h2"),
        "--backbone", str(tmp_path / "store" / "head-a"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0 and "is a head artifact, not a backbone" in done.stderr


def test_the_registry_publishes_a_head_only_on_its_ready_backbone(tmp_path: Path) -> None:
    write_split_source(tmp_path / "src" / "rb-1", ARCH, seed=1, kind="backbone")
    write_split_source(tmp_path / "src" / "head-a", ARCH, seed=2, kind="head")
    backbone = pack(tmp_path, "rb-1", "--backbone-only")
    head = pack(tmp_path, "head-a", "--backbone", str(tmp_path / "store" / "rb-1"))
    db = ("registry", "--db", f"sqlite:///{tmp_path / 'registry.db'}")
    assert rollout(*db, "init", cwd=tmp_path).returncode == 0
    done = rollout(*db, "register", head["manifest_uri"], "--sha256", head["manifest_sha256"],
                   "--ready", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    publish = (*db, "publish", "stable", "head-a", "--expected-revision", "0", "--reason", "r")
    done = rollout(*publish, cwd=tmp_path)
    assert done.returncode == EXIT_NOT_FOUND, done.stderr
    assert "backbone ranker/rb-1, which is not registered" in done.stderr
    done = rollout(*db, "register", backbone["manifest_uri"], "--sha256",
                   backbone["manifest_sha256"], cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = rollout(*publish, cwd=tmp_path)
    assert done.returncode == EXIT_NOT_FOUND and "pending, not ready" in done.stderr
    assert rollout(*db, "approve", "rb-1", "--reason", "ok", cwd=tmp_path).returncode == 0
    done = rollout(*publish, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    targets = json.loads(rollout(*db, "--json", "targets", cwd=tmp_path).stdout)
    assert [t["artifact_id"] for t in targets] == ["head-a"]
    digest = sha256_hex((tmp_path / "store" / "rb-1" / MANIFEST_NAME).read_bytes())
    assert digest == backbone["manifest_sha256"]
