"""Doubles shared by the in-process tests of the Serve shells: the router's class as Serve
instantiates it, Starlette requests built as Serve hands them over, a chunked body that keeps
coming, deployment handles whose calls answer, fail or hang (``LiveCohort``), a rank request
sent the way Serve hands it over (``rank``), and a bounded poll for async tests."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from app.contracts import InstanceReport, ModelMeta, WireAnswer
from app.models.ranker_mlp.features import NUM_FEATURES
from deployments.router import Router

RouterClass: Any = Router.func_or_class  # the class Serve instantiates in a replica


def http_request(
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    receive: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> Request:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "server": ("test", 80),
        "scheme": "http",
    }

    async def no_body() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request(scope, receive or no_body)


async def wait_for(predicate: Callable[[], bool], what: str, bound_s: float = 20.0) -> None:
    """Poll ``predicate`` (a bound against hanging, not a timing assertion)."""
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound_s}s: {what}")
        await asyncio.sleep(0.01)


def endless_chunks(counter: list[int], chunk: int = 64 * 1024, stop_after: int = 64 << 20):
    """A chunked body that keeps coming (up to ``stop_after`` bytes, so that code which reads
    it all still ends); ``counter[0]`` is the bytes handed out so far."""

    async def receive() -> dict[str, Any]:
        counter[0] += chunk
        return {"type": "http.request", "body": b" " * chunk, "more_body": counter[0] < stop_after}

    return receive


class LiveCohort:
    """A deployment handle: ``rank`` answers ("ok"), raises ("fail") or never answers
    ("hang"); ``status`` finds a serving replica ("serving"), one with no model ("idle") or
    nobody ("gone")."""

    def __init__(self, cohort: str, *, rank: str = "ok", probe: str = "serving",
                 evaluation: dict[str, float] | None = None) -> None:  # fmt: skip
        self.cohort = cohort
        self.rank_mode = rank
        self.probe = probe
        self.evaluation = evaluation or {}
        self.calls: list[int] = []  # batch size of each rank call
        self.status = _Status(self)

    def options(self, **_: Any) -> LiveCohort:
        return self

    def remote(self, batch: list[Any]) -> asyncio.Future[WireAnswer]:
        self.calls.append(len(batch))
        mode = self.rank_mode

        async def answer() -> WireAnswer:
            if mode == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(0.01)
            if mode == "fail":
                raise RuntimeError(f"{self.cohort} replica died")
            meta = ModelMeta(f"{self.cohort}-model", 3, self.cohort, "torch", f"{self.cohort}-1")
            return WireAnswer(meta, [[("a", 0.5, "good")] for _ in batch])

        return asyncio.ensure_future(answer())


class _Status:
    def __init__(self, cohort: LiveCohort) -> None:
        self.c = cohort
        self.seq = 0

    def remote(self) -> Any:
        self.seq += 1
        c, seq = self.c, self.seq

        async def report() -> dict[str, Any]:
            if c.probe == "gone":
                await asyncio.sleep(3600)
            serving = c.probe == "serving"
            return InstanceReport(
                replica_id=f"{c.cohort}-1",
                cohort=c.cohort,  # type: ignore[arg-type]
                pid=1,
                phase="ready" if serving else "idle",  # type: ignore[arg-type]
                actual_revision=3 if serving else None,
                actual_artifact=f"{c.cohort}-model" if serving else None,
                heartbeat=time.time(),
                seq=seq,
                evaluation=c.evaluation if serving else {},
            ).model_dump(mode="json")

        return report()


def body(user: str) -> bytes:
    candidate = {"id": "a", "features": [0.5] * NUM_FEATURES}
    return json.dumps({"user_id": user, "candidates": [candidate], "top_n": 1}).encode()


async def rank(router: Any, user: str) -> tuple[int, dict[str, Any], float]:
    payload = body(user)
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.request", "body": b"", "more_body": False}
        sent = True
        return {"type": "http.request", "body": payload, "more_body": False}

    started = time.monotonic()
    request = http_request(
        "POST", "/v1/rank", {"content-type": "application/json",
                             "content-length": str(len(payload))}, receive,
    )  # fmt: skip
    response = await asyncio.wait_for(router(request), 60)
    return response.status_code, json.loads(response.body), time.monotonic() - started
