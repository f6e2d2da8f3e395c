"""`rollout replay` and `rollout pack --expected-divergence` as the installed binary, run as
a subprocess the way a release pipeline runs them: the block replay writes is one the
contracts read and pack embeds; bad input exits with its category, one line, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.contracts import ExpectedDivergence
from app.demo_artifacts import make_demo_artifacts, write_ranker_source
from app.manifest import MANIFEST_NAME
from app.packing import PackResult
from app.request_bodies import rank_bodies

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
EXIT_USAGE, EXIT_REJECTED, EXIT_CONFIG = 2, 3, 6


def rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROLLOUT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def assert_error(done: subprocess.CompletedProcess[str], code: int, head: str) -> str:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(head), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackResult]:
    store = tmp_path_factory.mktemp("replay-store")
    return {p.artifact_id: p for p in make_demo_artifacts(store)}


def replay_args(demo: dict[str, PackResult], cache: Path, *extra: str) -> list[str]:
    base, cand = demo["ranker-v41"], demo["ranker-v42"]
    return [
        "replay",
        "--baseline", str(base.out_dir), "--baseline-sha256", base.manifest_sha256,
        "--candidate", str(cand.out_dir), "--candidate-sha256", cand.manifest_sha256,
        "--cache", str(cache),
        *extra,
    ]  # fmt: skip


def test_replay_writes_a_block_the_contracts_read(
    demo: dict[str, PackResult], tmp_path: Path
) -> None:
    requests = tmp_path / "held-out.jsonl"
    requests.write_text(
        "".join(json.dumps(b) + "\n" for b in rank_bodies(30, seed=11, candidates=12, top_n=8))
    )
    out = tmp_path / "expected.json"
    done = rollout(
        *replay_args(demo, tmp_path / "cache", "--requests", str(requests), "--out", str(out),
                     "--top-k", "8", "--rbo-p", "0.8"),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    block = ExpectedDivergence.model_validate_json(out.read_text())
    assert block.baseline_artifact_id == "ranker-v41"
    assert block.baseline_manifest_sha256 == demo["ranker-v41"].manifest_sha256
    assert (block.requests, block.top_k, block.rbo_p) == (30, 8, 0.8)
    assert block.source == "requests file held-out.jsonl: 30 requests"
    assert block.rbo_mean < 0.9 and block.top1_change_rate > 0.1  # two different models
    # The figures are rounded to 4 decimals, and the summary on stderr says them.
    assert all(round(v, 4) == v for v in (block.rbo_mean, block.overlap_mean))
    assert f"mean RBO             {block.rbo_mean:.4f}" in done.stderr
    assert f"top-1 change rate    {block.top1_change_rate:.4f}" in done.stderr
    assert "top-8 overlap" in done.stderr and "p99 max score diff" in done.stderr


def test_replay_of_generated_requests_to_stdout(
    demo: dict[str, PackResult], tmp_path: Path
) -> None:
    done = rollout(*replay_args(demo, tmp_path / "cache", "--generated", "20", "--seed", "3",
                                "--json"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # --json: the JSON line only
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    block = ExpectedDivergence.model_validate_json(lines[0])
    assert block.source == "generated: 20 requests, seed 3" and block.requests == 20


def test_a_bad_requests_file_exits_6_naming_the_line_and_field(
    demo: dict[str, PackResult], tmp_path: Path
) -> None:
    good, bad = list(rank_bodies(2, candidates=3, top_n=2))
    bad["candidates"][1]["features"] = bad["candidates"][1]["features"][:-1]
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    out = tmp_path / "expected.json"
    done = rollout(
        *replay_args(demo, tmp_path / "cache", "--requests", str(requests), "--out", str(out)),
        cwd=tmp_path,
    )
    line = assert_error(done, EXIT_CONFIG, f"error[config]: requests file {requests}, line 2: ")
    assert "candidates[1].features" in line and "at least 80" in line
    assert not out.exists()


def test_replay_refuses_a_digest_of_another_artifact(
    demo: dict[str, PackResult], tmp_path: Path
) -> None:
    args = replay_args(demo, tmp_path / "cache", "--generated", "5")
    args[args.index("--baseline-sha256") + 1] = demo["ranker-v42"].manifest_sha256
    assert_error(rollout(*args, cwd=tmp_path), EXIT_REJECTED, "rejected: manifest_digest: ")
    both = rollout(*replay_args(demo, tmp_path / "cache", "--generated", "5", "--requests",
                                str(tmp_path)), cwd=tmp_path)  # fmt: skip
    assert both.returncode == EXIT_USAGE and "Traceback" not in both.stderr


def _pack(src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return rollout(
        "pack", str(src), "--model", "ranker", "--artifact-id", "ranker-v43",
        "--feature-schema", "ranker-features-v3", "--out", str(out), "--json", *extra,
        cwd=src.parent,
    )  # fmt: skip


def _block(demo: dict[str, PackResult]) -> dict:
    return {
        "baseline_artifact_id": "ranker-v41",
        "baseline_manifest_sha256": demo["ranker-v41"].manifest_sha256,
        "requests": 1000,
        "top_k": 10,
        "rbo_p": 0.9,
        "rbo_mean": 0.8288,
        "overlap_mean": 0.8942,
        "top1_change_rate": 0.328,
        "max_score_diff_p99": 0.2918,
        "source": "generated: 1000 requests, seed 7",
    }


def test_pack_embeds_the_block(demo: dict[str, PackResult], tmp_path: Path) -> None:
    write_ranker_source(tmp_path / "src", seed=43)
    block_file = tmp_path / "expected.json"
    block_file.write_text(json.dumps(_block(demo)))
    done = _pack(tmp_path / "src", tmp_path / "out", "--expected-divergence", str(block_file))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["metadata"]["expected_divergence"] == _block(demo)
    assert ExpectedDivergence.from_metadata(manifest["metadata"]) == ExpectedDivergence(
        **_block(demo)
    )
    assert manifest["metadata"]["offline_evaluation"]["examples"] > 0  # metadata.json kept


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda b: b.update(rbo_mean=1.5), "metadata.expected_divergence.rbo_mean"),
        (lambda b: b.update(extra=1), "metadata.expected_divergence.extra"),
        (
            lambda b: b.update(baseline_artifact_id="ranker-v43"),
            "metadata.expected_divergence.baseline_artifact_id",
        ),
    ],
)
def test_pack_refuses_a_bad_block_naming_the_field_and_writes_nothing(
    demo: dict[str, PackResult], tmp_path: Path, edit, field: str
) -> None:
    write_ranker_source(tmp_path / "src", seed=43)
    block = _block(demo)
    edit(block)
    block_file = tmp_path / "expected.json"
    block_file.write_text(json.dumps(block))
    done = _pack(tmp_path / "src", tmp_path / "out", "--expected-divergence", str(block_file))
    line = assert_error(done, EXIT_CONFIG, f"error[config]: --expected-divergence {block_file}: ")
    assert f"{field}: " in line
    assert done.stdout == "" and not (tmp_path / "out").exists()


def test_pack_refuses_a_block_file_that_is_not_json(tmp_path: Path) -> None:
    write_ranker_source(tmp_path / "src", seed=43)
    block_file = tmp_path / "expected.json"
    block_file.write_text("{rbo_mean: 0.8")
    done = _pack(tmp_path / "src", tmp_path / "out", "--expected-divergence", str(block_file))
    assert "not valid JSON" in assert_error(done, EXIT_CONFIG, "error[config]: ")
    assert not (tmp_path / "out").exists()


def test_the_second_family_is_packed_verified_and_replayed_by_the_installed_binary(
    tmp_path: Path,
) -> None:
    """``make-demo-artifacts --two-tower``, ``verify --load`` and ``replay`` of the two-tower
    family: the offline tools know every shipped family, and replay sends the baseline's
    schema."""
    made = rollout("make-demo-artifacts", str(tmp_path / "store"), "--two-tower", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    packed = {d["artifact_id"]: d for d in map(json.loads, made.stdout.splitlines())}
    v1, v2 = packed["two-tower-v1"], packed["two-tower-v2"]
    verified = rollout(
        "verify", v1["manifest_uri"], "--sha256", v1["manifest_sha256"], "--load",
        "--model", "recs-two-tower", "--cache", str(tmp_path / "cache"), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout.strip().splitlines()[-1])["artifact_id"] == "two-tower-v1"
    replayed = rollout(
        "replay",
        "--baseline", str(tmp_path / "store" / "two-tower-v1"),
        "--baseline-sha256", v1["manifest_sha256"],
        "--candidate", str(tmp_path / "store" / "two-tower-v2"),
        "--candidate-sha256", v2["manifest_sha256"],
        "--model", "recs-two-tower", "--generated", "30", "--cache", str(tmp_path / "cache"),
        "--json", cwd=tmp_path,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    block = ExpectedDivergence.model_validate_json(replayed.stdout.strip().splitlines()[-1])
    assert block.requests == 30 and block.source.endswith("two-tower-features-v1")
