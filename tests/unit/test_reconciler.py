"""The reconciler's worker with named fake loaders (no Ray, no torch).

Loads are held with events the test releases, never with sleeps.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from app.contracts import MAX_TEXT, ReplicaPhase, Target
from app.errors import ArtifactRejected, FetchFailed
from app.loading.control import LoadControl, lower_thread_priority
from app.loading.failures import is_retryable
from app.polling import wait_until
from app.reconciler import (
    BackoffPolicy,
    Decision,
    ReconcileEvent,
    Reconciler,
)

WAIT_S = 5.0  # for a loader thread to get where a test waits for it
FAST = BackoffPolicy(initial_s=0.01, multiplier=2.0, cap_s=0.05, max_attempts=4)


def target(revision: int, artifact: str = "a") -> Target:
    return Target(
        revision=revision,
        artifact_id=artifact,
        manifest_uri=f"file:///store/{artifact}/manifest.json",
        manifest_sha256=(artifact.encode().hex() * 64)[:64],
        feature_schema="ranker-features-v3",
    )


@dataclass
class Loaded:
    target: Target
    discarded: bool = False


@dataclass
class GatedLoader:
    """Loads block until their artifact's gate is opened; scripted failures per artifact."""

    gates: dict[str, threading.Event] = field(default_factory=dict)
    failures: dict[str, list[Exception]] = field(default_factory=dict)
    started: list[Target] = field(default_factory=list)
    installed: list[Target] = field(default_factory=list)
    discarded: list[Target] = field(default_factory=list)
    retired: list[Target | None] = field(default_factory=list)
    refuse_install: bool = False

    def gate(self, artifact: str) -> threading.Event:
        return self.gates.setdefault(artifact, threading.Event())

    checkpointing: bool = False  # wait at checkpoints, as real loads do between chunks

    def load(self, t: Target, control: LoadControl | None = None) -> Loaded:
        self.started.append(t)
        if t.artifact_id in self.gates:
            gate = self.gates[t.artifact_id]
            if self.checkpointing:
                assert control is not None
                deadline = time.monotonic() + 10
                while not gate.wait(0.01):
                    control.checkpoint()
                    assert time.monotonic() < deadline, "gate never opened"
            else:
                assert gate.wait(10), "gate never opened"
        script = self.failures.get(t.artifact_id)
        if script:
            raise script.pop(0)
        return Loaded(t)

    def install(self, t: Target, loaded: Loaded) -> bool:
        if self.refuse_install:
            return False
        self.installed.append(t)
        return True

    def discard(self, loaded: Loaded) -> None:
        loaded.discarded = True
        self.discarded.append(loaded.target)

    def retire(self) -> None:
        self.retired.append(self.installed[-1] if self.installed else None)


@pytest.fixture
def events() -> list[ReconcileEvent]:
    return []


def make(loader: GatedLoader, events: list[ReconcileEvent]) -> Reconciler[Loaded]:
    return Reconciler(loader, policy=FAST, on_event=events.append, rng=random.Random(1))


def test_startup_load_is_synchronous() -> None:
    loader = GatedLoader()
    rec = make(loader, [])
    rec.load_blocking(target(1))
    snap = rec.snapshot()
    assert snap.actual == target(1) and snap.phase is ReplicaPhase.READY
    assert loader.installed == [target(1)]
    rec.close()


def test_startup_failure_raises_and_installs_nothing() -> None:
    loader = GatedLoader(failures={"bad": [ArtifactRejected("schema", "wrong schema")]})
    rec = make(loader, [])
    with pytest.raises(ArtifactRejected, match="schema"):
        rec.load_blocking(target(1, "bad"))
    assert loader.installed == [] and rec.snapshot().actual is None
    rec.close()


def test_startup_retries_transient_failures() -> None:
    loader = GatedLoader(failures={"a": [OSError("connection reset")]})
    rec = make(loader, [])
    rec.load_blocking(target(1))
    assert rec.snapshot().actual == target(1)
    assert len(loader.started) == 2
    rec.close()


def test_submit_returns_at_once_and_the_worker_installs(events: list[ReconcileEvent]) -> None:
    loader = GatedLoader()
    gate = loader.gate("b")
    rec = make(loader, events)
    rec.load_blocking(target(1, "a"))
    assert rec.submit(target(2, "b")) is Decision.ACCEPTED  # returns while the load is held
    wait_until(
        lambda: loader.started[-1] == target(2, "b"), WAIT_S, "load of b started", every=0.005
    )
    assert rec.snapshot().actual == target(1, "a")
    assert rec.snapshot().phase is ReplicaPhase.LOADING
    gate.set()
    assert rec.wait_settled(5)
    assert rec.snapshot().actual == target(2, "b")
    assert [e.kind for e in events][-2:] == ["loading", "installed"]
    rec.close()


def test_unchanged_late_and_conflicting_targets(events: list[ReconcileEvent]) -> None:
    loader = GatedLoader()
    rec = make(loader, events)
    rec.load_blocking(target(5, "a"))
    assert rec.submit(target(5, "a")) is Decision.UNCHANGED
    assert rec.submit(target(4, "z")) is Decision.LATE
    assert rec.submit(target(5, "z")) is Decision.CONFLICT
    assert rec.wait_settled(5)
    assert loader.installed == [target(5, "a")]  # nothing else was even loaded
    assert [t.artifact_id for t in loader.started] == ["a"]
    assert {e.kind for e in events} >= {"unchanged", "late", "conflict"}
    rec.close()


def test_slow_candidate_overtaken_by_a_newer_target_never_installs(
    events: list[ReconcileEvent],
) -> None:
    # Regression guard for "desired is re-checked before install": a rollback issued while a
    # slow candidate downloads must win, and the candidate must never serve.
    loader = GatedLoader()
    slow = loader.gate("slow")
    rec = make(loader, events)
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "slow"))
    wait_until(
        lambda: loader.started[-1].artifact_id == "slow", WAIT_S, "slow load started", every=0.005
    )
    assert rec.submit(target(3, "a")) is Decision.ACCEPTED  # rollback to the old artifact
    slow.set()
    assert rec.wait_settled(5)
    assert target(2, "slow") not in loader.installed
    assert loader.discarded == [target(2, "slow")]
    snap = rec.snapshot()
    assert snap.actual == target(3, "a") and snap.discarded == (2,)
    rec.close()


def test_a_newer_target_cancels_a_load_at_its_next_checkpoint(
    events: list[ReconcileEvent],
) -> None:
    # A multi-GB load superseded by a rollback must not run to its end to be discarded: it
    # stops at its next checkpoint (the gate of "slow" is never opened), without an error.
    loader = GatedLoader(checkpointing=True)
    loader.gate("slow")
    rec = make(loader, events)
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "slow"))
    wait_until(
        lambda: loader.started[-1].artifact_id == "slow", WAIT_S, "slow load started", every=0.005
    )
    assert rec.submit(target(3, "a")) is Decision.ACCEPTED
    assert rec.wait_settled(5), "the cancelled load never stopped"
    snap = rec.snapshot()
    assert snap.actual == target(3, "a") and snap.phase is ReplicaPhase.READY
    assert snap.last_error is None and snap.progress is None
    assert snap.cancelled == (2,) and snap.discarded == ()
    assert target(2, "slow") not in loader.installed
    kinds = [(e.kind, e.target.revision if e.target else None) for e in events]
    assert ("cancelled", 2) in kinds and ("failed", 2) not in kinds
    rec.close()


def test_clear_cancels_a_load_in_flight_and_goes_idle() -> None:
    loader = GatedLoader(checkpointing=True)
    loader.gate("b")
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    wait_until(lambda: loader.started[-1].artifact_id == "b", WAIT_S, "b loading", every=0.005)
    assert rec.clear()
    assert rec.wait_settled(5), "the cancelled load never stopped"
    snap = rec.snapshot()
    assert snap.actual is None and snap.phase is ReplicaPhase.IDLE and snap.last_error is None
    assert loader.installed == [target(1, "a")]
    rec.close()


def test_a_load_in_progress_shows_its_progress() -> None:
    seen: list[LoadControl] = []
    release = threading.Event()

    class Counting(GatedLoader):
        def load(self, t: Target, control: LoadControl | None = None) -> Loaded:
            assert control is not None
            seen.append(control)
            control.begin("fetch", 1000)
            control.advance("fetch", 250)
            assert release.wait(10)
            return Loaded(t)

    rec = make(Counting(), [])
    rec.submit(target(1, "a"))
    wait_until(lambda: rec.snapshot().progress is not None, WAIT_S, "progress", every=0.005)
    progress = rec.snapshot().progress
    assert progress is not None
    assert (progress.stage, progress.done_bytes, progress.total_bytes) == ("fetch", 250, 1000)
    release.set()
    assert rec.wait_settled(5)
    assert rec.snapshot().progress is None
    rec.close()


def test_latest_target_wins_over_pending_ones() -> None:
    loader = GatedLoader()
    first = loader.gate("b")
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    wait_until(lambda: loader.started[-1].artifact_id == "b", WAIT_S, "b loading", every=0.005)
    rec.submit(target(3, "c"))
    rec.submit(target(4, "d"))  # c is never started: it was superseded while pending
    first.set()
    assert rec.wait_settled(5)
    assert [t.artifact_id for t in loader.started] == ["a", "b", "d"]
    assert rec.snapshot().actual == target(4, "d")
    rec.close()


def test_a_final_failure_keeps_the_serving_target(events: list[ReconcileEvent]) -> None:
    loader = GatedLoader(failures={"bad": [ArtifactRejected("dry_run", "NaN in output")]})
    rec = make(loader, events)
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "bad"))
    assert rec.wait_settled(5)
    snap = rec.snapshot()
    assert snap.actual == target(1, "a")
    assert snap.phase is ReplicaPhase.FAILED
    assert snap.last_error is not None and snap.last_error.category == "dry_run"
    assert snap.last_error.revision == 2
    assert len([t for t in loader.started if t.artifact_id == "bad"]) == 1  # not retried
    failed = [e for e in events if e.kind == "failed"]
    assert failed and failed[-1].error and failed[-1].error.artifact_id == "bad"
    rec.close()


def test_a_failure_with_a_huge_message_is_reported_cut_to_the_bounds() -> None:
    # e.g. a state-dict mismatch of a big architecture names every key it misses
    huge = ArtifactRejected("load", "missing keys " + "blocks.0.weight, " * 2000)
    loader = GatedLoader(failures={"bad": [huge]})
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "bad"))
    assert rec.wait_settled(5)
    snap = rec.snapshot()
    assert snap.phase is ReplicaPhase.FAILED and snap.last_error is not None
    assert snap.last_error.category == "load" and snap.last_error.revision == 2
    assert len(snap.last_error.message) == MAX_TEXT
    assert snap.last_error.message.startswith("load: missing keys blocks.0.weight, ")
    rec.close()


def test_transient_failures_back_off_then_succeed(events: list[ReconcileEvent]) -> None:
    loader = GatedLoader(
        failures={"b": [OSError("reset"), ArtifactRejected("digest", "short read")]}
    )
    rec = make(loader, events)
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    assert rec.wait_settled(5)
    assert rec.snapshot().actual == target(2, "b")
    retries = [e for e in events if e.kind == "retry_scheduled"]
    assert [e.attempt for e in retries] == [1, 2]
    assert all(e.retry_in_s is not None and 0 < e.retry_in_s <= FAST.cap_s for e in retries)
    rec.close()


def test_transient_failures_give_up_after_max_attempts() -> None:
    loader = GatedLoader(failures={"b": [OSError("down")] * 10})
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    assert rec.wait_settled(5)
    snap = rec.snapshot()
    assert snap.phase is ReplicaPhase.FAILED and snap.actual == target(1, "a")
    assert len([t for t in loader.started if t.artifact_id == "b"]) == FAST.max_attempts
    rec.close()


def test_a_new_target_cuts_a_backoff_short() -> None:
    slow_policy = BackoffPolicy(initial_s=30, cap_s=30, max_attempts=5)
    loader = GatedLoader(failures={"b": [OSError("down")]})
    events: list[ReconcileEvent] = []
    rec = Reconciler(loader, policy=slow_policy, on_event=events.append)
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    wait_until(lambda: rec.snapshot().phase is ReplicaPhase.BACKOFF, WAIT_S, "backoff", every=0.005)
    rec.submit(target(3, "c"))
    assert rec.wait_settled(5)  # did not wait out the 15-30 s backoff
    assert rec.snapshot().actual == target(3, "c")
    rec.close()


def test_install_refused_by_the_holder_is_final() -> None:
    loader = GatedLoader()
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    loader.refuse_install = True
    rec.submit(target(2, "b"))
    assert rec.wait_settled(5)
    snap = rec.snapshot()
    assert snap.phase is ReplicaPhase.FAILED and snap.actual == target(1, "a")
    assert loader.discarded == [target(2, "b")]
    rec.close()


def test_resubmitting_the_actual_target_needs_no_load() -> None:
    loader = GatedLoader()
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    assert rec.submit(target(1, "a")) is Decision.UNCHANGED
    assert rec.wait_settled(1)
    assert len(loader.started) == 1
    rec.close()


def test_backoff_delays_grow_and_are_capped() -> None:
    policy = BackoffPolicy(initial_s=1.0, multiplier=2.0, cap_s=8.0)
    rng = random.Random(3)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        for _ in range(50):
            d = policy.delay(attempt, rng)
            assert ceiling / 2 <= d <= ceiling


def test_retryable_classification() -> None:
    assert is_retryable(OSError("x"))
    assert is_retryable(ArtifactRejected("digest", "x"))
    assert not is_retryable(ArtifactRejected("schema", "x"))
    assert not is_retryable(ValueError("x"))


def test_observer_errors_do_not_break_the_worker() -> None:
    loader = GatedLoader()

    def broken(event: ReconcileEvent) -> None:
        raise RuntimeError("observer bug")

    rec = Reconciler(loader, policy=FAST, on_event=broken)
    rec.load_blocking(target(1))
    rec.submit(target(2, "b"))
    assert rec.wait_settled(5)
    assert rec.snapshot().actual == target(2, "b")
    rec.close()


# --------------------------------------------------------------------------- cleared target


def test_clear_retires_the_serving_generation_and_goes_idle(
    events: list[ReconcileEvent],
) -> None:
    loader = GatedLoader()
    rec = make(loader, events)
    rec.load_blocking(target(3, "a"))
    assert rec.clear() is True
    snap = rec.snapshot()
    assert (snap.desired, snap.actual, snap.phase) == (None, None, ReplicaPhase.IDLE)
    assert loader.retired == [target(3, "a")]
    assert events[-1].kind == "cleared" and events[-1].target == target(3, "a")
    assert rec.clear() is False  # nothing left to clear: no second retire
    assert loader.retired == [target(3, "a")]
    rec.close()


def test_a_load_in_flight_when_the_target_is_cleared_is_discarded() -> None:
    loader = GatedLoader()
    slow = loader.gate("b")
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    wait_until(
        lambda: loader.started[-1].artifact_id == "b", WAIT_S, "load of b started", every=0.005
    )
    rec.clear()
    slow.set()
    assert rec.wait_settled(5)
    assert loader.installed == [target(1, "a")]
    assert loader.discarded == [target(2, "b")]
    snap = rec.snapshot()
    assert snap.actual is None and snap.phase is ReplicaPhase.IDLE and snap.discarded == (2,)
    rec.close()


def test_clear_stops_retries_of_a_failing_target() -> None:
    loader = GatedLoader(failures={"b": [OSError("reset")] * 10})
    rec = make(loader, [])
    rec.load_blocking(target(1, "a"))
    rec.submit(target(2, "b"))
    wait_until(lambda: len(loader.started) >= 2, WAIT_S, "first attempt of b", every=0.005)
    rec.clear()
    assert rec.wait_settled(5)
    started = len(loader.started)
    assert rec.snapshot().phase is ReplicaPhase.IDLE
    # No retry is scheduled any more: a new target is the next thing the worker loads.
    rec.submit(target(3, "c"))
    assert rec.wait_settled(5)
    assert [t.artifact_id for t in loader.started[started:]] == ["c"]
    assert rec.snapshot().actual == target(3, "c")
    rec.close()


def test_after_a_clear_newer_targets_load_and_older_ones_stay_late() -> None:
    loader = GatedLoader()
    rec = make(loader, [])
    rec.load_blocking(target(5, "a"))
    rec.clear()
    assert rec.submit(target(4, "z")) is Decision.LATE
    assert rec.submit(target(5, "z")) is Decision.CONFLICT
    assert rec.wait_settled(5) and rec.snapshot().actual is None
    # The cleared target itself again: nothing serves it any more, so it loads again.
    assert rec.submit(target(5, "a")) is Decision.ACCEPTED
    assert rec.wait_settled(5)
    assert rec.snapshot().actual == target(5, "a")
    assert rec.submit(target(6, "b")) is Decision.ACCEPTED
    assert rec.wait_settled(5)
    snap = rec.snapshot()
    assert snap.actual == target(6, "b") and snap.phase is ReplicaPhase.READY
    assert loader.installed == [target(5, "a"), target(5, "a"), target(6, "b")]
    rec.close()


def test_the_worker_priority_is_lowered_relative_to_the_threads_own() -> None:
    # Ray starts workers at niceness 15: an absolute niceness of 10 would have *raised* the
    # loader above the request threads wherever that is allowed (as root).
    seen: dict[str, int | str] = {}

    def body() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 15)  # raising niceness is always allowed
        seen["said"] = lower_thread_priority(10, idle=False)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)

    before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["after"] == 19, seen
    assert seen["said"] == "niceness 15 -> 19"
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # only that thread


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")
def test_the_worker_runs_at_idle_priority_and_only_the_worker() -> None:
    seen: dict[str, int | str] = {}

    def body() -> None:
        seen["said"] = lower_thread_priority(10)
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"said": "SCHED_IDLE", "policy": os.SCHED_IDLE}
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


@dataclass
class PriorityRecordingLoader(GatedLoader):
    """Records the scheduling policy and niceness of the thread each load runs on."""

    seen: list[tuple[int, int]] = field(default_factory=list)

    def load(self, t: Target, control: LoadControl | None = None) -> Loaded:
        tid = threading.get_native_id()
        self.seen.append((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
        return super().load(t, control)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")
def test_a_load_beside_a_served_model_is_niced_and_one_beside_none_is_sched_idle() -> None:
    # A SCHED_IDLE loader preempted while it holds the GIL would stall the request threads of
    # its own process: only a replica that serves nothing loads at SCHED_IDLE.
    loader = PriorityRecordingLoader()
    rec = Reconciler(loader, policy=FAST, rng=random.Random(1), worker_nice=3)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    rec.submit(target(1))  # an idle pool's first target: nothing serves here yet
    assert rec.wait_settled(5)
    rec.submit(target(2, "b"))  # revision 1 serves meanwhile
    assert rec.wait_settled(5)
    assert rec.clear()  # the served model retired: idle again
    rec.submit(target(3, "c"))
    assert rec.wait_settled(5)
    rec.close()
    assert [t.revision for t in loader.installed] == [1, 2, 3]
    assert loader.seen == [
        (os.SCHED_IDLE, mine),
        (os.SCHED_OTHER, min(19, mine + 3)),
        (os.SCHED_IDLE, mine),
    ]
    # Each load had a thread of its own: the caller's and the worker's priority are untouched.
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


# --------------------------------------------------------------------------- a worker that dies


class FailsOnce:
    """A dependency (the clock, the jitter source) whose first call from the worker raises
    an error nothing expects; every later call works."""

    def __init__(self, works: Callable[..., float]) -> None:
        self.works = works
        self.armed = threading.Event()  # the test arms it once the worker is the caller

    def __call__(self, *args: float) -> float:
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("a bug nobody expected")
        return self.works(*args)


class FlakyJitter(random.Random):
    def __init__(self) -> None:
        super().__init__(1)
        self.fail = FailsOnce(super().uniform)

    def uniform(self, a: float, b: float) -> float:
        return self.fail(a, b)


def worker_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_a_worker_killed_by_an_unexpected_error_is_restarted_and_says_so(caplog) -> None:
    clock = FailsOnce(time.monotonic)
    loader = GatedLoader()
    events: list[ReconcileEvent] = []
    rec = Reconciler(loader, policy=FAST, on_event=events.append, clock=clock, name="rec-x")
    rec.load_blocking(target(1))
    clock.armed.set()  # the worker's first look at the clock (for the next job) raises
    with caplog.at_level(logging.ERROR, logger="app.reconciler"):
        rec.submit(target(2, "b"))
        assert rec.wait_settled(WAIT_S)

    snap = rec.snapshot()
    assert snap.actual == target(2, "b") and snap.phase is ReplicaPhase.READY
    assert snap.worker_restarts == 1
    assert snap.worker_crash is not None and snap.worker_crash.category == "internal"
    assert "RuntimeError: a bug nobody expected" in snap.worker_crash.message
    assert [e.kind for e in events if e.kind == "worker_restarted"] == ["worker_restarted"]
    [line] = [r for r in caplog.records if "restarted" in r.getMessage()]
    assert "rec-x" in line.getMessage() and "a bug nobody expected" in line.getMessage()
    assert len(worker_threads("rec-x")) == 1  # the worker is alive, and only one
    rec.submit(target(3, "c"))  # and it still works
    assert rec.wait_settled(WAIT_S) and rec.snapshot().actual == target(3, "c")
    rec.close()


def test_a_worker_killed_while_scheduling_a_retry_still_retries_the_target() -> None:
    jitter = FlakyJitter()
    loader = GatedLoader(failures={"b": [OSError("connection reset")]})
    rec = Reconciler(loader, policy=FAST, rng=jitter, name="rec-y")
    rec.load_blocking(target(1))
    jitter.fail.armed.set()  # the backoff of the failed attempt is where it dies
    rec.submit(target(2, "b"))
    assert rec.wait_settled(WAIT_S)
    snap = rec.snapshot()
    assert snap.actual == target(2, "b") and snap.worker_restarts == 1
    assert [t.artifact_id for t in loader.started] == ["a", "b", "b"]
    rec.close()


# --------------------------------------------------------------------------- secrets and size

SECRET_URI = "https://user:hunter2@host/m.json?X-Amz-Signature=sekrit"


def test_a_failed_load_reports_and_logs_no_secret_of_the_manifest_uri(caplog) -> None:
    leaky = target(2, "b").model_copy(update={"manifest_uri": SECRET_URI})
    # What a transport error says: the URL it failed on, as given and as decoded.
    error = FetchFailed(f"GET {SECRET_URI} failed: 403 (user hunter2, signature sekrit)")
    loader = GatedLoader(failures={"b": [error]})
    rec = Reconciler(
        loader, policy=BackoffPolicy(initial_s=0.01, cap_s=0.01, max_attempts=1), name="rec-s"
    )
    rec.load_blocking(target(1))
    with caplog.at_level(logging.DEBUG, logger="app.reconciler"):
        rec.submit(leaky)
        assert rec.wait_settled(WAIT_S)

    failure = rec.snapshot().last_error
    assert failure is not None and failure.category == "fetch"
    assert "host/m.json" in failure.message  # still says what failed
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "failed" in logged
    for secret in ("hunter2", "sekrit"):
        assert secret not in failure.message and secret not in logged
    rec.close()


def test_a_startup_target_refused_as_late_does_not_show_its_uri_secrets() -> None:
    rec = make(GatedLoader(), [])
    rec.load_blocking(target(5))
    late = target(4).model_copy(update={"manifest_uri": SECRET_URI})
    with pytest.raises(ValueError, match="late") as caught:
        rec.load_blocking(late)
    assert "hunter2" not in str(caught.value) and "sekrit" not in str(caught.value)
    rec.close()


def test_a_five_megabyte_message_is_clipped(caplog) -> None:
    leaky = target(2, "b").model_copy(update={"manifest_uri": SECRET_URI})
    huge = FetchFailed(f"GET {SECRET_URI}: " + "x" * 5_000_000)
    loader = GatedLoader(failures={"b": [huge]})
    rec = Reconciler(
        loader, policy=BackoffPolicy(initial_s=0.01, cap_s=0.01, max_attempts=1), name="rec-h"
    )
    rec.load_blocking(target(1))
    with caplog.at_level(logging.WARNING, logger="app.reconciler"):
        rec.submit(leaky)
        assert rec.wait_settled(WAIT_S)
    failure = rec.snapshot().last_error
    assert failure is not None and len(failure.message) <= MAX_TEXT
    assert all(len(r.getMessage()) < 3 * MAX_TEXT for r in caplog.records)
    rec.close()
