"""Pacing of background loads: a cap on the CPU share a candidate load may take while the
replicas beside it serve.

A low scheduling priority (``lower_thread_priority``) is not enough on a host whose cores the
serving processes share: a lowered thread still takes every moment a core is free, and the
requests served beside a load that hashes flat out, even at SCHED_IDLE, get slower; the same
work paced to a share of a core, in short bursts, leaves them as they were
(``bench/bench_router.py`` measures this on the real load). The load takes longer; what it
protects is every request served meanwhile.

The loading code calls ``checkpoint()`` between units of work (a chunk read and hashed, a
dry-run forward). Each thread is accounted for by its own CPU time (``time.thread_time``), so
time a thread spent starved or waiting on I/O or a device costs it no pause, and threads of
one load (parallel file downloads) are paced each by itself. Pure: no Ray, no torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


def checkpoint(pacer: LoadPacer | None) -> None:
    """``pacer.checkpoint()``, or nothing for an unpaced load (``None``)."""
    if pacer is not None:
        pacer.checkpoint()
