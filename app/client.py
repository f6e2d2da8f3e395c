"""A Python client of the ranking API that rides out drains and overload.

The router answers 503 with ``Retry-After`` while it drains or is over its in-flight bound;
a replica shutdown can also show up as a dropped connection, and a router replica lost with
its node in the middle of a call as a 500 from Serve's HTTP proxy (the router never answers
500 itself: its own failures are 503s, a client's mistakes 4xx). Ranking is read-only, so a
retry has no side effect: the client retries 429/500/502/503/504 answers and connection errors,
waits at least what ``Retry-After`` asks (capped), and otherwise backs off exponentially with
jitter so that clients that failed together do not come back together. Client mistakes (other
4xx) are never retried.

A 2xx answer's body reads back into ``app.api.RankResponse`` (``RankResult.answer()``), the
model the router builds it with: one set of keys on both sides.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import httpx

from app.api import RankResponse
from app.errors import RankerClientError as RankerClientError  # old import path
from app.errors import RankerHTTPError, RetriesExhausted

RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    initial_s: float = 0.1
    multiplier: float = 2.0
    cap_s: float = 5.0
    max_retry_after_s: float = 30.0  # a server asking for longer is capped to this
    deadline_s: float = 60.0  # overall budget for one call, retries included

    def backoff(self, attempt: int) -> float:
        """Ceiling of the delay after the ``attempt``-th failure (1-based)."""
        return min(self.cap_s, self.initial_s * self.multiplier ** max(0, attempt - 1))

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        ceiling = self.backoff(attempt)
        if retry_after is None:
            return ceiling / 2 + rng.uniform(0, ceiling / 2)  # equal jitter
        wait = min(max(retry_after, 0.0), self.max_retry_after_s)
        # At least what the server asked for, spread a little so a crowd does not return at
        # the same instant.
        return wait + rng.uniform(0, min(ceiling, max(wait, ceiling)) / 2)


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date; None if absent
    or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


@dataclass(frozen=True)
class RankResult:
    status: int
    body: dict[str, Any]
    headers: Mapping[str, str]
    attempts: int

    def answer(self) -> RankResponse:
        """The body as the ranking API's answer model (validated: it came over the wire)."""
        return RankResponse.model_validate(self.body)


class _Attempts:
    """The retry decision shared by the sync and async clients."""

    def __init__(self, policy: RetryPolicy, rng: random.Random, clock: Callable[[], float]):
        self.policy = policy
        self.rng = rng
        self.clock = clock
        self.started = clock()
        self.attempt = 0
        self.last = "none"

    def next_wait(self, retry_after: float | None) -> float:
        """Seconds to wait before the next attempt; raises when out of attempts or time."""
        if self.attempt >= self.policy.max_attempts:
            raise RetriesExhausted(self.attempt, self.last)
        wait = self.policy.delay(self.attempt, retry_after, self.rng)
        if self.clock() - self.started + wait > self.policy.deadline_s:
            raise RetriesExhausted(self.attempt, f"{self.last} (deadline)")
        return wait

    def judge(self, response: httpx.Response) -> RankResult | float:
        """A result to return, or the seconds to wait before retrying."""
        if response.status_code < 300:
            return RankResult(
                response.status_code, response.json(), dict(response.headers), self.attempt
            )
        if response.status_code not in RETRY_STATUSES:
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
            raise RankerHTTPError(response.status_code, body)
        self.last = f"HTTP {response.status_code}"
        return self.next_wait(parse_retry_after(response.headers.get("retry-after")))

    def judge_error(self, exc: httpx.TransportError) -> float:
        self.last = f"{type(exc).__name__}: {exc}"
        return self.next_wait(None)


class RankerClient:
    """Synchronous client. ``rank(body)`` posts to ``/v1/rank`` with retries."""

    def __init__(
        self,
        base_url: str,
        *,
        policy: RetryPolicy | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout_s, transport=transport, headers=headers
        )
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._clock = clock

    def rank(
        self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> RankResult:
        attempts = _Attempts(self.policy, self._rng, self._clock)
        while True:
            attempts.attempt += 1
            try:
                response = self._http.post("/v1/rank", json=dict(body), headers=headers)
            except httpx.TransportError as exc:
                self._sleep(attempts.judge_error(exc))
                continue
            verdict = attempts.judge(response)
            if isinstance(verdict, RankResult):
                return verdict
            self._sleep(verdict)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RankerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRankerClient:
    """asyncio twin of ``RankerClient`` (load generators, async services)."""

    def __init__(
        self,
        base_url: str,
        *,
        policy: RetryPolicy | None = None,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        headers: Mapping[str, str] | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout_s,
            transport=transport,
            headers=headers,
            limits=limits or httpx.Limits(max_connections=100, max_keepalive_connections=100),
        )
        self._rng = rng or random.Random()
        self._clock = clock

    async def rank(
        self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> RankResult:
        attempts = _Attempts(self.policy, self._rng, self._clock)
        while True:
            attempts.attempt += 1
            try:
                response = await self._http.post("/v1/rank", json=dict(body), headers=headers)
            except httpx.TransportError as exc:
                await asyncio.sleep(attempts.judge_error(exc))
                continue
            verdict = attempts.judge(response)
            if isinstance(verdict, RankResult):
                return verdict
            await asyncio.sleep(verdict)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRankerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
