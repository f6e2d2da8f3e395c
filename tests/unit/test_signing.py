"""`rollout keygen`: the private key is created with mode 0600 (never readable by others, not
even between its creation and a chmod), and never written through an existing path or a
symlink planted where it is to be created."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.signing import generate_keypair, load_public_key, sign_manifest, verify_manifest_signature

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = Path(sys.executable).with_name("rollout")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_rollout_keygen_with_a_permissive_umask_writes_a_0600_private_key(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    proc = subprocess.run(
        [str(ROLLOUT), "keygen", str(private), str(public)],
        capture_output=True, text=True, cwd=REPO, timeout=60, env=ENV, umask=0,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"private_key": str(private), "public_key": str(public)}
    assert mode_of(private) == 0o600
    assert mode_of(public) == 0o644  # readable by all, writable by its owner only
    signature = sign_manifest(b"manifest", private)
    verify_manifest_signature(b"manifest", signature, load_public_key(public))


# Watches the key file from inside the keygen process: at every audited operation after the
# file exists (the open of the next file, a chmod, ...), its mode is recorded.
WATCH_KEYGEN = textwrap.dedent(
    """
    import json, os, stat, sys
    private = sys.argv[1]
    seen = []
    busy = []

    def hook(event, args):
        if busy:
            return
        busy.append(1)
        try:
            st = os.lstat(private)
        except OSError:
            pass
        else:
            seen.append([event, stat.S_IMODE(st.st_mode)])
        finally:
            busy.pop()

    sys.addaudithook(hook)
    from rollout.cli import main
    code = main(["keygen", private, sys.argv[2]])
    busy.append(1)
    print(json.dumps({"code": code, "seen": seen}))
    """
)


def test_the_private_key_is_never_readable_by_others_even_before_a_chmod(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    proc = subprocess.run(
        [sys.executable, "-c", WATCH_KEYGEN, str(private), str(public)],
        capture_output=True, text=True, cwd=REPO, timeout=60, env=ENV, umask=0,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["seen"], "the watch saw no operation after the key file existed"
    loose = [(event, oct(mode)) for event, mode in report["seen"] if mode & 0o077]
    assert loose == [], f"the private key was group/other accessible at: {loose}"


def test_keygen_refuses_an_existing_private_key_and_keeps_it(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    private.write_bytes(b"the old key")
    with pytest.raises(ConfigError) as info:
        generate_keypair(private, public)
    assert str(private) in str(info.value)
    assert private.read_bytes() == b"the old key"
    assert not public.exists()


def test_keygen_refuses_an_existing_public_key_and_leaves_no_private_key(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    public.write_bytes(b"someone's public key")
    with pytest.raises(ConfigError):
        generate_keypair(private, public)
    assert not private.exists()
    assert public.read_bytes() == b"someone's public key"


def test_keygen_never_writes_through_a_symlink(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    target = tmp_path / "shared" / "exposed.pem"
    target.parent.mkdir()
    private.symlink_to(target)  # dangling: Path.exists() says False
    with pytest.raises(ConfigError):
        generate_keypair(private, public)
    assert not target.exists()
    assert not public.exists()


def test_rollout_keygen_refuses_a_dangling_symlink_with_one_line(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    target = tmp_path / "exposed.pem"
    private.symlink_to(target)
    proc = subprocess.run(
        [str(ROLLOUT), "keygen", str(private), str(public)],
        capture_output=True, text=True, cwd=REPO, timeout=60, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 6, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error[config]: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not target.exists()
    assert not public.exists()
