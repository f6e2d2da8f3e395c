"""`rollout pack` and `rollout verify` as a user runs them: exit codes and one-line output for
every rejection category, with real artifacts on disk. Never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.manifest import MANIFEST_NAME
from rollout.cli import main
from tests import artifacts
from tests.file_artifacts import file_entry, make_file_artifact, rewrite_manifest

REPO = Path(__file__).resolve().parents[3]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def verify(capsys, tmp_path, result, *extra: str, digest: str | None = None):
    return run(
        capsys,
        "verify",
        result.manifest_uri,
        "--sha256",
        digest or result.manifest_sha256,
        "--cache",
        str(tmp_path / "cache"),
        *extra,
    )


def assert_rejected(outcome, category: str) -> None:
    code, out, err = outcome
    assert code == 3, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rejected: {category}: "), err
    assert "Traceback" not in out + err


def test_pack_then_verify_and_load(capsys, tmp_path):
    src = tmp_path / "src"
    from app.demo_artifacts import write_ranker_source

    write_ranker_source(src, seed=3)
    code, out, _ = run(
        capsys, "pack", str(src), "--model", "ranker", "--artifact-id", "ranker-x1",
        "--feature-schema", "ranker-features-v3", "--out", str(tmp_path / "art"),
    )  # fmt: skip
    assert code == 0
    packed = json.loads(out)
    assert packed["manifest_uri"].endswith(f"art/{MANIFEST_NAME}")
    code, out, err = run(
        capsys, "verify", packed["manifest_uri"], "--sha256", packed["manifest_sha256"],
        "--cache", str(tmp_path / "cache"), "--load",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["artifact_id"] == "ranker-x1"
    assert result["loaded"]["device"] in ("cpu", "cuda:0")
    assert result["bytes"] > 0 and result["seconds"] >= 0
    assert Path(result["cache_path"]).is_dir()


@pytest.mark.parametrize(
    ("build", "category"),
    [
        (artifacts.wrong_schema_artifact, "schema"),
        (artifacts.bad_normalization_artifact, "schema"),
        (artifacts.unknown_runtime_artifact, "runtime"),
        (artifacts.unknown_precision_artifact, "runtime"),
        (artifacts.unknown_architecture_artifact, "runtime"),
        (artifacts.missing_key_artifact, "load"),
        (artifacts.unexpected_key_artifact, "load"),
        (artifacts.wrong_shape_artifact, "load"),
        (artifacts.garbage_weights_artifact, "load"),
        (artifacts.nan_weights_artifact, "dry_run"),
    ],
)
def test_model_rejections_with_load(capsys, tmp_path, build, category):
    result = build(tmp_path / "art")
    assert_rejected(verify(capsys, tmp_path, result, "--load"), category)


def test_memory_budget(capsys, tmp_path):
    result = artifacts.good_artifact(tmp_path / "art")
    assert_rejected(verify(capsys, tmp_path, result, "--load", "--memory-budget", "1024"), "budget")


@pytest.fixture
def blob(tmp_path):
    return make_file_artifact(tmp_path, {"weights.bin": os.urandom(50_000), "n.json": b"{}"})


def test_file_level_rejections(capsys, tmp_path, blob):
    assert_rejected(verify(capsys, tmp_path, blob, digest="1" * 64), "manifest_digest")

    digest = rewrite_manifest(blob, lambda d: d["files"].append(file_entry("../x", b"x")))
    assert_rejected(verify(capsys, tmp_path, blob, digest=digest), "path")


def test_size_digest_missing_extra(capsys, tmp_path):
    def fresh(name):
        return make_file_artifact(tmp_path, {"w.bin": os.urandom(10_000)}, name)

    a = fresh("a")
    (a.out_dir / "w.bin").write_bytes(b"short")
    assert_rejected(verify(capsys, tmp_path, a), "size")
    b = fresh("b")
    data = bytearray((b.out_dir / "w.bin").read_bytes())
    data[5] ^= 1
    (b.out_dir / "w.bin").write_bytes(bytes(data))
    assert_rejected(verify(capsys, tmp_path, b), "digest")
    c = fresh("c")
    (c.out_dir / "w.bin").unlink()
    assert_rejected(verify(capsys, tmp_path, c), "missing")
    d = fresh("d")
    (d.out_dir / "extra.txt").write_text("x")
    assert_rejected(verify(capsys, tmp_path, d), "extra")


def signed_ranker(root: Path, sign_key: Path):
    """A servable artifact (verify refuses what the service cannot serve), signed."""
    from app.demo_artifacts import write_ranker_source
    from app.packing import pack_artifact

    write_ranker_source(root / "src-signed", seed=1)
    return pack_artifact(
        root / "src-signed", root / "signed", model="ranker", artifact_id="ranker-signed",
        feature_schema="ranker-features-v3", sign_key=sign_key,
    )  # fmt: skip


def test_limits_and_signature(capsys, tmp_path):
    # 300 files: over the cache's default limit of 256 files per artifact.
    many = make_file_artifact(tmp_path, {f"f{i}.bin": b"x" for i in range(300)}, "many")
    assert_rejected(verify(capsys, tmp_path, many), "limits")
    code, _, _ = run(capsys, "keygen", str(tmp_path / "k.pem"), str(tmp_path / "k.pub"))
    assert code == 0
    unsigned = make_file_artifact(tmp_path, {"w.bin": b"abc"}, "unsigned")
    assert_rejected(
        verify(capsys, tmp_path, unsigned, "--trust-key", str(tmp_path / "k.pub")), "signature"
    )
    signed = signed_ranker(tmp_path, tmp_path / "k.pem")
    code, _, err = verify(capsys, tmp_path, signed, "--trust-key", str(tmp_path / "k.pub"))
    assert code == 0, err


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "file:///x/manifest.json"],  # --sha256 missing
        ["verify", "file:///x/manifest.json", "--sha256", "nothex"],
        ["pack", "/nonexistent", "--model", "m", "--artifact-id", "a", "--feature-schema", "s",
         "--out", "/tmp/o"],
        ["no-such-command"],
    ],
)  # fmt: skip
def test_usage_errors_exit_2(capsys, argv):
    code, _, _ = run(capsys, *argv)
    assert code == 2


def test_console_script_never_prints_a_traceback(tmp_path):
    # The real entry point, in a fresh process.
    result = make_file_artifact(tmp_path, {"w.bin": b"abc"}, "cs")
    (result.out_dir / "w.bin").write_bytes(b"abd")
    proc = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "verify", result.manifest_uri, "--sha256",
         result.manifest_sha256, "--cache", str(tmp_path / "c")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 3
    assert proc.stderr.strip().startswith("rejected: digest: ")
    assert "Traceback" not in proc.stderr


def run_on_a_terminal(*argv: str) -> tuple[int, str, str]:
    """The installed ``rollout`` with stderr on a pseudo-terminal (as in a user's shell) and
    stdout piped: what the terminal showed, and stdout."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "rollout"), *argv],
        stdout=subprocess.PIPE,
        stderr=follower,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(follower)
    shown = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    out = proc.stdout.read().decode() if proc.stdout else ""
    code = proc.wait(timeout=120)
    os.close(leader)
    return code, shown.decode(errors="replace"), out


def test_pack_and_verify_draw_a_progress_bar_on_a_terminal_and_none_in_json_mode(tmp_path):
    # ~34 MB of weights: a few refreshes of the bar, then one JSON line on stdout.
    big = artifacts.large_artifact(tmp_path / "store")
    src = tmp_path / "src"
    from app.demo_artifacts import write_ranker_source

    write_ranker_source(src, seed=4, params={"hidden_dim": 1024, "num_layers": 8})
    code, shown, out = run_on_a_terminal(
        "pack", str(src), "--model", "ranker", "--artifact-id", "ranker-bar",
        "--feature-schema", "ranker-features-v3", "--out", str(tmp_path / "packed"),
    )  # fmt: skip
    assert code == 0, shown
    assert "copy + hash" in shown and "MiB" in shown, shown
    assert json.loads(out)["artifact_id"] == "ranker-bar"

    argv = ("verify", big.manifest_uri, "--sha256", big.manifest_sha256, "--load")
    code, shown, out = run_on_a_terminal(*argv, "--cache", str(tmp_path / "c1"))
    assert code == 0, shown
    assert "fetch + verify" in shown and "MiB" in shown, shown
    # Cold: the weights went into the model as the fetch hashed them; not read again.
    assert json.loads(out)["loaded"]["loaded_bytes"] < 1 << 20
    code, shown, out = run_on_a_terminal(*argv, "--cache", str(tmp_path / "c1"))
    assert code == 0, shown
    assert "re-hash" in shown and "load" in shown, shown  # a hit: re-hashed, then loaded
    assert json.loads(out)["loaded"]["loaded_bytes"] > 25 << 20

    code, shown, out = run_on_a_terminal(*argv, "--cache", str(tmp_path / "c2"), "--json")
    assert code == 0 and shown == "", shown
    assert json.loads(out)["artifact_id"] == big.artifact_id
