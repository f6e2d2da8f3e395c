"""Coalescing of concurrent rank requests for one cohort into few handle calls.

Each handle call from the router to a replica costs about as much router CPU as the request
it carries, so under load the router sends one call for many requests. A ``CohortCoalescer``
keeps at most ``max_calls`` calls in flight (the router sets it per replica of the cohort);
requests that arrive meanwhile wait and ride together in the next call, up to ``max_batch``
of them. Idle, a request goes out alone at once: coalescing adds no latency, it only uses
the time a request would have waited for a replica anyway.

Every waiter gets an answer: its ranking, the call's error, or its own cancellation. A waiter
cancelled before its call goes out is left out of the call; one cancelled while its call is
in flight leaves the call running for the others.

Pure asyncio: no Ray (the router passes in ``send``).
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Awaitable, Callable

from app.contracts import ModelMeta, WireAnswer, WireRequest

Ranking = list[tuple[str, float, str]]  # (candidate id, score, label), best first
Answer = tuple[ModelMeta, Ranking]
Waiter = tuple[WireRequest, asyncio.Future[Answer]]


class CohortCoalescer:
    """``submit`` one request, get its (model, ranking); ``send`` carries one batch per call.

    ``max_calls`` and ``max_batch`` may be changed at any time; a change applies to the
    calls that go out after it."""

    def __init__(
        self,
        send: Callable[[list[WireRequest]], Awaitable[WireAnswer]],
        *,
        max_calls: int,
        max_batch: int,
    ) -> None:
        self._send = send
        self.max_calls = max_calls
        self.max_batch = max_batch
        self._pending: deque[Waiter] = deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        """Calls sent and not finished."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests not sent yet (cancelled ones included until a call would take them)."""
        return len(self._pending)

    async def submit(self, request: WireRequest) -> Answer:
        """(ModelMeta, ranking) for one request; raises what its handle call raised."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._launch()
        return await future

    def _launch(self) -> None:
        """Send calls while there is room in flight and a live request waits."""
        while self._in_flight < self.max_calls:
            batch = self._next_batch()
            if not batch:
                return
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._call(batch))
            self._tasks.add(task)
            # The bookkeeping is a done-callback, not a ``finally`` in ``_call``: it runs even
            # for a task cancelled before it started.
            task.add_done_callback(functools.partial(self._finished, batch))

    def _next_batch(self) -> list[Waiter]:
        batch: list[Waiter] = []
        while self._pending and len(batch) < self.max_batch:
            waiter = self._pending.popleft()
            if not waiter[1].done():  # cancelled while waiting: no one wants its answer
                batch.append(waiter)
        return batch

    async def _call(self, batch: list[Waiter]) -> None:
        answer = await self._send([request for request, _ in batch])
        if len(answer.rankings) != len(batch):
            raise RuntimeError(
                f"a replica answered {len(answer.rankings)} rankings for {len(batch)} requests"
            )
        for (_, future), ranking in zip(batch, answer.rankings, strict=True):
            if not future.done():
                future.set_result((answer.model, ranking))

    def _finished(self, batch: list[Waiter], task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight -= 1
        if task.cancelled():
            for _, future in batch:
                future.cancel()  # no-op for the answered and the already cancelled
        else:
            exc = task.exception()
            if exc is not None:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)  # every waiter of the call gets its error
        self._launch()
