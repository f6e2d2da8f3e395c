"""Concurrent compare-and-set on both backends, with real threads and real processes.

Invariants: of N publishers on one expected revision exactly one wins; the revision rises by
exactly the number of wins; every win has exactly one audit row; a lost race is always a
RevisionConflict (never a driver error such as a unique violation)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from app.errors import RevisionConflict
from app.registry import Registry, TargetRecord
from tests.integration.backends import Backend
from tests.integration.registry_race_worker import publish_after_barrier

MODEL, ENV, COHORT = "ranker", "default", "stable"
THREADS = 8


def _race(registry: Registry, n: int, expected: int) -> list[TargetRecord | RevisionConflict]:
    """n threads, released together, each publishing on ``expected``."""
    barrier = threading.Barrier(n)

    def attempt(i: int) -> TargetRecord | RevisionConflict:
        barrier.wait(timeout=30)
        try:
            return registry.publish(
                MODEL, ENV, COHORT, f"v{i % 2}", expected, actor=f"t{i}", reason="race"
            )
        except RevisionConflict as exc:
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(attempt, range(n)))


def test_racing_first_publishers_create_one_target(
    registry: Registry, ready_artifacts: Callable[..., None]
) -> None:
    ready_artifacts("v0", "v1")

    outcomes = _race(registry, THREADS, expected=0)

    wins = [o for o in outcomes if isinstance(o, TargetRecord)]
    conflicts = [o for o in outcomes if isinstance(o, RevisionConflict)]
    assert len(wins) == 1, outcomes
    assert len(conflicts) == THREADS - 1, outcomes
    assert all(c.current is not None and c.current.revision == 1 for c in conflicts)
    assert registry.get_target(MODEL, ENV, COHORT).revision == 1
    assert len(registry.history(MODEL, ENV)) == 1


def test_racing_publishers_on_one_revision_have_exactly_one_winner(
    registry: Registry, ready_artifacts: Callable[..., None]
) -> None:
    ready_artifacts("v0", "v1")
    registry.publish(MODEL, ENV, COHORT, "v0", 0, actor="setup", reason="first")

    outcomes = _race(registry, THREADS, expected=1)

    wins = [o for o in outcomes if isinstance(o, TargetRecord)]
    assert len(wins) == 1, outcomes
    assert wins[0].revision == 2
    assert all(o.current == wins[0] for o in outcomes if isinstance(o, RevisionConflict))
    assert registry.get_target(MODEL, ENV, COHORT) == wins[0]
    assert [e.new_revision for e in registry.history(MODEL, ENV)] == [2, 1]


def test_read_then_cas_loops_raise_the_revision_by_exactly_the_wins(
    registry: Registry, ready_artifacts: Callable[..., None]
) -> None:
    ready_artifacts("v0", "v1")
    start = registry.publish(MODEL, ENV, COHORT, "v0", 0, actor="setup", reason="first")
    attempts_each, workers = 12, 6
    barrier = threading.Barrier(workers)
    wins_by_worker = [0] * workers

    def worker(i: int) -> None:
        barrier.wait(timeout=30)
        for n in range(attempts_each):
            seen = registry.get_target(MODEL, ENV, COHORT).revision
            try:
                registry.publish(
                    MODEL, ENV, COHORT, f"v{n % 2}", seen, actor=f"w{i}", reason=f"attempt {n}"
                )
                wins_by_worker[i] += 1
            except RevisionConflict:
                pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)

    wins = sum(wins_by_worker)
    assert wins >= 1
    final = registry.get_target(MODEL, ENV, COHORT)
    assert final.revision == start.revision + wins
    audit = registry.history(MODEL, ENV, limit=10_000)
    assert len(audit) == 1 + wins
    # One audit row per revision, each a step of exactly one from its predecessor.
    assert sorted(e.new_revision for e in audit) == list(range(1, final.revision + 1))
    assert all(e.new_revision == e.old_revision + 1 for e in audit)


def test_racing_processes_have_exactly_one_winner(
    backend: Backend, registry: Registry, ready_artifacts: Callable[..., None]
) -> None:
    ready_artifacts("v0", "v1")
    registry.publish(MODEL, ENV, COHORT, "v0", 0, actor="setup", reason="first")
    processes = 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=publish_after_barrier,
            args=(backend.url, barrier, f"v{i % 2}", 1, results),
        )
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    assert not [o for o in outcomes if o[0] == "error"], outcomes
    assert sorted(outcomes) == [("conflict", 2)] * (processes - 1) + [("won", 2)]
    assert registry.get_target(MODEL, ENV, COHORT).revision == 2
    assert len(registry.history(MODEL, ENV)) == 2
