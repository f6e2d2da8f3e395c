"""Shadow traffic: copies of stable-answered requests sent to the canary, off the client's path.

The router hands a request to ``ShadowMirror.offer`` once stable has answered it and the
client's response is built; the mirror sends the copy in a task of its own and returns at
once, so the client's latency and errors never depend on the canary. The canary's answer
goes to nobody: it is compared with stable's (``app.divergence.compare_rankings``) and the
comparison is handed to ``on_compared`` (the router exports it as metrics).

Bounded: at most ``ShadowRouting.max_in_flight`` copies are in flight at once. A copy that
finds no room is dropped and counted, never queued: a slow or stuck canary must neither
grow the router's memory nor take its event loop from the requests users wait for.

Pure asyncio: no Ray (the router passes in ``send``, the canary's coalescer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from app.contracts import BASIS_POINTS, ModelMeta, ShadowRouting, WireRequest
from app.divergence import Divergence, compare_rankings
from app.ingress.routing import bucket

Ranking = Sequence[tuple[str, float, str]]  # (candidate id, score, label), best first
Answer = tuple[ModelMeta, Ranking]

# Outcomes of a copy, as the router's shadow counter labels them.
COMPARED: Final = "compared"
DROPPED: Final = "dropped"  # no room in flight: never sent
ERROR: Final = "error"  # sent; the canary did not answer (error or timeout)
OUTCOMES: Final = (COMPARED, DROPPED, ERROR)


def shadow_salt(salt: str) -> str:
    """Mirroring samples users by another hash than bucketing does: which users are copied
    must not depend on which users a weight sends to the canary."""
    return f"{salt}:shadow"


def is_mirrored(
    *, fraction_bp: int, salt: str, key: str | None, random_bp: Callable[[], int]
) -> bool:
    """Whether a request is copied: by its key's bucket (a user is copied on every request or
    on none), at random for a request without a key."""
    if fraction_bp <= 0:
        return False
    if fraction_bp >= BASIS_POINTS:
        return True
    point = bucket(shadow_salt(salt), key) if key else random_bp()
    return point < fraction_bp


@dataclass(frozen=True)
class Comparison:
    """One copy the canary answered: which artifacts were compared, and how far apart."""

    canary_artifact: str
    stable_artifact: str
    divergence: Divergence


class ShadowMirror:
    def __init__(
        self,
        send: Callable[[WireRequest], Awaitable[Answer]],
        *,
        on_compared: Callable[[Comparison], None],
        timeout_s: float | None = 30.0,
    ) -> None:
        self._send = send
        self._on_compared = on_compared
        self.config = ShadowRouting()
        self.timeout_s = timeout_s
        self.in_flight = 0
        # Outcome -> copies since the last ``take_counts`` (the router flushes them).
        self._counts: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _count(self, outcome: str) -> None:
        self._counts[outcome] = self._counts.get(outcome, 0) + 1

    def take_counts(self) -> dict[str, int]:
        counts, self._counts = self._counts, {}
        return counts

    def offer(self, request: WireRequest, stable_meta: ModelMeta, stable: Ranking) -> bool:
        """Copy ``request`` to the canary unless the copies in flight are at the bound; True
        when it was sent. Never waits and never raises for the canary's sake."""
        if self.in_flight >= self.config.max_in_flight:
            self._count(DROPPED)
            return False
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._mirror(request, stable_meta, stable))
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return True

    def _finished(self, task: asyncio.Task[None]) -> None:
        # A done-callback, not a ``finally``: it runs even for a task cancelled before it ran.
        self._tasks.discard(task)
        self.in_flight -= 1
        if task.cancelled():
            self._count(ERROR)

    async def _mirror(self, request: WireRequest, stable_meta: ModelMeta, stable: Ranking) -> None:
        config = self.config
        try:
            # ``timeout_s`` None: the sender bounds the call (the router's does, from the
            # moment the call goes out), and the copy keeps its slot until the call is over,
            # so the bound holds at the canary too.
            sent = self._send(request)
            meta, ranking = await (
                sent if self.timeout_s is None else asyncio.wait_for(sent, self.timeout_s)
            )
        except Exception:
            self._count(ERROR)
            return
        try:
            divergence = compare_rankings(
                [(cid, score) for cid, score, _ in stable],
                [(cid, score) for cid, score, _ in ranking],
                top_k=config.top_k,
                rbo_p=config.rbo_p,
            )
        except Exception:
            self._count(ERROR)  # an answer that cannot be compared is no comparison
            return
        self._count(COMPARED)
        self._on_compared(Comparison(meta.artifact_id, stable_meta.artifact_id, divergence))

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
