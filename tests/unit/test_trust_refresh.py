"""Trust anchors replaced in place reach the running replica: a Kubernetes ConfigMap update of
the public key (how the RayService mounts it) or a revocation by a new key file changes what
the replica trusts at its next load or report, with no new user_config; anchors that cannot be
read refuse every load until they can, and the model serving stays. Each report carries the
digest of the anchors in force, and ``rollout status`` warns when replicas disagree.

Real packed artifacts signed with the project's ed25519 keys, a real replica and cache."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.contracts import ReplicaPhase, ReplicaRow, WireRequest
from app.manifest import MANIFEST_NAME, SIGNATURE_NAME
from app.models.ranker_mlp.features import NUM_FEATURES
from app.packing import PackResult
from app.polling import wait_until
from app.replica import RankerReplica
from app.signing import generate_keypair, sign_manifest
from rollout.cli.render import trust_disagreement
from tests.artifacts import pack_ranker


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keypair(tmp_path / "a.pem", tmp_path / "a.pub")
    generate_keypair(tmp_path / "b.pem", tmp_path / "b.pub")
    return tmp_path


@pytest.fixture
def replica() -> Iterator[RankerReplica]:
    r = RankerReplica("r-trust", loader_nice=0)
    yield r
    r.close()


def signed(root: Path, artifact_id: str, key: Path, seed: int) -> PackResult:
    packed = pack_ranker(root / "store", artifact_id=artifact_id, seed=seed)
    manifest = (packed.out_dir / MANIFEST_NAME).read_bytes()
    (packed.out_dir / SIGNATURE_NAME).write_bytes(sign_manifest(manifest, key))
    return packed


def replace_in_place(path: Path, source: Path) -> None:
    """As the kubelet updates a mounted ConfigMap: the new content beside, renamed over."""
    staged = path.with_name(path.name + ".new")
    shutil.copyfile(source, staged)
    os.replace(staged, path)


def config(tmp: Path, anchor: Path, packed: PackResult, revision: int) -> dict[str, Any]:
    return {
        "cohort": "canary",
        "cache_dir": str(tmp / "cache"),
        "trust_key": str(anchor),
        "target": packed.target(revision).model_dump(mode="json"),
        "retry": {"initial_s": 0.01, "cap_s": 0.02, "max_attempts": 1},
        "report_interval_s": 0.2,
    }


def request() -> WireRequest:
    features = np.random.default_rng(0).normal(size=(2, NUM_FEATURES)).astype(np.float32)
    return WireRequest(("a", "b"), features, {}, 1)


def refused(replica: RankerReplica, revision: int) -> str:
    def failed() -> str | None:
        error = replica.report().last_error
        if error is not None and error.category == "signature" and error.revision == revision:
            return error.message
        return None

    return wait_until(failed, 60, f"revision {revision} refused for its signature")


def serving(replica: RankerReplica, revision: int) -> None:
    wait_until(lambda: replica.report().actual_revision == revision, 60, f"serving {revision}")


def test_a_key_replaced_in_place_is_the_one_the_running_replica_trusts(
    replica: RankerReplica, keys: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "mounted" / "artifact-signing.pub"
    anchor.parent.mkdir()
    shutil.copyfile(keys / "a.pub", anchor)
    v1 = signed(tmp_path, "ranker-a1", keys / "a.pem", seed=1)
    assert replica.reconfigure(config(tmp_path, anchor, v1, 1))
    first = replica.report()
    assert first.actual_artifact == "ranker-a1" and first.trust_anchors is not None

    replace_in_place(anchor, keys / "b.pub")  # the old key revoked: no new user_config
    assert replica.report().trust_anchors not in (None, first.trust_anchors)

    v2 = signed(tmp_path, "ranker-a2", keys / "a.pem", seed=2)
    assert replica.reconfigure(config(tmp_path, anchor, v2, 2))
    refused(replica, 2)
    assert replica.rank([request()]).model.artifact_id == "ranker-a1"  # still serving

    v3 = signed(tmp_path, "ranker-b3", keys / "b.pem", seed=3)
    assert replica.reconfigure(config(tmp_path, anchor, v3, 3))
    serving(replica, 3)
    assert replica.rank([request()]).model.artifact_id == "ranker-b3"


def test_anchors_that_cannot_be_read_refuse_every_load_and_the_model_stays(
    replica: RankerReplica, keys: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "artifact-signing.pub"
    shutil.copyfile(keys / "a.pub", anchor)
    v1 = signed(tmp_path, "ranker-a1", keys / "a.pem", seed=1)
    assert replica.reconfigure(config(tmp_path, anchor, v1, 1))
    in_force = replica.report().trust_anchors

    anchor.unlink()  # removed to revoke it (or a mount gone): nothing is trusted
    report = replica.report()
    error = report.last_error
    assert error is not None and error.category == "signature", error
    assert "cannot be read" in error.message and error.field == "user_config.trust", error
    assert (report.phase, report.actual_artifact) == (ReplicaPhase.READY, "ranker-a1")

    v2 = signed(tmp_path, "ranker-a2", keys / "a.pem", seed=2)
    assert replica.reconfigure(config(tmp_path, anchor, v2, 2)) is False  # unreadable
    assert replica.rank([request()]).model.artifact_id == "ranker-a1"

    shutil.copyfile(keys / "a.pub", anchor)  # back: trusted again
    assert replica.report().trust_anchors == in_force
    assert replica.reconfigure(config(tmp_path, anchor, v2, 2))
    serving(replica, 2)


def test_status_warns_when_replicas_trust_different_anchors() -> None:
    def row(replica: str, digest: str | None) -> ReplicaRow:
        return ReplicaRow(replica=replica, cohort="stable", phase=ReplicaPhase.READY,
                          desired=None, actual=None, actual_revision=None, error=None,
                          age_s=0.0, trust_anchors=digest)  # fmt: skip

    same = [row("r1", "a" * 64), row("r2", "a" * 64)]
    assert trust_disagreement(same) == []
    lines = trust_disagreement([*same, row("r3", "b" * 64), row("r4", None)])
    assert lines[0].startswith("WARNING replicas trust different signing anchors")
    assert "  anchors aaaaaaaaaaaa: r1, r2" in lines
    assert "  anchors bbbbbbbbbbbb: r3" in lines and "  no anchors: r4" in lines
