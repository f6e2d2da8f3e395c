"""In-process model switching by generations.

A *generation* is everything a request needs from one installed model (revision, artifact,
the loaded model with its feature normalization and labels), lent out as one unit. The rules:

- Borrowing reads the current generation and increments its reference count under one short
  lock; the lock never covers loading, inference or cleanup.
- Installing a newer generation retires the old one. Requests that borrowed the old one finish
  on it; requests that start afterwards get the new one. Clearing the target
  (``retire_current``) retires the current generation the same way with no successor.
- A candidate is installed only if it is exactly the desired target and newer than what is
  serving, so a slow candidate never overrides a newer target (a rollback is a *higher*
  revision naming an older artifact).
- A retired generation whose references reach zero, and a rejected candidate, are queued for
  cleanup exactly once; a worker thread runs the cleanup outside the lock. A failing cleanup is
  recorded and never reaches a request.
- On CUDA, returning from Python does not mean the GPU is done: before cleanup the worker waits
  on the release events recorded when borrowers finished (any object with ``query()`` or
  ``synchronize()``, e.g. ``torch.cuda.Event``).

Pure module: no Ray, no database, no torch import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any, Final

from app.errors import ConsistencyError, NotReady

log = logging.getLogger(__name__)

# Per generation, release events kept before completed ones are pruned.
MAX_PENDING_EVENTS: Final = 8


@dataclass(eq=False)
class Generation:
    revision: int
    artifact_id: str
    model: Any
    refs: int = field(default=0, init=False)
    retired: bool = field(default=False, init=False)
    cleanup_queued: bool = field(default=False, init=False)
    cleaned: bool = field(default=False, init=False)
    cleanup_error: str | None = field(default=None, init=False)
    _events: list[Any] = field(default_factory=list, init=False, repr=False)


@dataclass(frozen=True)
class CleanupFailure:
    revision: int
    artifact_id: str
    error: str


def _model_release_event(generation: Generation) -> object | None:
    """Default hook: the model's own ``release_event()`` (LoadedModel has one), if any."""
    hook = getattr(generation.model, "release_event", None)
    return hook() if callable(hook) else None


def _event_done(event: Any) -> bool:
    query = getattr(event, "query", None)
    return bool(query()) if callable(query) else False


class GenerationHolder:
    def __init__(
        self,
        cleanup: Callable[[Generation], None],
        *,
        release_event: Callable[[Generation], object | None] | None = _model_release_event,
        event_timeout_s: float = 120.0,
    ) -> None:
        self._cleanup = cleanup
        self._release_event = release_event
        self._event_timeout_s = event_timeout_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._current: Generation | None = None
        self._desired: tuple[int, str] = (0, "")
        self._closed = False
        # Retired or rejected generations whose cleanup has not finished yet.
        self._outstanding = 0
        self._failures: deque[CleanupFailure] = deque(maxlen=64)
        self._queue: SimpleQueue[Generation | None] = SimpleQueue()
        self._worker = threading.Thread(
            target=self._run_worker, name="generation-cleanup", daemon=True
        )
        self._worker.start()

    # ------------------------------------------------------------------ state

    @property
    def desired(self) -> tuple[int, str]:
        with self._lock:
            return self._desired

    @property
    def current(self) -> Generation | None:
        with self._lock:
            return self._current

    @property
    def cleanup_failures(self) -> list[CleanupFailure]:
        with self._lock:
            return list(self._failures)

    def set_desired(self, revision: int, artifact_id: str) -> bool:
        """Record the control plane's target. False for a late (lower) revision; the same
        revision naming another artifact is a ConsistencyError."""
        if isinstance(revision, bool) or not isinstance(revision, int):
            raise TypeError(f"revision must be an int, got {revision!r}")
        with self._lock:
            known_revision, known_artifact = self._desired
            if revision < known_revision:
                return False
            if revision == known_revision and artifact_id != known_artifact:
                raise ConsistencyError(
                    f"revision {revision} names {artifact_id!r}, already seen as "
                    f"{known_artifact!r}",
                    revision=revision,
                    artifact_id=artifact_id,
                )
            self._desired = (revision, artifact_id)
            return True

    # ------------------------------------------------------------------ request path

    @contextmanager
    def borrow(self) -> Iterator[Generation]:
        with self._lock:
            generation = self._current
            if generation is None:
                raise NotReady("closed" if self._closed else "no model installed yet")
            generation.refs += 1
        try:
            yield generation
        finally:
            event = None
            if self._release_event is not None:
                try:
                    event = self._release_event(generation)
                except Exception:  # must not fail a request that has already been answered
                    log.exception("recording a release event for %s failed", generation.artifact_id)
            with self._lock:
                if event is not None:
                    events = generation._events
                    events.append(event)
                    if len(events) > MAX_PENDING_EVENTS:
                        # Completed events are dropped; beyond that the oldest go first (on
                        # one stream a later event completes after the earlier ones).
                        events[:] = [e for e in events if not _event_done(e)][-MAX_PENDING_EVENTS:]
                generation.refs -= 1
                if generation.refs < 0:
                    raise AssertionError("unbalanced generation release")
                if generation.retired and generation.refs == 0:
                    self._queue_cleanup_locked(generation)

    # ------------------------------------------------------------------ switching

    def install(self, candidate: Generation) -> bool:
        """Make ``candidate`` current if it is the desired target and newer than the current
        generation. Otherwise it is queued for cleanup and False is returned. The caller hands
        over the candidate either way."""
        run_inline = False
        with self._lock:
            if candidate is self._current or candidate.retired or candidate.cleanup_queued:
                raise ValueError(f"generation {candidate.artifact_id} was already installed")
            current = self._current
            accepted = (
                not self._closed
                and (candidate.revision, candidate.artifact_id) == self._desired
                and (current is None or candidate.revision > current.revision)
            )
            if accepted:
                self._current = candidate
                if current is not None:
                    self._retire_locked(current)
            elif self._closed:
                # The worker may be gone; the caller thread cleans up, still outside the lock.
                candidate.cleanup_queued = True
                self._outstanding += 1
                run_inline = True
            else:
                self._outstanding += 1
                self._queue_cleanup_locked(candidate)
        if run_inline:
            self._run_cleanup(candidate)
            self._finish_cleanup()
        return accepted

    def retire_current(self) -> Generation | None:
        """Stop serving without a successor (the target was cleared): the current generation
        is retired like on a switch - requests that borrowed it finish on it, new borrows get
        NotReady, and it is cleaned up once its references reach zero. Returns it (or None).

        The desired target is left as it was: a later install must still be that target or
        a newer one. Stopping loads of the cleared target is the caller's job (the
        reconciler's)."""
        with self._lock:
            current, self._current = self._current, None
            if current is not None:
                self._retire_locked(current)
        return current

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every retired or rejected generation has been cleaned up."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop serving: retire the current generation and wait (up to ``timeout``) for all
        cleanups. Returns False if borrowers still held a generation when the time ran out;
        the worker then stays until they release it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                current, self._current = self._current, None
                if current is not None:
                    self._retire_locked(current)
        drained = self.wait_idle(timeout)
        self._queue.put(None)  # wake the worker so it can see it is done
        if drained:
            self._worker.join(timeout)
        return drained

    # ------------------------------------------------------------------ internals

    def _retire_locked(self, generation: Generation) -> None:
        generation.retired = True
        self._outstanding += 1
        if generation.refs == 0:
            self._queue_cleanup_locked(generation)

    def _queue_cleanup_locked(self, generation: Generation) -> None:
        if not generation.cleanup_queued:
            generation.cleanup_queued = True
            self._queue.put(generation)

    def _run_worker(self) -> None:
        while True:
            generation = self._queue.get()
            if generation is not None:
                self._run_cleanup(generation)
                self._finish_cleanup()
            with self._lock:
                if self._closed and self._outstanding == 0:
                    return

    def _finish_cleanup(self) -> None:
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def _wait_events(self, generation: Generation) -> None:
        deadline = time.monotonic() + self._event_timeout_s
        for event in generation._events:
            if callable(getattr(event, "query", None)):
                pause = 0.0001
                while not event.query():
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"release event not complete after {self._event_timeout_s}s"
                        )
                    time.sleep(pause)  # polling the device, not waiting on a test condition
                    pause = min(pause * 2, 0.01)
            else:
                event.synchronize()
        generation._events.clear()

    def _run_cleanup(self, generation: Generation) -> None:
        try:
            # Unsafe to free memory the GPU may still be reading: a timed-out event leaves
            # the generation uncleaned (held memory) and recorded as a failure.
            self._wait_events(generation)
            self._cleanup(generation)
            generation.cleaned = True
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            generation.cleanup_error = error
            log.error(
                "cleanup of generation %s (revision %d) failed: %s",
                generation.artifact_id,
                generation.revision,
                error,
            )
            with self._lock:
                self._failures.append(
                    CleanupFailure(generation.revision, generation.artifact_id, error)
                )
