"""GenerationHolder semantics with real threads: pinning across a switch, fresh requests on
the new generation, stale rejection, rollback, exactly-once cleanup outside the lock, cleanup
failure isolation and event-based release."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from app.errors import ConsistencyError, NotReady
from app.generations import Generation, GenerationHolder

TIMEOUT = 10.0


class ToyModel:
    """Scores value + bias; refuses to work once closed (a freed model must never be used)."""

    def __init__(self, bias: int, event: Any = None) -> None:
        self.bias = bias
        self.closed = False
        self.event = event

    def score(self, value: int) -> int:
        if self.closed:
            raise RuntimeError("model used after cleanup")
        return value + self.bias

    def release_event(self) -> Any:
        return self.event

    def close(self) -> None:
        self.closed = True


class Cleaner:
    """Counts cleanups per generation and closes the model."""

    def __init__(self, fail_for: set[str] | None = None) -> None:
        self.calls: Counter[Generation] = Counter()
        self.threads: set[str] = set()
        self.fail_for = fail_for or set()
        self._lock = threading.Lock()

    def __call__(self, generation: Generation) -> None:
        with self._lock:
            self.calls[generation] += 1
            self.threads.add(threading.current_thread().name)
        if generation.artifact_id in self.fail_for:
            raise OSError("device busy")
        generation.model.close()


def _gen(revision: int, artifact_id: str, bias: int | None = None, event: Any = None) -> Generation:
    return Generation(revision, artifact_id, ToyModel(revision if bias is None else bias, event))


def _install(holder: GenerationHolder, gen: Generation) -> bool:
    holder.set_desired(gen.revision, gen.artifact_id)
    return holder.install(gen)


@pytest.fixture
def cleaner() -> Cleaner:
    return Cleaner()


@pytest.fixture
def holder(cleaner: Cleaner):
    h = GenerationHolder(cleaner)
    yield h
    h.close(timeout=TIMEOUT)


def test_in_flight_request_stays_on_its_generation_while_fresh_ones_see_the_new(holder, cleaner):
    v41 = _gen(100, "ranker-v41", bias=41)
    assert _install(holder, v41)

    borrowed = threading.Barrier(2, timeout=TIMEOUT)
    finish = threading.Event()
    old_answer: list[tuple[str, int]] = []

    def old_request() -> None:
        with holder.borrow() as gen:
            borrowed.wait()
            assert finish.wait(TIMEOUT)
            old_answer.append((gen.artifact_id, gen.model.score(1)))

    t = threading.Thread(target=old_request)
    t.start()
    borrowed.wait()  # the old request holds v41

    v42 = _gen(101, "ranker-v42", bias=42)
    assert _install(holder, v42)
    with holder.borrow() as fresh:
        assert (fresh.artifact_id, fresh.model.score(1)) == ("ranker-v42", 43)
    assert v41.retired and v41.refs == 1
    assert not v41.cleanup_queued and not v41.model.closed  # pinned by the old request

    finish.set()
    t.join(TIMEOUT)
    assert old_answer == [("ranker-v41", 42)]
    assert holder.wait_idle(TIMEOUT)
    assert v41.model.closed and cleaner.calls[v41] == 1
    assert not v42.model.closed and holder.current is v42


def test_one_cleanup_when_many_borrowers_release_at_once(holder, cleaner):
    borrowers = 16
    for round_ in range(10):
        old = _gen(2 * round_ + 1, f"ranker-r{round_}")
        assert _install(holder, old)
        all_borrowed = threading.Barrier(borrowers + 1, timeout=TIMEOUT)
        release = threading.Event()

        def request(old: Generation = old, all_borrowed=all_borrowed, release=release) -> None:
            with holder.borrow() as gen:
                assert gen is old
                all_borrowed.wait()
                assert release.wait(TIMEOUT)
                gen.model.score(0)

        threads = [threading.Thread(target=request) for _ in range(borrowers)]
        for t in threads:
            t.start()
        all_borrowed.wait()
        assert old.refs == borrowers
        new = _gen(2 * round_ + 2, f"ranker-r{round_}b")
        assert _install(holder, new)
        release.set()  # all borrowers release together
        for t in threads:
            t.join(TIMEOUT)
        assert holder.wait_idle(TIMEOUT)
        assert cleaner.calls[old] == 1 and old.model.closed
        assert old.refs == 0
    assert cleaner.threads == {"generation-cleanup"}


def test_switch_storm_never_uses_a_cleaned_model_and_cleans_each_once(holder, cleaner):
    stop = threading.Event()
    errors: list[BaseException] = []
    served = Counter[str]()
    lock = threading.Lock()

    def traffic() -> None:
        while not stop.is_set():
            try:
                with holder.borrow() as gen:
                    gen.model.score(1)  # raises if cleanup ran while borrowed
                    with lock:
                        served[gen.artifact_id] += 1
            except BaseException as exc:  # reported by the assert below
                errors.append(exc)
                return

    generations = [_gen(r, f"ranker-{r}") for r in range(1, 61)]
    assert _install(holder, generations[0])
    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for t in threads:
        t.start()
    for gen in generations[1:]:
        assert _install(holder, gen)
    stop.set()
    for t in threads:
        t.join(TIMEOUT)
    assert holder.wait_idle(TIMEOUT)
    assert errors == []
    assert sum(served.values()) > 0
    assert all(cleaner.calls[g] == 1 for g in generations[:-1])
    assert cleaner.calls[generations[-1]] == 0


def test_stale_candidate_is_rejected_after_a_newer_target_and_rollback_wins(holder, cleaner):
    v41 = _gen(100, "ranker-v41")
    assert _install(holder, v41)
    holder.set_desired(101, "ranker-v42")  # v42 starts loading (slowly) ...
    holder.set_desired(102, "ranker-v41")  # ... and the operator rolls back meanwhile
    stale_v42 = _gen(101, "ranker-v42")
    assert not holder.install(stale_v42)
    assert holder.current is v41
    rollback = _gen(102, "ranker-v41")
    assert holder.install(rollback)
    assert holder.wait_idle(TIMEOUT)
    assert cleaner.calls[stale_v42] == 1 and stale_v42.model.closed
    assert cleaner.calls[v41] == 1
    with holder.borrow() as gen:
        assert (gen.revision, gen.artifact_id) == (102, "ranker-v41")


def test_candidate_must_be_desired_and_newer(holder, cleaner):
    current = _gen(5, "a")
    assert _install(holder, current)
    not_desired = _gen(6, "b")  # nobody asked for it
    assert not holder.install(not_desired)
    same_revision = _gen(5, "a")
    assert not holder.install(same_revision)
    assert holder.wait_idle(TIMEOUT)
    assert holder.current is current
    assert cleaner.calls[not_desired] == cleaner.calls[same_revision] == 1
    with pytest.raises(ValueError, match="already installed"):
        holder.install(current)


def test_desired_revisions(holder):
    assert holder.desired == (0, "")
    assert holder.set_desired(3, "x")
    assert holder.set_desired(3, "x")  # repeated notification
    assert not holder.set_desired(2, "y")  # late
    with pytest.raises(ConsistencyError):
        holder.set_desired(3, "y")
    assert holder.desired == (3, "x")


def test_not_ready_before_install_and_after_close(cleaner):
    holder = GenerationHolder(cleaner)
    with pytest.raises(NotReady), holder.borrow():
        pass
    gen = _gen(1, "a")
    assert _install(holder, gen)
    assert holder.close(TIMEOUT)
    assert cleaner.calls[gen] == 1
    with pytest.raises(NotReady, match="closed"), holder.borrow():
        pass
    late = _gen(2, "b")
    holder.set_desired(2, "b")
    assert not holder.install(late)  # cleaned in the caller's thread, the worker is gone
    assert cleaner.calls[late] == 1


def test_close_waits_for_borrowers_then_cleans(cleaner):
    holder = GenerationHolder(cleaner)
    gen = _gen(1, "a")
    assert _install(holder, gen)
    cm = holder.borrow()
    cm.__enter__()
    assert not holder.close(timeout=0.05)  # still borrowed
    assert cleaner.calls[gen] == 0
    cm.__exit__(None, None, None)
    assert holder.wait_idle(TIMEOUT)
    assert cleaner.calls[gen] == 1


def test_cleanup_runs_on_the_worker_outside_the_lock(cleaner):
    inside: list[tuple[str, int | None]] = []

    def cleanup(generation: Generation) -> None:
        # Both take the holder's lock: a cleanup run under it would deadlock here.
        current = holder.current
        with holder.borrow() as gen:
            inside.append((threading.current_thread().name, gen.revision))
        assert current is not None
        cleaner(generation)

    holder = GenerationHolder(cleanup)
    assert _install(holder, _gen(1, "a"))
    assert _install(holder, _gen(2, "b"))
    assert holder.wait_idle(TIMEOUT)
    assert inside == [("generation-cleanup", 2)]
    holder.close(TIMEOUT)


def test_cleanup_failure_is_recorded_and_touches_no_answer():
    cleaner = Cleaner(fail_for={"ranker-v1"})
    holder = GenerationHolder(cleaner)
    v1 = _gen(1, "ranker-v1", bias=10)
    assert _install(holder, v1)
    borrowed = threading.Barrier(2, timeout=TIMEOUT)
    finish = threading.Event()
    answers: list[int] = []

    def request() -> None:
        with holder.borrow() as gen:
            borrowed.wait()
            assert finish.wait(TIMEOUT)
            answers.append(gen.model.score(1))

    t = threading.Thread(target=request)
    t.start()
    borrowed.wait()
    assert _install(holder, _gen(2, "ranker-v2", bias=20))
    finish.set()
    t.join(TIMEOUT)
    assert holder.wait_idle(TIMEOUT)
    assert answers == [11]  # answered by v1 before its cleanup failed
    assert v1.cleanup_error == "OSError: device busy" and not v1.cleaned
    [failure] = holder.cleanup_failures
    assert (failure.revision, failure.artifact_id) == (1, "ranker-v1")
    # The holder carries on: serving, switching and cleaning the next one.
    with holder.borrow() as gen:
        assert gen.model.score(1) == 21
    v2 = holder.current
    assert _install(holder, _gen(3, "ranker-v3"))
    assert holder.wait_idle(TIMEOUT)
    assert v2 is not None and v2.cleaned and v2.model.closed
    assert holder.close(TIMEOUT)


class PolledEvent:
    """Duck-typed CUDA event: query() says whether the 'GPU' finished."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.polled = threading.Event()

    def query(self) -> bool:
        self.polled.set()
        return self.done.is_set()


class BlockingEvent:
    """An event with synchronize() only."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waiting = threading.Event()

    def synchronize(self) -> None:
        self.waiting.set()
        assert self.done.wait(TIMEOUT)


@pytest.mark.parametrize("event_type", [PolledEvent, BlockingEvent])
def test_release_waits_for_the_generation_event_not_the_python_return(cleaner, event_type):
    holder = GenerationHolder(cleaner)
    event = event_type()
    old = _gen(1, "gpu-v1", event=event)
    assert _install(holder, old)
    with holder.borrow() as gen:
        gen.model.score(1)  # kernels "queued"; the borrow records the model's release event
    assert _install(holder, _gen(2, "gpu-v2"))
    # The worker is now waiting on the event; the model must still be alive.
    started = event.polled if isinstance(event, PolledEvent) else event.waiting
    assert started.wait(TIMEOUT)
    assert cleaner.calls[old] == 0 and not old.model.closed
    event.done.set()  # the GPU finishes
    assert holder.wait_idle(TIMEOUT)
    assert cleaner.calls[old] == 1 and old.model.closed
    holder.close(TIMEOUT)


def test_an_event_that_never_completes_leaves_the_model_uncleaned_and_recorded(cleaner):
    holder = GenerationHolder(cleaner, event_timeout_s=0.05)
    event = PolledEvent()  # never done
    old = _gen(1, "gpu-v1", event=event)
    assert _install(holder, old)
    with holder.borrow():
        pass
    assert _install(holder, _gen(2, "gpu-v2"))
    assert holder.wait_idle(TIMEOUT)
    assert cleaner.calls[old] == 0 and not old.model.closed  # never freed under the GPU
    assert "release event not complete" in (old.cleanup_error or "")
    holder.close(TIMEOUT)


def test_retire_current_lets_borrowers_finish_then_cleans_up_once(holder, cleaner):
    v42 = _gen(7, "ranker-v42", bias=42)
    assert _install(holder, v42)
    borrowed = threading.Barrier(2, timeout=TIMEOUT)
    finish = threading.Event()
    answers: list[int] = []

    def request() -> None:
        with holder.borrow() as gen:
            borrowed.wait()
            assert finish.wait(TIMEOUT)
            answers.append(gen.model.score(1))

    t = threading.Thread(target=request)
    t.start()
    borrowed.wait()
    assert holder.retire_current() is v42
    assert holder.current is None
    with pytest.raises(NotReady), holder.borrow():
        pass
    assert v42.retired and not v42.model.closed  # pinned by the request in flight
    finish.set()
    t.join(TIMEOUT)
    assert answers == [43]
    assert holder.wait_idle(TIMEOUT)
    assert v42.model.closed and cleaner.calls[v42] == 1
    assert holder.retire_current() is None  # nothing left: no second cleanup
    assert cleaner.calls[v42] == 1


def test_install_after_retire_current(holder, cleaner):
    assert _install(holder, _gen(7, "ranker-v42"))
    holder.retire_current()
    # Same target again, or a newer one, installs; an older revision stays refused.
    assert not _install_quietly(holder, _gen(6, "ranker-v41"))
    again = _gen(7, "ranker-v42")
    assert _install(holder, again) and holder.current is again
    newer = _gen(8, "ranker-v43")
    assert _install(holder, newer) and holder.current is newer
    assert holder.wait_idle(TIMEOUT)


def _install_quietly(holder: GenerationHolder, gen: Generation) -> bool:
    if not holder.set_desired(gen.revision, gen.artifact_id):
        holder.install(gen)  # refused and cleaned up
        return False
    return holder.install(gen)
