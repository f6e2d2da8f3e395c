"""Credentials never reach the terminal: the installed binary given a PostgreSQL URL with a
password (well-formed or malformed, so that the driver's own error quotes part of it) prints
one line with the secret masked, and file names are escaped, not written raw."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout.local.cluster import free_port

ROLLOUT = str(Path(sys.executable).with_name("rollout"))


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def urls(port: int) -> list[tuple[str, str]]:
    """(registry URL, its secret): nothing listens at the port."""
    return [
        (f"postgresql://u:pa/ss@127.0.0.1:{port}/x", "pa/ss"),
        (f"postgresql://u:s3cr:et@127.0.0.1:{port}/x", "s3cr:et"),
        (f"postgresql://u:hunter2@127.0.0.1:{port}x/x", "hunter2"),
        (f"postgresql://u:p%zzword@127.0.0.1:{port}/x", "zzword"),
        ("postgresql://u:pwsecret@[::1/x", "pwsecret"),
        (f"postgresql://127.0.0.1:{port}/x?password=topsecret&sslmode=bogus", "topsecret"),
        # An empty user and a '/': the driver quotes the piece before the '/' as the port.
        (f"postgresql://:secretpw/x@127.0.0.1:{port}/db", "secretpw/x"),
        # An '@' in the password: the driver quotes the piece after it as the host.
        (f"postgresql://u:hunter@secret2@127.0.0.1:{port}/x", "hunter@secret2"),
    ]


@pytest.mark.parametrize("index", range(len(urls(1))))
@pytest.mark.parametrize(
    "command", [("registry", "--db", "{url}", "history"), ("history", "--db", "{url}")]
)
def test_a_registry_url_password_never_reaches_the_terminal(
    tmp_path: Path, index: int, command: tuple[str, ...]
) -> None:
    url, secret = urls(free_port())[index]
    done = rollout(*(url if part == "{url}" else part for part in command), cwd=tmp_path)
    assert done.returncode in (6, 7), (done.returncode, done.stderr)
    assert secret not in done.stderr + done.stdout, done.stderr
    for fragment in (secret[i : i + 4] for i in range(len(secret) - 3)):
        assert fragment not in done.stderr, (fragment, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error["), done.stderr
    assert "Traceback" not in done.stderr


def test_controller_commands_mask_the_registry_password(tmp_path: Path) -> None:
    # No cluster at the address: the command fails before any controller is asked, and its
    # error still never carries the password it was given.
    url = "postgresql://ranker:hunter2@db.example:5432/registry"
    for args in (("controller", "start"), ("controller", "status")):
        done = rollout(*args, "--db", url, "--address", f"127.0.0.1:{free_port()}", cwd=tmp_path)
        assert done.returncode == 7, done.stderr
        assert "hunter2" not in done.stderr + done.stdout


def test_an_escape_in_a_file_name_is_shown_escaped(tmp_path: Path) -> None:
    name = tmp_path / "evil\x1b]0;owned\x07" / "registry.db"
    done = rollout("registry", "--db", f"sqlite:///{name}", "history", cwd=tmp_path)
    assert done.returncode == 5, done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert "\\x1b]0;owned\\x07" in done.stderr


def test_a_manifest_uri_password_never_reaches_the_terminal(tmp_path: Path) -> None:
    uri = f"http://ops:manifestpw@127.0.0.1:{free_port()}/ranker-v42/manifest.json"
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    assert rollout("registry", "--db", db, "init", cwd=tmp_path).returncode == 0
    for args in (
        ("verify", uri, "--sha256", "a" * 64, "--cache", str(tmp_path / "cache")),
        ("registry", "--db", db, "register", uri, "--sha256", "a" * 64),
    ):
        done = rollout(*args, cwd=tmp_path)
        # Nothing listens: a fetch failure (7; "missing", 3, where the store says so).
        assert done.returncode in (3, 7), (args, done.returncode, done.stderr)
        assert "manifestpw" not in done.stderr + done.stdout, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_address_with_a_password_is_a_config_error_that_never_shows_it(tmp_path: Path) -> None:
    # Ray refuses an HTTP address with its own ValueError, quoting it: once a traceback-free
    # but raw `error[internal]` line with exit 1.
    done = rollout(
        "status", "--address", "http://u:secretpw@127.0.0.1:1", "--timeout", "3", cwd=tmp_path
    )
    assert done.returncode == 6, (done.returncode, done.stderr)
    assert done.stderr.startswith("error[config]: --address"), done.stderr
    assert "secretpw" not in done.stderr + done.stdout, done.stderr
