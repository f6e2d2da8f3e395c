"""Background work that must keep running: restarted after an error nothing expected, with a
pause that grows with each restart, every crash logged with its traceback and counted by its
owner. The replica's reconciler worker (app.reconciler) and reporter (app.reporting) run on
``supervise``; the router's probe loop (an asyncio task) uses the same pause, ``restart_pause``.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Final

from app.contracts import clip_text

# A loop that died starts again after this pause, doubled for every restart up to the cap:
# soon enough that a one-off fault costs little, slow enough that a fault that recurs on every
# run does not spin a core or flood the log.
RESTART_PAUSE_S: Final = 0.1
MAX_RESTART_PAUSE_S: Final = 60.0
# Characters of a crashed loop's traceback in its log line.
MAX_TRACEBACK_CHARS: Final = 16_000


def restart_pause(
    restarts: int, first_s: float = RESTART_PAUSE_S, cap_s: float = MAX_RESTART_PAUSE_S
) -> float:
    """The pause before restart number ``restarts`` (1 for the first)."""
    return min(cap_s, first_s * 2 ** min(max(restarts - 1, 0), 16))


def supervise(
    body: Callable[[], None],
    *,
    on_crash: Callable[[Exception], float],
    wait: Callable[[float], None],
) -> None:
    """Run ``body`` until it returns. When it raises, ``on_crash`` records the crash and says
    how long to pause (``restart_pause`` of the owner's count), ``wait`` pauses (returning
    early when the owner is closing: ``body`` then sees that and returns), and ``body`` runs
    again. Only ``Exception``: an interpreter shutting down ends the loop."""
    while True:
        try:
            body()
            return
        except Exception as exc:
            pause = on_crash(exc)
        wait(pause)


def log_crash(
    log: logging.Logger,
    who: str,
    exc: BaseException,
    pause: float,
    restarts: int,
    scrub: Callable[[str], str] = lambda text: text,
) -> None:
    """The crash's log line: who died, when it starts again, how often it did, its traceback
    (``scrub`` masks what must not be logged, e.g. a manifest URI's credentials)."""
    trace = scrub("".join(traceback.format_exception(exc)))
    log.error(
        "%s died of an unexpected error; restarted in %.1f s (%d restarts): %s",
        who,
        pause,
        restarts,
        clip_text(trace, MAX_TRACEBACK_CHARS),
    )
