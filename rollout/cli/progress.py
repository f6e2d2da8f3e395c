"""Progress bars for the CLI's long commands (`rollout pack`, `rollout verify`) on multi-GB
artifacts: drawn on stderr, only when stderr is a terminal and the command is not in
``--json`` mode, and gone when the command ends (stdout keeps exactly its JSON line).

A ``LoadControl`` (app.load_control) counts the bytes of a fetch, re-hash or load; a thread
of this module reads it a few times a second and moves the bar of its stage. ``pack`` counts
its copy through ``advance``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

from app.load_control import LoadControl

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

REFRESH_S: Final = 0.2
STAGE_NAMES: Final = {"fetch": "fetch + verify", "verify": "re-hash", "load": "load"}


def wanted(as_json: bool) -> bool:
    """A bar is drawn on a terminal only, never in ``--json`` mode."""
    return not as_json and sys.stderr.isatty()


class Bars:
    """The bars of one command; every method is a no-op when disabled."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._tasks: dict[str, TaskID] = {}

    def start(self, name: str, total: int) -> None:
        if self._progress is not None:
            self._tasks[name] = self._progress.add_task(name, total=max(total, 1))

    def update(self, name: str, done: int, total: int | None = None) -> None:
        if self._progress is None:
            return
        if name not in self._tasks:
            self.start(name, total or 0)
        self._progress.update(self._tasks[name], completed=done, total=total)

    def advance(self, name: str, nbytes: int) -> None:
        if self._progress is not None and name in self._tasks:
            self._progress.advance(self._tasks[name], nbytes)


@contextmanager
def progress_bars(enabled: bool) -> Iterator[Bars]:
    if not enabled:
        yield Bars(None)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description:>14}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        yield Bars(progress)


@contextmanager
def watching(control: LoadControl, bars: Bars) -> Iterator[LoadControl]:
    """Move ``bars`` from ``control``'s progress until the block ends."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(REFRESH_S):
            show()

    shown_ended = 0

    def show() -> None:
        # A stage that began and ended between two looks still gets its bar, at its end.
        nonlocal shown_ended
        ended = control.ended()
        for stage in ended[shown_ended:]:
            bars.update(STAGE_NAMES[stage.stage], stage.done_bytes, stage.total_bytes)
        shown_ended = len(ended)
        now = control.progress()
        if now is not None:
            bars.update(STAGE_NAMES[now.stage], now.done_bytes, now.total_bytes)

    thread = threading.Thread(target=poll, name="progress-bar", daemon=True)
    thread.start()
    try:
        yield control
    finally:
        stop.set()
        thread.join()
    show()  # the last figures, from this thread alone
