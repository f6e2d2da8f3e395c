"""The second shipped model family end to end: an application that registers only the
``two-tower`` family (``args.models``), serves its request schema over HTTP and is rolled
from two-tower-v1 to two-tower-v2 by its own rollout controller under load, in the session
cluster beside the ranker applications."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from app.demo_artifacts import TWO_TOWER_MODEL, make_two_tower_artifacts
from app.models.two_tower.features import FEATURE_SCHEMA as TWO_TOWER_SCHEMA
from app.models.two_tower.features import SCHEMA
from app.polling import wait_until
from tests.e2e.harness import (
    ONE_STEP_PLAN,
    Cluster,
    RolloutApp,
    RolloutEnv,
    failed,
    reset_rollout,
    rollout_application,
)

pytestmark = pytest.mark.e2e

TWO_TOWER_APP = RolloutApp(
    name="two-tower-e2e",
    prefix="/two-tower",
    model=TWO_TOWER_MODEL,
    baseline="two-tower-v1",
    candidate="two-tower-v2",
    controller="two-tower-controller",
    feature_schema=TWO_TOWER_SCHEMA,
    # Only the two-tower family: nothing of the ranker is needed to serve it.
    args={"models": ["app.models.two_tower"], "loading": {"model": TWO_TOWER_MODEL}},
)


@pytest.fixture(scope="module")
def two_tower(serve_cluster: Cluster) -> Iterator[RolloutEnv]:
    packed = {p.artifact_id: p for p in make_two_tower_artifacts(serve_cluster.work / "store")}
    with rollout_application(serve_cluster, "two_tower", TWO_TOWER_APP, packed) as env:
        yield env


@pytest.fixture
def tt_env(two_tower: RolloutEnv) -> Iterator[RolloutEnv]:
    assert two_tower.stable_target() == TWO_TOWER_APP.baseline
    yield two_tower
    reset_rollout(two_tower)


def test_the_app_speaks_the_two_tower_schema_over_http(tt_env: RolloutEnv) -> None:
    (body,) = SCHEMA.synthetic_bodies(1, seed=3, candidates=6, top_n=3)
    answer = httpx.post(f"{tt_env.url}/v1/rank", json={"user_id": "u-1", **body}, timeout=30)
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    ids = [r["id"] for r in doc["ranking"]]
    assert len(ids) == 3 and set(ids) <= {item["id"] for item in body["items"]}
    assert doc["model"]["artifact_id"] == TWO_TOWER_APP.baseline
    # A body of the ranker's schema is not this app's: 422 naming the field, nothing served.
    ranker_body = {"candidates": [{"id": "a", "features": [0.0] * 80}], "top_n": 1}
    refused = httpx.post(f"{tt_env.url}/v1/rank", content=json.dumps(ranker_body), timeout=30)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"] == "invalid_request" and refused.json()["field"]


def test_a_rollout_of_the_two_tower_family_promotes_under_load(tt_env: RolloutEnv) -> None:
    env = tt_env
    run = env.traffic()
    wait_until(lambda: len(run.records) >= 20, 60, "traffic flowing")
    started = run.now_s()
    env.start(TWO_TOWER_APP.candidate, ONE_STEP_PLAN)
    view = env.wait_for_phase("succeeded", "rolled_back", "failed", finished=True, timeout=150)
    records = run.stop()

    assert view["phase"] == "succeeded", (view["reason"], view["verdicts"], view["events"])
    assert not failed(records), failed(records)[:5]
    assert env.stable_target() == TWO_TOWER_APP.candidate
    canary = [r for r in records if r.start_s > started and r.cohort == "canary"]
    assert canary and {r.artifact_id for r in canary} == {TWO_TOWER_APP.candidate}
    assert {r.artifact_id for r in records if r.start_s > run.now_s() - 1} <= {
        TWO_TOWER_APP.candidate
    }
    history = env.registry.history(TWO_TOWER_MODEL, "default")
    assert any(
        h.cohort == "stable" and h.new_artifact_id == TWO_TOWER_APP.candidate for h in history
    )
