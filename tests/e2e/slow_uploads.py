"""Clients that upload slowly, aimed at one cohort: what an audit used to get good candidates
rolled back. Each request's body goes out in two halves ``pause_s`` apart (chunked, over real
HTTP through Serve's proxy), from users whose bucket puts them in the canary at every weight
from ``canary_bp`` up, one request every ``every_s`` from a background thread."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from app.ingress.routing import bucket, request_key
from tests.e2e.harness import rank_body


def canary_users(salt: str, canary_bp: int, count: int) -> list[str]:
    """``count`` user ids bucketed under ``canary_bp``: in the canary at that weight and at
    every higher one (bucketing is monotone in the weight)."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        user = f"slow-uploader-{i}"
        key = request_key(user, None)
        assert key is not None
        if bucket(salt, key) < canary_bp:
            found.append(user)
        i += 1
    return found


@dataclass
class SlowUpload:
    started: float  # wall clock
    status: int
    cohort: str | None
    seconds: float


@dataclass
class SlowUploads:
    url: str
    users: list[str]
    pause_s: float
    every_s: float
    done: list[SlowUpload] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> SlowUploads:
        ticker = threading.Thread(target=self._tick, name="slow-uploads", daemon=True)
        ticker.start()
        self._threads.append(ticker)
        return self

    def stop(self) -> list[SlowUpload]:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=self.pause_s + 30)
        return list(self.done)

    def _tick(self) -> None:
        n = 0
        while not self._stop.wait(self.every_s):
            user = self.users[n % len(self.users)]
            n += 1
            one = threading.Thread(target=self._upload, args=(user,), daemon=True)
            one.start()
            self._threads.append(one)

    def _upload(self, user: str) -> None:
        payload = json.dumps(rank_body(user)).encode()
        pause_s = self.pause_s

        def halves() -> Iterator[bytes]:
            yield payload[: len(payload) // 2]
            time.sleep(pause_s)
            yield payload[len(payload) // 2 :]

        started, t0 = time.time(), time.monotonic()
        try:
            answer = httpx.post(
                f"{self.url}/v1/rank",
                content=halves(),
                headers={"content-type": "application/json"},
                timeout=pause_s + 30,
            )
            cohort = answer.json().get("model", {}).get("cohort") if answer.is_success else None
            status = answer.status_code
        except httpx.HTTPError:
            status, cohort = 0, None
        self.done.append(SlowUpload(started, status, cohort, time.monotonic() - t0))
