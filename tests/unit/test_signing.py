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
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from app.errors import ArtifactRejected, ConfigError
from app.signing import (
    generate_keypair,
    load_signing_key,
    load_trusted_key,
    sign_manifest,
    verify_manifest_signature,
)

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = Path(sys.executable).with_name("rollout")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("kind", ["ec-p256", "ed25519", None])
def test_rollout_keygen_with_a_permissive_umask_writes_a_0600_private_key(tmp_path, kind):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    kind_args = ["--kind", kind] if kind else []
    proc = subprocess.run(
        [str(ROLLOUT), "keygen", str(private), str(public), *kind_args],
        capture_output=True, text=True, cwd=REPO, timeout=60, env=ENV, umask=0,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    written = kind or "ec-p256"  # the default: the kind the ecosystem's tools check
    assert json.loads(proc.stdout) == {
        "private_key": str(private), "public_key": str(public), "kind": written
    }  # fmt: skip
    assert mode_of(private) == 0o600
    assert mode_of(public) == 0o644  # readable by all, writable by its owner only
    if written == "ed25519":
        signature = sign_manifest(b"manifest", private)
        verify_manifest_signature(b"manifest", signature, load_trusted_key(public))
    else:
        key = load_signing_key(private)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        assert load_trusted_key(public).public_numbers() == key.public_key().public_numbers()


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
    # The same usage error (2, naming the path) as an existing file: one refusal, one code.
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "exists; refusing to overwrite a key" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not target.exists()
    assert not public.exists()


def _load_guarded(load: Callable[[Path], object], path: Path) -> object:
    """``load(path)`` on a thread: a hang (the old code blocked on a FIFO) fails the test
    instead of stalling the suite."""
    import threading

    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(load(path))
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    assert outcome, f"loading {path} hung"
    return outcome[0]


@pytest.mark.parametrize("kind", ["fifo", "device", "huge", "directory"])
def test_a_key_path_that_is_not_a_small_regular_file_is_a_config_error(
    tmp_path: Path, kind: str
) -> None:
    from app.signing import MAX_KEY_FILE_BYTES

    path = tmp_path / "key.pem"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    elif kind == "huge":
        path.write_bytes(b"-" * (MAX_KEY_FILE_BYTES + 1))
    else:
        path.mkdir()
    for load in (load_trusted_key, load_signing_key):
        got = _load_guarded(load, path)
        assert isinstance(got, ConfigError), got
        assert str(path) in str(got)


def test_a_symlinked_key_is_read(tmp_path: Path) -> None:
    # Mounted secrets (Kubernetes) are symlinks: following them is right for a key.
    generate_keypair(tmp_path / "sign.pem", tmp_path / "trust.pem")
    (tmp_path / "link.pem").symlink_to(tmp_path / "trust.pem")
    key = load_trusted_key(tmp_path / "link.pem")
    # The key behind the link, the one that checks what its private half signed.
    assert raw_public(key) == raw_public(load_trusted_key(tmp_path / "trust.pem"))
    manifest = b'{"artifact_id": "linked"}'
    signature = sign_manifest(manifest, tmp_path / "sign.pem")
    verify_manifest_signature(manifest, signature, key)  # type: ignore[arg-type]
    with pytest.raises(ArtifactRejected):
        verify_manifest_signature(manifest + b" ", signature, key)  # type: ignore[arg-type]


def raw_public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def test_rollout_verify_with_a_fifo_as_trust_key_exits_6_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "trust.pem")
    done = subprocess.run(
        [str(ROLLOUT), "verify", (tmp_path / "m.json").as_uri(), "--sha256", "ab" * 32,
         "--cache", str(tmp_path / "cache"), "--trust-key", str(tmp_path / "trust.pem")],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 6, (done.returncode, done.stderr)
    assert done.stderr.startswith("error[config]: --trust-key: trust key"), done.stderr
