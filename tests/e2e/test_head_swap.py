"""Backbone and head artifacts in the session cluster: an application whose stable serves
head-a on the backbone rb-1 is rolled to head-b, a head on the same backbone, under load by
its own controller; the controller swaps the head in place although the plan says ``shift``
(only the head changes, the budget has room), and every answer names head and backbone. A
head on another backbone (rb-2) is a full change: it promotes by the plan's shift, and its
answers name the new backbone."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.demo_artifacts import DEMO_PARAMS, pack_split_artifacts
from app.manifest import Architecture
from app.models.ranker_mlp import RANKER_MLP
from app.polling import wait_until
from app.request_bodies import rank_bodies
from tests.e2e.harness import (
    ONE_STEP_PLAN,
    Cluster,
    RolloutApp,
    RolloutEnv,
    failed,
    reset_rollout,
    rollout_application,
)

pytestmark = [pytest.mark.e2e, pytest.mark.backbone]

HEADS_APP = RolloutApp(
    name="heads-e2e",
    prefix="/heads",
    baseline="head-a",
    candidate="head-b",
    controller="heads-controller",
    artifacts=("rb-1", "rb-2", "head-c"),
)
ARCH = Architecture(name=RANKER_MLP, version=1, params=dict(DEMO_PARAMS))


@pytest.fixture(scope="module")
def heads(serve_cluster: Cluster) -> Iterator[RolloutEnv]:
    cluster = serve_cluster
    store = cluster.work / "head-store"
    one = pack_split_artifacts(
        store, ARCH, backbone_id="rb-1", backbone_seed=41, heads=[("head-a", 41), ("head-b", 43)]
    )
    two = pack_split_artifacts(
        store, ARCH, backbone_id="rb-2", backbone_seed=42, heads=[("head-c", 42)]
    )
    packed = {p.artifact_id: p for p in (one.backbone, *one.heads, two.backbone, *two.heads)}
    with rollout_application(cluster, "heads", HEADS_APP, packed) as env:
        yield env


@pytest.fixture
def env(heads: RolloutEnv) -> Iterator[RolloutEnv]:
    assert heads.stable_target() == HEADS_APP.baseline
    yield heads
    reset_rollout(heads)


def events(view: dict) -> list[tuple[str, str]]:
    return [(e["event"], e["message"]) for e in view["events"]]


def test_answers_name_the_head_and_its_backbone(env: RolloutEnv) -> None:
    (body,) = rank_bodies(1, seed=5, candidates=6, top_n=3)
    answer = httpx.post(f"{env.url}/v1/rank", json={"user_id": "u-1", **body}, timeout=30)
    assert answer.status_code == 200, answer.text
    model = answer.json()["model"]
    assert (model["artifact_id"], model["backbone_artifact_id"]) == ("head-a", "rb-1")
    assert answer.headers["x-model-backbone"] == "rb-1"
    assert answer.headers["x-model-artifact"] == "head-a"


def test_a_head_only_rollout_swaps_the_head_in_place_under_load(env: RolloutEnv) -> None:
    run = env.traffic()
    wait_until(lambda: len(run.records) >= 20, 60, "traffic flowing")
    env.start(HEADS_APP.candidate, ONE_STEP_PLAN)  # the plan says shift
    view = env.wait_for_phase("succeeded", "rolled_back", "failed", finished=True, timeout=150)
    records = run.stop()

    assert view["phase"] == "succeeded", (view["reason"], view["verdicts"], view["events"])
    assert not failed(records), failed(records)[:5]
    assert any(
        event == "promotion_strategy" and "only the head changes" in message
        for event, message in events(view)
    ), events(view)
    assert any(event == "promoting" and "in_place" in message for event, message in events(view)), (
        events(view)
    )
    answered = [r for r in records if r.artifact_id is not None]
    assert answered and {r.backbone for r in answered} == {"rb-1"}
    assert {r.artifact_id for r in answered} == {"head-a", "head-b"}
    assert env.stable_target() == HEADS_APP.candidate
    rows = env.status()["replicas"]
    stable = [r for r in rows if r["cohort"] == "stable"]
    assert stable and all((r["actual"], r["backbone"]) == ("head-b", "rb-1") for r in stable), rows


def test_a_head_on_another_backbone_promotes_by_the_plan(env: RolloutEnv) -> None:
    run = env.traffic()
    wait_until(lambda: len(run.records) >= 20, 60, "traffic flowing")
    env.start("head-c", ONE_STEP_PLAN)
    view = env.wait_for_phase("succeeded", "rolled_back", "failed", finished=True, timeout=150)
    records = run.stop()

    assert view["phase"] == "succeeded", (view["reason"], view["verdicts"], view["events"])
    assert not failed(records), failed(records)[:5]
    assert not any(event == "promotion_strategy" for event, _ in events(view)), events(view)
    assert any(event == "promoting" and "shift" in message for event, message in events(view)), (
        events(view)
    )
    # Every answer names the backbone its head runs on (head-b may still answer at first:
    # the previous test's stable, being rolled back to head-a).
    runs_on = {"head-a": "rb-1", "head-b": "rb-1", "head-c": "rb-2"}
    answered = [r for r in records if r.artifact_id is not None]
    assert all(r.backbone == runs_on[r.artifact_id] for r in answered), answered[:5]
    last = [r for r in answered if r.start_s > run.now_s() - 1]
    assert last and {(r.artifact_id, r.backbone) for r in last} == {("head-c", "rb-2")}
