"""Fixtures of the e2e suite; what they set up is tests/e2e/harness.py.

- ``serve_cluster`` (session): one real Ray cluster with Serve, and no application of the
  tests' own yet (the modules that deploy their own apps take this one).
- ``cluster`` (session): ``serve_cluster`` with the data-plane ``ranker`` app, deployed when
  the first test asks for it (after the modules on ``rollout-e2e``, which run first) and
  removed after the last test of the session that uses it (``pytest_runtest_teardown``), so
  it does not idle beside the modules after it (about an eighth of a core, measured: its
  replicas' reports and its router's probes).
- ``serving`` (per test): the session cluster after a cheap reset to its baseline.
- ``env`` (session): the ``rollout-e2e`` app in the session cluster, driven by the real rollout
  controller, with its registry; deployed once for every module that uses it (a deploy costs
  about 30 s of this machine's two cores). Those modules run first, one after another
  (``pytest_collection_modifyitems``), and the app is removed after the last of their tests
  (``pytest_runtest_teardown``), so it never idles beside the other modules. First, because
  the session cluster slows as it ages: run after the other modules, the same rollout
  scenarios took about twice as long (the likely cause: every replica started leaves series in
  the node's metrics export, which the controller and Ray's agent go through on every scrape;
  the export's growth itself was not measured).
- ``rollout_env`` (per test): ``env`` with stable on the baseline and no rollout running, at
  the start and at the end (the undos a test deferred to the next user of the app run first).
- ``scenario`` (per test): a tests/e2e/dsl.py ``Scenario`` on ``rollout_env``, closed (its
  cleanups run, its account printed) at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.e2e.dsl import Scenario
from tests.e2e.harness import (
    BASELINE,
    Cluster,
    RolloutEnv,
    ranker_application,
    reset_rollout,
    reset_serving,
    rollout_application,
    session_cluster,
)


@pytest.fixture(scope="session")
def serve_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with session_cluster(tmp_path_factory.mktemp("e2e")) as c:
        yield c


# Holds the session's data-plane app, so that it can be removed after its last user.
_RANKER_APP = ExitStack()
# The last test of the session (in its run order) that uses ``cluster``: set at collection.
_LAST_RANKER_USER: list[pytest.Item] = []


@pytest.fixture(scope="session")
def cluster(serve_cluster: Cluster) -> Cluster:
    _RANKER_APP.enter_context(ranker_application(serve_cluster))
    return serve_cluster


@pytest.fixture
def serving(cluster: Cluster) -> Iterator[Cluster]:
    reset_serving(cluster)
    yield cluster


# Holds the session's rollout-e2e app, so that it can be removed before the session ends.
_ROLLOUT_APP = ExitStack()


@pytest.fixture(scope="session")
def env(serve_cluster: Cluster) -> Iterator[RolloutEnv]:
    environment = _ROLLOUT_APP.enter_context(rollout_application(serve_cluster, "session"))
    yield environment
    _ROLLOUT_APP.close()  # nothing left to do when the last test using it removed it


def uses_session_fixture(item: pytest.Item, name: str) -> bool:
    """Whether ``item`` uses this file's session fixture ``name``: a module may define its own
    fixture of that name (``env``: another family's app), which does not count."""
    defs = item._fixtureinfo.name2fixturedefs.get(name) or ()
    return bool(defs) and defs[-1].scope == "session"


def uses_the_session_rollout_app(item: pytest.Item) -> bool:
    return uses_session_fixture(item, "env")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules on the session's ``rollout-e2e`` app first, in their order (a module stays in
    one piece: its module-scoped fixtures are set up once), except that those whose module
    sets ``CHANGES_THE_SHARED_APP`` come last among them: the restart that undoes their change
    (``RolloutEnv.restore_before_next_use``) is then paid only when a later test asks for the
    app."""
    shared = {item.module for item in items if uses_the_session_rollout_app(item)}
    items.sort(
        key=lambda item: (
            item.module not in shared,
            bool(getattr(item.module, "CHANGES_THE_SHARED_APP", False)),
        )
    )
    users = [item for item in items if uses_session_fixture(item, "cluster")]
    _LAST_RANKER_USER[:] = users[-1:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test on the session's rollout-e2e app (its own teardown done), the app
    is removed, and the data-plane app after its last user: the modules after them do not
    share two cores with their idle replicas."""
    result = yield
    if uses_the_session_rollout_app(item) and (
        nextitem is None or not uses_the_session_rollout_app(nextitem)
    ):
        _ROLLOUT_APP.close()
    if item in _LAST_RANKER_USER:
        _RANKER_APP.close()
    return result


@pytest.fixture
def rollout_env(env: RolloutEnv) -> Iterator[RolloutEnv]:
    env.restore_if_changed()
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
