"""The one poll-until loop of the project: wait for a condition that another process makes true.

Used wherever code waits on something it cannot be told about (a Serve deployment becoming
healthy, a replica reporting a revision, a server accepting connections). Conditions that are
announced (threads, events, futures) are waited on directly instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from app.errors import WaitTimeout

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    desc: str,
    *,
    every: float = 0.25,
    retry_on: tuple[type[BaseException], ...] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Exceptions of the ``retry_on`` types count as "not yet" (a predicate that asserts, a server
    that refuses connections while it starts); the last one is named in the timeout error.
    Any other exception propagates at once. ``WaitTimeout`` names ``desc`` after ``timeout``
    seconds; the predicate is always called at least once.
    """
    deadline = clock() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
        if clock() >= deadline:
            tail = f"; last: {last!r}" if last is not None else ""
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {desc}{tail}")
        sleep(every)
