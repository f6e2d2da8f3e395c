"""Doubles shared by the in-process tests of the Serve shells: the router's class as Serve
instantiates it, Starlette requests built as Serve hands them over, a chunked body that keeps
coming, and a bounded poll for async tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

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
