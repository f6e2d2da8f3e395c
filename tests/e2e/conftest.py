"""Fixtures of the e2e suite; what they set up is tests/e2e/harness.py.

- ``cluster`` (session): one real Ray cluster with Serve and the ``ranker`` app.
- ``serving`` (per test): the session cluster after a cheap reset to its baseline.
- ``env`` (module): the ``rollout-e2e`` app in the session cluster, driven by the real rollout
  controller, with a registry per module (the application, and so its replicas' revision
  memory, is new for every module: revisions start again from 1).
- ``rollout_env`` (per test): ``env`` with stable on the baseline and no rollout running, at
  the start and at the end.
- ``scenario`` (per test): a tests/e2e/dsl.py ``Scenario`` on ``rollout_env``, closed (its
  cleanups run, its account printed) at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.dsl import Scenario
from tests.e2e.harness import (
    BASELINE,
    Cluster,
    RolloutEnv,
    reset_rollout,
    reset_serving,
    rollout_application,
    session_cluster,
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with session_cluster(tmp_path_factory.mktemp("e2e")) as c:
        yield c


@pytest.fixture
def serving(cluster: Cluster) -> Iterator[Cluster]:
    reset_serving(cluster)
    yield cluster


@pytest.fixture(scope="module")
def env(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[RolloutEnv]:
    module = request.module.__name__.rsplit(".", 1)[-1]
    with rollout_application(cluster, module) as environment:
        yield environment


@pytest.fixture
def rollout_env(env: RolloutEnv) -> Iterator[RolloutEnv]:
    assert env.stable_target() == BASELINE
    yield env
    reset_rollout(env)


@pytest.fixture
def scenario(rollout_env: RolloutEnv, request: pytest.FixtureRequest) -> Iterator[Scenario]:
    s = Scenario(rollout_env, request.node.name)
    try:
        yield s
    finally:
        s.close()
