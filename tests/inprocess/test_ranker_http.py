"""The ranker deployment's direct HTTP handler (deployments/ranker.py ``Ranker.__call__``, the
benchmark's ingress without a router) refuses bodies over the cap with 413 before reading
them whole. The handler is called on the deployment's own class as Serve calls it; the
replica core is never built: a refused body must not reach it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from app.api import MAX_BODY_BYTES
from deployments.ranker import Ranker
from tests.inprocess.doubles import endless_chunks, http_request

RankerClass: Any = Ranker.func_or_class


def handler_without_core() -> Any:
    # __init__ needs a Serve replica context and loads a model; the 413 path needs neither.
    return RankerClass.__new__(RankerClass)


def test_a_declared_body_over_the_cap_gets_413_unread() -> None:
    async def never() -> dict[str, Any]:
        await asyncio.sleep(3600)
        raise AssertionError("the body was read")

    async def main() -> None:
        request = http_request("POST", "/v1/rank", {"content-length": str(1 << 30)}, never)
        response = await asyncio.wait_for(handler_without_core()(request), 30)
        payload = json.loads(response.body)
        assert response.status_code == 413, payload
        assert payload["field"] == "body" and payload["limit_bytes"] == MAX_BODY_BYTES
        assert str(1 << 30) in payload["detail"] and str(MAX_BODY_BYTES) in payload["detail"]

    asyncio.run(main())


def test_a_chunked_body_is_read_no_further_than_the_cap() -> None:
    async def main() -> None:
        handed_out = [0]
        request = http_request(
            "POST", "/v1/rank", {"transfer-encoding": "chunked"}, endless_chunks(handed_out)
        )
        response = await asyncio.wait_for(handler_without_core()(request), 30)
        assert response.status_code == 413, response.body
        assert json.loads(response.body)["error"] == "body_too_large"
        assert handed_out[0] <= MAX_BODY_BYTES + 64 * 1024, handed_out

    asyncio.run(main())
