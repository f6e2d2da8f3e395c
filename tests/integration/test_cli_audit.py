"""Who decided what, and why, lands in the registry's audit log: registration, approval and
rejection of artifacts beside the target publishes, run as the installed binary and read back
with `rollout registry history --artifacts`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.servable_manifests import write_servable_manifest

ROLLOUT = str(Path(sys.executable).with_name("rollout"))


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert "Traceback" not in done.stderr
    return done


def test_register_approve_reject_and_publish_are_audited(tmp_path: Path) -> None:
    db = ("registry", "--db", f"sqlite:///{tmp_path / 'registry.db'}")
    assert rollout(*db, "init", cwd=tmp_path).returncode == 0
    v41 = write_servable_manifest(tmp_path / "v41", "ranker-v41")
    v42 = write_servable_manifest(tmp_path / "v42", "ranker-v42")
    for ref, actor in ((v41, "carol"), (v42, "dave")):
        done = rollout(
            *db, "register", ref.uri, "--sha256", ref.sha256, "--actor", actor, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
    steps = [
        ("approve", "ranker-v41", "--reason", "offline eval ok", "--actor", "alice"),
        ("reject", "ranker-v42", "--reason", "ndcg regression", "--actor", "bob"),
        ("publish", "stable", "ranker-v41", "--expected-revision", "0", "--reason", "first",
         "--actor", "alice"),
    ]  # fmt: skip
    for step in steps:
        done = rollout(*db, *step, cwd=tmp_path)
        assert done.returncode == 0, (step, done.stderr)
    # Registering the same artifact again changes nothing, and records nothing.
    assert rollout(*db, "register", v41.uri, "--sha256", v41.sha256, cwd=tmp_path).returncode == 0

    decisions = json.loads(rollout(*db, "--json", "history", "--artifacts", cwd=tmp_path).stdout)
    assert [
        (d["artifact_id"], d["action"], d["old_state"], d["new_state"], d["actor"], d["reason"])
        for d in decisions
    ] == [
        ("ranker-v42", "reject", "pending", "rejected", "bob", "ndcg regression"),
        ("ranker-v41", "approve", "pending", "ready", "alice", "offline eval ok"),
        ("ranker-v42", "register", None, "pending", "dave", None),
        ("ranker-v41", "register", None, "pending", "carol", None),
    ]
    table = rollout(*db, "history", "--artifacts", cwd=tmp_path).stdout.splitlines()
    assert table[0].split() == ["AT", "ARTIFACT", "ACTION", "FROM", "TO", "ACTOR", "REASON"]
    assert "ndcg regression" in table[1]
    publishes = json.loads(rollout(*db, "--json", "history", cwd=tmp_path).stdout)
    assert [(p["actor"], p["reason"], p["new_artifact_id"]) for p in publishes] == [
        ("alice", "first", "ranker-v41")
    ]
