"""Offline replay (app/replay.py) without real models: the request sources (the live load's
generator, a requests file and its errors), the aggregation and the recorded block.
Replays of real artifacts: tests/unit/test_shadow_artifacts.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from app.api import MAX_BODY_BYTES
from app.contracts import ExpectedDivergence, WireRequest
from app.divergence import DivergenceTotals, compare_rankings
from app.errors import ConfigError
from app.preprocessing import RankedCandidate
from app.replay import (
    block_json,
    expected_divergence,
    generated_requests,
    replay,
    replay_expectation,
    requests_file,
    wire_request,
)
from app.request_bodies import rank_bodies
from rollout.local.traffic import TrafficSpec, _request_bodies

SHA = "ab" * 32


class ByFeature:
    """A ranker that orders candidates by one feature (descending), score = position's."""

    def __init__(self, artifact_id: str, column: int) -> None:
        self.artifact_id = artifact_id
        self.column = column
        self.batches: list[int] = []

    def rank_batch(self, requests: Sequence[WireRequest]) -> list[list[RankedCandidate]]:
        self.batches.append(len(requests))
        out = []
        for req in requests:
            values = [float(row[self.column]) for row in req.features]
            order = sorted(range(len(values)), key=lambda i: -values[i])[: req.top_n]
            out.append(
                [RankedCandidate(req.candidate_ids[i], 1 / (1 + r)) for r, i in enumerate(order)]
            )
        return out


def body(n: int = 4, top_n: int = 3, **extra) -> dict:
    return {
        "candidates": [
            {"id": f"c{i}", "features": [float((i * 7 + j) % 5) for j in range(80)]}
            for i in range(n)
        ],
        "top_n": top_n,
        **extra,
    }


# ---------------------------------------------------------------------- request sources


def test_the_live_loads_bodies_are_the_generators() -> None:
    """rollout.local.traffic sends rank_bodies (with a user id spliced in), so the first bodies of
    a larger generated replay are exactly the live load's, for any seed and shape."""
    for spec in (TrafficSpec(), TrafficSpec(seed=3, candidates=8, top_n=5)):
        live = _request_bodies(spec, count=5)
        generated = list(
            rank_bodies(9, seed=spec.seed, candidates=spec.candidates, top_n=spec.top_n)
        )
        for (prefix, suffix), expected in zip(live, generated[:5], strict=True):
            sent = json.loads(prefix + b"user-1" + suffix)
            assert sent.pop("user_id") == "user-1"
            assert sent == expected
    a, b = (list(rank_bodies(3, seed=s)) for s in (7, 8))
    assert a != b
    assert len(a[0]["candidates"]) == 20 and a[0]["top_n"] == 10
    assert a[0]["candidates"][0]["features"].count(None) == 1  # sparse inputs happen


def test_generated_requests_go_through_the_apis_validation() -> None:
    requests = generated_requests(3, seed=7)
    assert requests.count == 3 and requests.source == "generated: 3 requests, seed 7"
    first, again = list(requests), list(requests)  # iterable anew
    assert len(first) == 3 and [r.candidate_ids for r in first] == [r.candidate_ids for r in again]
    req = first[0]
    assert req.features.shape == (20, 80) and str(req.features.dtype) == "float32"
    assert req.top_n == 10 and set(req.context) >= {"surface"}
    shaped = generated_requests(2, seed=1, candidates=8, top_n=5)
    assert shaped.source == "generated: 2 requests, seed 1, 8 candidates, top_n 5"
    with pytest.raises(ConfigError, match="generated requests: 0"):
        generated_requests(0)


def test_a_requests_file_is_read_line_by_line_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "held-out.jsonl"
    path.write_text(
        json.dumps(body(user_id="u1")) + "\n\n" + json.dumps(body(n=2, top_n=1)) + "\r\n"
    )
    requests = requests_file(path)
    assert requests.count == 2 and requests.source == "requests file held-out.jsonl: 2 requests"
    got = list(requests)
    assert [r.candidate_ids for r in got] == [("c0", "c1", "c2", "c3"), ("c0", "c1")]
    assert got[1].top_n == 1


@pytest.mark.parametrize(
    ("line", "field", "words"),
    [
        ("{not json", "body", "Invalid JSON"),
        (json.dumps({"top_n": 3}), "candidates", "Field required"),
        (json.dumps(body(top_n="3")), "top_n", "valid integer"),
        (
            json.dumps({**body(), "candidates": [{"id": "a", "features": [1.0] * 79}]}),
            "candidates[0].features",
            "at least 80",
        ),
        (json.dumps(body(context={"surface": "tv"})), "context.surface", "not one of"),
        (json.dumps(body(extra_field=1)), "extra_field", "Extra inputs"),
    ],
)
def test_a_bad_line_names_its_number_and_field(
    tmp_path: Path, line: str, field: str, words: str
) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(body()) + "\n\n" + line + "\n" + json.dumps(body()) + "\n")
    with pytest.raises(ConfigError) as caught:
        requests_file(path)
    message = str(caught.value)
    assert message.startswith(f"requests file {path}, line 3: {field}: "), message
    assert words in message
    assert caught.value.ids == {"field": field, "line": 3}


def test_an_empty_missing_or_oversized_requests_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match="holds no requests"):
        requests_file(empty)
    with pytest.raises(ConfigError, match=r"nope\.jsonl"):
        requests_file(tmp_path / "nope.jsonl")
    big = tmp_path / "big.jsonl"
    big.write_bytes(json.dumps(body()).encode() + b"\n" + b" " * (MAX_BODY_BYTES + 1) + b"\n")
    with pytest.raises(ConfigError, match=r"line 2: body: over the limit"):
        requests_file(big)


# ---------------------------------------------------------------------- aggregation


def test_replay_compares_as_the_router_does_with_the_baseline_as_stable() -> None:
    requests = [wire_request(body(n=6, top_n=4)) for _ in range(7)]
    base, other = ByFeature("base", 0), ByFeature("cand", 1)
    same = replay(base, ByFeature("twin", 0), requests, batch_size=3)
    assert base.batches == [3, 3, 1]
    assert same.compared == 7 and same.rbo_mean == 1.0 and same.top1_change_rate == 0.0
    assert same.overlap_mean == 1.0 and max(same.score_diffs) == 0.0

    totals = replay(base, other, requests, top_k=3, rbo_p=0.8)
    a = base.rank_batch(requests[:1])[0]
    b = other.rank_batch(requests[:1])[0]
    one = compare_rankings(
        [(c.id, c.score) for c in a], [(c.id, c.score) for c in b], top_k=3, rbo_p=0.8
    )
    expected = DivergenceTotals()
    for _ in range(7):
        expected.add(one)
    assert totals == expected
    assert totals.rbo_mean is not None and totals.rbo_mean < 1.0


def test_the_block_rounds_clamps_and_names_its_baseline() -> None:
    totals = DivergenceTotals()
    totals.compared, totals.rbo_sum, totals.overlap_sum, totals.top1_changed = 3, 2.0, 2.5, 1
    totals.score_diffs = [0.1, 0.123456789, 1.7]  # a score diff over 1 is clamped
    block = expected_divergence(
        totals,
        baseline_artifact_id="ranker-v41",
        baseline_manifest_sha256=SHA.upper(),
        top_k=5,
        rbo_p=0.8,
        source="generated: 3 requests, seed 7",
    )
    assert block == ExpectedDivergence(
        baseline_artifact_id="ranker-v41",
        baseline_manifest_sha256=SHA,
        requests=3,
        top_k=5,
        rbo_p=0.8,
        rbo_mean=0.6667,
        overlap_mean=0.8333,
        top1_change_rate=0.3333,
        max_score_diff_p99=1.0,
        source="generated: 3 requests, seed 7",
    )
    # The bytes a file gets are stable and read back as the same block.
    assert ExpectedDivergence.model_validate_json(block_json(block)) == block
    assert block_json(block) == block_json(
        ExpectedDivergence.model_validate_json(block_json(block))
    )
    with pytest.raises(ConfigError, match="no requests were compared"):
        expected_divergence(
            DivergenceTotals(), baseline_artifact_id="b", baseline_manifest_sha256=SHA
        )
    with pytest.raises(ConfigError, match=r"expected_divergence\.baseline_manifest_sha256"):
        expected_divergence(totals, baseline_artifact_id="b", baseline_manifest_sha256="xyz")


def test_replay_expectation_records_the_requests_source(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(body(n=5, top_n=5)) for _ in range(4)) + "\n")
    block, totals = replay_expectation(
        ByFeature("ranker-v41", 0),
        ByFeature("ranker-v43", 2),
        requests_file(path),
        baseline_manifest_sha256=SHA,
    )
    assert totals.compared == block.requests == 4
    assert block.baseline_artifact_id == "ranker-v41"
    assert block.source == "requests file r.jsonl: 4 requests"
    assert (block.top_k, block.rbo_p) == (10, 0.9)
