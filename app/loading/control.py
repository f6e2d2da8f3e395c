"""How a background load runs: counted, cancellable, paced, at a lowered priority.

The loading code (the cache's fetch and re-hash, the streamed weights, the dry run) calls
``checkpoint(control)`` between units of work: a chunk read and hashed, a forward. There a
load

- stops (``LoadCancelled``) once its target was superseded or cleared: a multi-GB load
  stops within one chunk instead of running for minutes to be discarded, and what it had
  allocated is freed when the exception unwinds it;
- pauses when it is paced (``LoadPacer``).

Progress is counted in bytes per stage (``fetch``: read from the store, hashed and written to
the cache; ``verify``: a hit re-hashed; ``load``: weights read, hashed and placed in their
tensors). Worker threads add to it, the replica's reporter reads it.

**Pacing.** A low scheduling priority is not enough on a host whose cores the serving
processes share: a lowered thread still takes every moment a core is free, and the requests
served beside a load that hashes flat out, even at SCHED_IDLE, get slower; the same work paced
to a share of a core, in short bursts, leaves them as they were (``bench/bench_router.py``
measures this on the real load). The load takes longer; what it protects is every request
served meanwhile. Each thread is accounted for by its own CPU time (``time.thread_time``), so
time a thread spent starved or waiting on I/O or a device costs it no pause, and threads of
one load (parallel file downloads) are paced each by itself.

**Priority.** A background load runs on a thread of its own that lowered its priority once
(``LoweredThread``, ``lower_thread_priority``) and is kept for the next load of the same
priority (the reconciler, app.reconciler, decides which priority fits what the replica does).

Pure: no Ray, no torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Literal

from app.errors import LoadCancelled

log = logging.getLogger(__name__)

# A pause after every tiny unit would cost more in wake-ups than it saves: a thread runs at
# least this much CPU time between pauses (short enough that a request waits little behind it).
DEFAULT_BURST_S = 0.005


@dataclass
class LoadPacer:
    """Keeps each calling thread's CPU time at most ``cpu_share`` of its wall time, in bursts
    of ``burst_s`` CPU seconds. ``cpu_share`` 1 means no pacing."""

    cpu_share: float
    burst_s: float = DEFAULT_BURST_S
    cpu_clock: Callable[[], float] = time.thread_time
    sleep: Callable[[float], None] = time.sleep
    _threads: threading.local = field(default_factory=threading.local, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _paused_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {self.cpu_share}")
        if self.burst_s < 0:
            raise ValueError(f"burst_s must be >= 0, got {self.burst_s}")

    def checkpoint(self) -> None:
        """Pause the calling thread if its CPU time since its last pause makes a full burst."""
        if self.cpu_share >= 1:
            return
        now = self.cpu_clock()
        since = getattr(self._threads, "since", None)
        if since is None:  # a thread's first checkpoint starts its account
            self._threads.since = now
            return
        used = now - since
        if used < self.burst_s:
            return
        pause = used * (1 - self.cpu_share) / self.cpu_share
        self.sleep(pause)
        with self._lock:
            self._paused_s += pause
        self._threads.since = self.cpu_clock()

    @property
    def paused_s(self) -> float:
        """Seconds all threads spent paused so far (what pacing added to the load's time)."""
        with self._lock:
            return self._paused_s


LoadStage = Literal["fetch", "verify", "load"]


@dataclass(frozen=True)
class StageProgress:
    stage: LoadStage
    done_bytes: int
    total_bytes: int
    elapsed_s: float


@dataclass
class LoadControl:
    """One load's pacing, cancellation and progress; shared by the threads of that load."""

    pacer: LoadPacer | None = None
    clock: Callable[[], float] = time.monotonic
    _cancelled: threading.Event = field(default_factory=threading.Event, init=False)
    _why: str = field(default="", init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _stage: LoadStage | None = field(default=None, init=False)
    _done: int = field(default=0, init=False)
    _total: int = field(default=0, init=False)
    _stage_started: float = field(default=0.0, init=False)
    # Stages that ended, with their last figures: a watcher that looks every so often may
    # have missed a short one altogether.
    _ended: list[StageProgress] = field(default_factory=list, init=False)

    # ------------------------------------------------------------------ cancellation

    def cancel(self, why: str) -> None:
        """Ask the load to stop at its next checkpoint (any thread)."""
        self._why = why
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def checkpoint(self) -> None:
        if self._cancelled.is_set():
            raise LoadCancelled(f"load cancelled: {self._why}")
        if self.pacer is not None:
            self.pacer.checkpoint()

    @property
    def paused_s(self) -> float:
        return self.pacer.paused_s if self.pacer is not None else 0.0

    # ------------------------------------------------------------------ progress

    def begin(self, stage: LoadStage, total_bytes: int) -> None:
        """A stage starts with ``total_bytes`` to go (the stage before it is over)."""
        with self._lock:
            now = self.clock()
            if self._stage is not None:
                self._ended.append(
                    StageProgress(self._stage, self._done, self._total, now - self._stage_started)
                )
            self._stage, self._done, self._total = stage, 0, max(0, int(total_bytes))
            self._stage_started = now

    def advance(self, stage: LoadStage, nbytes: int) -> None:
        """``nbytes`` more of ``stage`` are done (ignored once another stage began)."""
        with self._lock:
            if self._stage == stage:
                self._done = min(self._total, self._done + nbytes)

    def ended(self) -> list[StageProgress]:
        """The stages that ended so far (each when the next began), in order."""
        with self._lock:
            return list(self._ended)

    def progress(self) -> StageProgress | None:
        with self._lock:
            if self._stage is None:
                return None
            return StageProgress(
                self._stage, self._done, self._total, self.clock() - self._stage_started
            )


def checkpoint(control: LoadControl | None) -> None:
    """``control.checkpoint()``, or nothing for a load nobody controls (``None``)."""
    if control is not None:
        control.checkpoint()


def advance(control: LoadControl | None, stage: LoadStage, nbytes: int) -> None:
    if control is not None:
        control.advance(stage, nbytes)


def begin(control: LoadControl | None, stage: LoadStage, total_bytes: int) -> None:
    if control is not None:
        control.begin(stage, total_bytes)


class LoweredThread:
    """A thread that lowers its own priority once (``lower_thread_priority``) and then runs
    the loads handed to it, one at a time, each from the thread that hands it over: kept for
    the next load of the same priority, so what a thread keeps after its first forward (the
    math library's per-thread buffers, several MiB on a wide model) is paid once per
    replica, not again in every swap."""

    def __init__(self, name: str, increment: int, idle: bool) -> None:
        self._jobs: SimpleQueue[Callable[[], None] | None] = SimpleQueue()
        self._lowered = threading.Event()
        self.said = ""
        self._thread = threading.Thread(
            target=self._serve, args=(increment, idle), name=name, daemon=True
        )
        self._thread.start()
        self._lowered.wait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self, increment: int, idle: bool) -> None:
        try:
            self.said = lower_thread_priority(increment, idle=idle)
        finally:
            self._lowered.set()
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job`` there and wait for it; what it raises is raised here."""
        done = threading.Event()
        raised: list[BaseException] = []

        def wrapped() -> None:
            try:
                job()
            except Exception as exc:  # re-raised in the caller, which handles failures
                raised.append(exc)
            except BaseException:  # as a thread of its own would: logged, the worker goes on
                log.exception("%s: a load ended with a BaseException", self._thread.name)
            finally:
                done.set()

        self._jobs.put(wrapped)
        done.wait()
        if raised:
            raise raised[0]

    def stop(self) -> None:
        self._jobs.put(None)


def lower_thread_priority(increment: int, *, idle: bool = True) -> str:
    """Make the calling thread yield the CPU to everything else; says what it did.

    ``idle``: Linux's SCHED_IDLE where allowed (it always is for lowering): any normal thread
    that wakes preempts it at once, where even niceness 19 still gets a share of a busy core
    that request threads wait behind.

    Otherwise niceness, relative to the thread's own: Ray starts workers at 15, and an absolute
    value below that would *raise* the thread's priority wherever that is allowed (as root).
    Linux keeps both per thread (a thread id is a process id there).
    """
    tid = threading.get_native_id()
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError:
            pass
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        wanted = min(19, current + increment)
        os.setpriority(os.PRIO_PROCESS, tid, wanted)
        return f"niceness {current} -> {wanted}"
    except (OSError, AttributeError) as exc:
        return f"unchanged ({exc})"
