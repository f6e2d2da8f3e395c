"""Desired/actual reconciliation of a replica's model target.

The replica tells the reconciler what it should serve (``submit``); one background worker
makes it so. Rules:

- single flight: one load at a time, on one worker thread;
- latest target wins: a newer target replaces pending work and cancels a load in progress,
  which stops at its next checkpoint (one chunk of bytes, one dry-run forward: the loader
  gets a ``LoadControl``); a load that finishes after its target was superseded is
  discarded, never installed;
- a late target (revision lower than the desired one) is ignored; the same revision with a
  different artifact is refused (a registry inconsistency worth an alert);
- desired is re-checked under the lock right before install, and ``submit`` takes the same
  lock, so a slow candidate can never override a newer target (e.g. a rollback);
- failures are retried with capped exponential backoff and jitter when they can be transient
  (I/O, a download that came out short), and given up on at once when they cannot (a wrong
  schema stays wrong); either way the serving generation is untouched;
- ``clear`` (the target was removed: an idle pool) drops pending work, cancels a load in
  progress, and retires the serving generation (``TargetLoader.retire``).
  The cleared target's revision stays the floor: a lower revision afterwards is still late;
- the worker never dies silently: an error nothing expected (a bug, a dependency failing in a
  way no load failure does) restarts it after a short, growing pause; the restart is logged,
  counted and kept as ``worker_crash`` (category ``internal``), and the pending target is
  taken up again;
- what a failure says never carries a secret of the target's ``manifest_uri`` (its userinfo
  password, presigned query values): reports and log lines show it redacted
  (``app.safe_text``), and its text is cut to the report's bounds.

No Ray here: the load/install/discard steps are injected (``TargetLoader``), so unit tests run
the real worker with a fake loader.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Generic, Protocol, TypeVar

from app.contracts import ErrorInfo, ReplicaPhase, RetryConfig, Target
from app.errors import LoadCancelled
from app.loading.control import LoadControl, LoweredThread, StageProgress
from app.loading.failures import (
    clipped_error,
    describe_target,
    error_info,
    is_retryable,
    safe_message,
)
from app.supervised import log_crash, restart_pause, supervise

log = logging.getLogger(__name__)

M = TypeVar("M")

# Cancelled revisions kept for the report (it shows the latest few).
MAX_KEPT_REVISIONS: Final = 64


class Decision(StrEnum):
    ACCEPTED = "accepted"  # new desired target; the worker will load it
    UNCHANGED = "unchanged"  # equal to the desired target
    LATE = "late"  # lower revision than desired: ignored
    CONFLICT = "conflict"  # same revision, different artifact: refused


@dataclass(frozen=True)
class BackoffPolicy:
    """Capped exponential backoff with "equal jitter": half of each delay is fixed (so
    retries never bunch up at zero), the other half random (so replicas that failed together
    do not retry together)."""

    initial_s: float = 0.5
    multiplier: float = 2.0
    cap_s: float = 30.0
    max_attempts: int = 6  # including the first

    @classmethod
    def of(cls, config: RetryConfig) -> BackoffPolicy:
        return cls(initial_s=config.initial_s, cap_s=config.cap_s, max_attempts=config.max_attempts)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Delay after the ``attempt``-th failure (1-based)."""
        # The exponent is capped so that no attempt count can overflow the float.
        growth = self.multiplier ** min(max(0, attempt - 1), 64)
        ceiling = min(self.cap_s, self.initial_s * growth)
        return ceiling / 2 + rng.uniform(0, ceiling / 2)


class TargetLoader(Protocol, Generic[M]):
    """The steps the reconciler drives. ``load`` may take minutes and may raise; it calls
    ``control.checkpoint()`` between units of work (raising ``LoadCancelled`` once the target
    is no longer wanted) and counts its progress there; ``install``
    is quick and returns False if the installed generation refused it (stale); ``discard``
    frees a loaded model that will never serve; ``retire`` stops serving the installed
    generation (quick: requests in flight finish on it, cleanup follows when they have)."""

    def load(self, target: Target, control: LoadControl) -> M: ...

    def install(self, target: Target, loaded: M) -> bool: ...

    def discard(self, loaded: M) -> None: ...

    def retire(self) -> None: ...


@dataclass(frozen=True)
class ReconcileEvent:
    """Something the replica reports or counts. ``kind``: accepted, unchanged, late,
    conflict, loading, installed, discarded, cancelled (a load stopped because its target
    was superseded or cleared), retry_scheduled, failed, cleared, worker_restarted
    (``error``: what killed it)."""

    kind: str
    target: Target | None
    error: ErrorInfo | None = None
    attempt: int = 0
    retry_in_s: float | None = None
    duration_s: float | None = None


@dataclass(frozen=True)
class ReconcilerSnapshot:
    desired: Target | None
    actual: Target | None
    phase: ReplicaPhase
    last_error: ErrorInfo | None
    discarded: tuple[int, ...] = field(default=())  # revisions loaded but never installed
    worker_restarts: int = 0  # the worker died of an unexpected error and was restarted
    worker_crash: ErrorInfo | None = None  # the last such error
    cancelled: tuple[int, ...] = field(default=())  # revisions whose load was stopped
    progress: StageProgress | None = None  # of the load in progress, if any
    loading: Target | None = None  # the target of that load


class Reconciler(Generic[M]):
    def __init__(
        self,
        loader: TargetLoader[M],
        *,
        policy: BackoffPolicy | None = None,
        on_event: Callable[[ReconcileEvent], None] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "reconciler",
        worker_nice: int = 0,
    ) -> None:
        self._loader = loader
        self._policy = policy or BackoffPolicy()
        self._on_event = on_event or (lambda event: None)
        self._rng = rng or random.Random()
        self._clock = clock
        self._name = name
        self._cond = threading.Condition()
        self._desired: Target | None = None
        self._actual: Target | None = None
        self._cleared: Target | None = None  # the desired target when it was last cleared
        self._phase = ReplicaPhase.IDLE
        self._last_error: ErrorInfo | None = None
        self._attempts = 0
        self._discarded: list[int] = []
        self._cancelled: list[int] = []
        self._work = False  # the desired target still needs loading
        self._retry_at = 0.0
        self._busy = False  # the worker is inside a load
        self._control: LoadControl | None = None  # the load in progress: cancel, progress
        self._loading: Target | None = None  # its target
        self._closed = False
        self._worker: threading.Thread | None = None
        # The threads loads run on, by whether nothing is served here (SCHED_IDLE) or not.
        self._load_threads: dict[bool, LoweredThread] = {}
        self._worker_restarts = 0
        self._worker_crash: ErrorInfo | None = None
        # Loads run beside live traffic on the same cores: with a positive ``worker_nice``
        # each load runs on a thread of its own at a lower priority (inherited by the threads
        # it starts, e.g. parallel downloads), so request threads win the CPU (see _run_load).
        self._worker_nice = worker_nice

    def set_policy(self, policy: BackoffPolicy) -> None:
        with self._cond:
            self._policy = policy

    # ------------------------------------------------------------------ decisions

    def _classify(self, target: Target) -> Decision:
        desired = self._desired
        if desired is None:
            floor = self._cleared
            if floor is not None:
                if target.revision < floor.revision:
                    return Decision.LATE
                if target.revision == floor.revision and not target.same_artifact(floor):
                    return Decision.CONFLICT
            # The cleared target itself again is accepted: it is what the control plane
            # asks for now, and nothing serves it any more.
            return Decision.ACCEPTED
        if target.revision < desired.revision:
            return Decision.LATE
        if target.revision == desired.revision:
            if target.same_artifact(desired):
                return Decision.UNCHANGED
            return Decision.CONFLICT
        return Decision.ACCEPTED

    def submit(self, target: Target) -> Decision:
        """Record a new desired target and return at once; the worker loads it."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            decision = self._classify(target)
            if decision is Decision.ACCEPTED:
                self._cancel_load(f"superseded by revision {target.revision}")
                self._desired = target
                self._attempts = 0
                self._retry_at = 0.0
                if self._actual is not None and self._actual == target:
                    self._work = False
                    self._phase = ReplicaPhase.READY
                else:
                    self._work = True
                    self._phase = ReplicaPhase.LOADING
                    self._ensure_worker()
                self._cond.notify_all()
        self._emit(ReconcileEvent(decision.value, target))
        return decision

    def clear(self) -> bool:
        """No target any more: stop loading and retire the serving generation.

        Returns False when there was nothing to clear. A load in progress finishes and is
        discarded (its target is no longer desired); requests in flight finish on the
        generation they borrowed.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            previous = self._desired
            if previous is None and self._actual is None:
                return False
            if previous is not None:
                self._cleared = previous
            self._cancel_load("the target was cleared")
            self._desired = None
            self._work = False
            self._attempts = 0
            self._retry_at = 0.0
            self._phase = ReplicaPhase.IDLE
            if self._actual is not None:
                # Under the lock, like install: a finishing load cannot slip in between.
                self._loader.retire()
                self._actual = None
            self._cond.notify_all()
        self._emit(ReconcileEvent("cleared", previous))
        return True

    def _cancel_load(self, why: str) -> None:
        """Under the lock: the load in progress (if any) stops at its next checkpoint."""
        if self._control is not None:
            self._control.cancel(why)

    def load_blocking(self, target: Target) -> None:
        """Startup: make ``target`` the desired and actual target in the calling thread.

        Transient failures are retried with backoff; a final failure raises (a replica must
        not start serving without a verified model).
        """
        with self._cond:
            decision = self._classify(target)
            if decision is Decision.UNCHANGED and self._actual == target:
                return
            if decision in (Decision.LATE, Decision.CONFLICT):
                raise ValueError(f"startup target {describe_target(target)} is {decision.value}")
            self._desired = target
            self._work = False
            self._phase = ReplicaPhase.LOADING
            self._busy = True
        try:
            attempt = 0
            while True:
                attempt += 1
                try:
                    self._attempt(target, attempt)
                    return
                except Exception as exc:
                    if not is_retryable(exc) or attempt >= self._policy.max_attempts:
                        raise
                    time.sleep(self._policy.delay(attempt, self._rng))
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    # ------------------------------------------------------------------ worker

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._supervise, name=self._name, daemon=True)
            self._worker.start()

    def _supervise(self) -> None:
        """The worker thread: ``_run`` until closed, started again whenever it dies of an
        error nothing expected (load failures never get here: ``_run`` handles them)."""
        supervise(self._run, on_crash=self._crashed, wait=self._pause)

    def _crashed(self, exc: Exception) -> float:
        """Record, log and announce a crash of the worker; the pause before its restart."""
        with self._cond:
            self._busy = False  # whatever it was inside, it is not any more
            self._worker_restarts += 1
            restarts = self._worker_restarts
            desired = self._desired
            self._cond.notify_all()
        pause = restart_pause(restarts)
        crash = clipped_error(
            "internal",
            f"the {self._name} worker died and was restarted ({restarts} so far): "
            f"{type(exc).__name__}: {safe_message(str(exc), desired)}",
            artifact_id=desired.artifact_id if desired else None,
            revision=desired.revision if desired else None,
        )
        with self._cond:
            self._worker_crash = crash
        log_crash(
            log,
            f"{self._name}: the worker",
            exc,
            pause,
            restarts,
            lambda text: safe_message(text, desired),
        )
        self._emit(ReconcileEvent("worker_restarted", desired, error=crash))
        return pause

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` (on the real clock: the injected one may be what failed), or
        until closed."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(timeout=left)

    def _next_job(self) -> tuple[Target, int] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._work and self._desired is not None:
                    wait = self._retry_at - self._clock()
                    if wait <= 0:
                        self._busy = True
                        self._attempts += 1
                        self._phase = ReplicaPhase.LOADING
                        return self._desired, self._attempts
                    self._cond.wait(timeout=wait)
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            target, attempt = job
            try:
                self._run_load(target, attempt)
            except Exception as exc:
                self._failed(target, attempt, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run_load(self, target: Target, attempt: int) -> None:
        """One background attempt, on a thread at a priority that fits what this replica does
        meanwhile: one kept thread per priority (a thread may lower its priority but not
        always raise it again, so each priority has a thread of its own, lowered from the
        worker's once; ``LoweredThread``).

        Nothing served here (an idle pool, a replica whose target was cleared): SCHED_IDLE,
        everything else on the host goes first. A model served here: niceness, because the
        load and the request threads share this process's GIL, and a SCHED_IDLE loader
        preempted while it holds the GIL stalls the requests waiting for it until a core is
        idle (a SCHED_IDLE thread holding a lock is the textbook priority inversion), whereas
        a niced loader still gets its small share of a busy core and so lets go of the GIL
        soon. Pacing (``app.loading.control``) keeps the loader's GIL bursts short, which makes
        the stall rare; the hazard stays, so a serving replica does not take it.
        """
        if self._worker_nice <= 0:
            self._attempt(target, attempt)
            return
        with self._cond:
            idle = self._actual is None
            runner = self._load_threads.get(idle)
            closed = self._closed
        if closed:
            self._attempt(target, attempt)  # stops at once: no thread left behind by close
            return
        if runner is None or not runner.alive:
            # Started outside the lock: the new thread lowers its priority before it says so.
            name = f"{self._name}-load" + ("-idle" if idle else "")
            runner = LoweredThread(name, self._worker_nice, idle)
            with self._cond:
                self._load_threads[idle] = runner
                if self._closed:  # close() took its list before this one was added
                    runner.stop()
        log.debug("%s: load of revision %d at %s", self._name, target.revision, runner.said)
        runner.run(lambda: self._attempt(target, attempt))

    def _attempt(self, target: Target, attempt: int) -> None:
        """Load, re-check desired, install; raises what the load raised."""
        self._emit(ReconcileEvent("loading", target, attempt=attempt))
        started = self._clock()
        control = LoadControl()
        with self._cond:
            if self._desired != target or self._closed:
                control.cancel("superseded before it started")
            self._control, self._loading = control, target
        try:
            loaded = self._loader.load(target, control)
        finally:
            with self._cond:
                self._control, self._loading = None, None
        with self._cond:
            current = self._desired == target and not self._closed
            installed = current and self._loader.install(target, loaded)
            if installed:
                self._actual = target
                self._last_error = None
                if self._desired == target:
                    self._work = False
                    self._phase = ReplicaPhase.READY
            else:
                self._discarded.append(target.revision)
                if current:
                    # The generation holder refused it (it knows a newer generation): final.
                    self._work = False
                    self._phase = ReplicaPhase.FAILED
                    self._last_error = ErrorInfo(
                        category="stale",
                        message="the serving generation refused the install",
                        artifact_id=target.artifact_id,
                        revision=target.revision,
                    )
        if installed:
            self._emit(
                ReconcileEvent(
                    "installed", target, attempt=attempt, duration_s=self._clock() - started
                )
            )
            return
        # Superseded while loading (or refused by the holder): never serve it.
        self._loader.discard(loaded)
        self._emit(ReconcileEvent("discarded", target, attempt=attempt))

    def _failed(self, target: Target, attempt: int, exc: Exception) -> None:
        if isinstance(exc, LoadCancelled):
            # Not a failure: the target is no longer wanted, whatever is (if anything)
            # is the worker's next job.
            log.info("%s: load of %s stopped: %s", self._name, describe_target(target), exc)
            with self._cond:
                self._cancelled.append(target.revision)
                del self._cancelled[:-MAX_KEPT_REVISIONS]
            self._emit(ReconcileEvent("cancelled", target, attempt=attempt))
            return
        error = error_info(exc, target)
        with self._cond:
            if self._desired != target:
                # A newer target arrived during the failed load; its own attempt follows.
                self._last_error = error
                event = ReconcileEvent("failed", target, error=error, attempt=attempt)
            elif is_retryable(exc) and attempt < self._policy.max_attempts:
                delay = self._policy.delay(attempt, self._rng)
                self._retry_at = self._clock() + delay
                self._phase = ReplicaPhase.BACKOFF
                self._last_error = error
                event = ReconcileEvent(
                    "retry_scheduled", target, error=error, attempt=attempt, retry_in_s=delay
                )
            else:
                self._work = False
                self._phase = ReplicaPhase.FAILED
                self._last_error = error
                event = ReconcileEvent("failed", target, error=error, attempt=attempt)
        log.warning(
            "%s: target %s failed (attempt %d): %s",
            self._name,
            describe_target(target),
            attempt,
            # A system error's message already starts with its category.
            error.message if error.message.startswith(f"{error.category}:") else error.describe(),
        )
        self._emit(event)

    def _emit(self, event: ReconcileEvent) -> None:
        try:
            self._on_event(event)
        except Exception:  # an observer must never break reconciliation
            log.exception("%s: event observer failed on %s", self._name, event.kind)

    # ------------------------------------------------------------------ observation

    def snapshot(self) -> ReconcilerSnapshot:
        with self._cond:
            return ReconcilerSnapshot(
                desired=self._desired,
                actual=self._actual,
                phase=self._phase,
                last_error=self._last_error,
                discarded=tuple(self._discarded),
                cancelled=tuple(self._cancelled),
                worker_restarts=self._worker_restarts,
                worker_crash=self._worker_crash,
                progress=self._control.progress() if self._control is not None else None,
                loading=self._loading,
            )

    def wait_settled(self, timeout: float) -> bool:
        """Wait until no load is running or pending (READY, FAILED or IDLE)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy or self._work:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.5))
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker; a load in progress stops at its next checkpoint."""
        with self._cond:
            self._closed = True
            self._cancel_load("the replica is shutting down")
            self._cond.notify_all()
            worker = self._worker
            runners = list(self._load_threads.values())
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        for runner in runners:
            runner.stop()
