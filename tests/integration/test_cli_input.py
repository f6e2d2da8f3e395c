"""Bad input to the installed `rollout` binary is a usage error (exit 2) naming the option,
never a traceback from deeper down: out-of-range integers (an OverflowError of the database
driver before), empty or unprintable reasons and actors (a ValueError of the registry before),
and timeouts or intervals that are not numbers. Nothing is opened or created on the way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
HUGE = "9223372036854775808"  # 2**63: one past the largest integer either database stores


def cases(db: str) -> list[tuple[tuple[str, ...], str]]:
    registry = ("registry", "--db", db)
    publish = (*registry, "publish", "stable", "ranker-v41")
    return [
        (("history", "--db", db, "--limit", HUGE), "--limit"),
        (("history", "--db", db, "--limit", "0"), "--limit"),
        ((*registry, "history", "--limit", HUGE), "--limit"),
        ((*publish, "--expected-revision", HUGE, "--reason", "r"), "--expected-revision"),
        ((*publish, "--expected-revision", "0", "--reason", ""), "--reason"),
        ((*publish, "--expected-revision", "0", "--reason", "   "), "--reason"),
        ((*publish, "--expected-revision", "0", "--reason", "a\x1b[2Jb"), "--reason"),
        ((*publish, "--expected-revision", "0", "--reason", "x" * 4001), "--reason"),
        ((*publish, "--expected-revision", "0", "--reason", "r", "--actor", ""), "--actor"),
        ((*publish, "--expected-revision", "0", "--reason", "r", "--approval", ""), "--approval"),
        ((*registry, "approve", "ranker-v41", "--reason", ""), "--reason"),
        ((*registry, "reject", "ranker-v41", "--reason", ""), "--reason"),
        ((*registry, "register", "file:///m.json", "--sha256", "a" * 64, "--actor", " "),
         "--actor"),
        (("pause", "--reason", ""), "--reason"),
        (("resume", "--reason", ""), "--reason"),
        (("promote", "--reason", ""), "--reason"),
        (("abort", "--reason", " "), "--reason"),
        (("rollback", "--reason", ""), "--reason"),
        (("abort", "--actor", ""), "--actor"),
        (("status", "--interval", "nan"), "--interval"),
        (("status", "--timeout", "inf"), "--timeout"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(cases(""))))
def test_bad_input_is_a_usage_error_naming_the_option(tmp_path: Path, index: int) -> None:
    db_path = tmp_path / "registry.db"
    args, option = cases(f"sqlite:///{db_path}")[index]
    done = subprocess.run(
        [ROLLOUT, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, (args, done.returncode, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    assert option in done.stderr, done.stderr
    assert not db_path.exists()
