"""What a running load is told, and what it tells: pace yourself, stop, how far you are.

The loading code (the cache's fetch and re-hash, the streamed weights, the dry run) calls
``checkpoint(control)`` between units of work: a chunk read and hashed, a forward. There a
load

- stops (``LoadCancelled``) once its target was superseded or cleared: a multi-GB load
  stops within one chunk instead of running for minutes to be discarded, and what it had
  allocated is freed when the exception unwinds it;
- pauses when it is paced (``app.load_pacing``).

Progress is counted in bytes per stage (``fetch``: read from the store, hashed and written to
the cache; ``verify``: a hit re-hashed; ``load``: weights read, hashed and placed in their
tensors). Worker threads add to it, the replica's reporter reads it. Pure: no Ray, no torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from app.errors import LoadCancelled
from app.load_pacing import LoadPacer

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
            self._stage, self._done, self._total = stage, 0, max(0, int(total_bytes))
            self._stage_started = self.clock()

    def advance(self, stage: LoadStage, nbytes: int) -> None:
        """``nbytes`` more of ``stage`` are done (ignored once another stage began)."""
        with self._lock:
            if self._stage == stage:
                self._done = min(self._total, self._done + nbytes)

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
