"""What a client controls about its own request, outside Serve: the router object with fake
deployment handles, rank requests whose bodies arrive at the pace the test sets.

- A slow upload is not the cohort's latency: the histogram the judge reads (by cohort) starts
  once the body is read and parsed; the upload goes to a metric of its own, with no cohort.
- Slow bodies hold no admission slot: stalled uploads (fewer than ``max_body_reads``) never
  turn a normal request into a 503, however small ``max_in_flight``; a body past
  ``body_timeout_s`` is a 408 and the connection is closed; bodies beyond the read bounds
  (their number, their bytes together, a declared length reserved up front) get a 503 naming
  the bound, and the bound frees up when they end.
- An answer names its cohort only where the config says so (``reveal_cohort``).

Counts, not timings, except where a time is the subject: an upload the test makes last 1 s
against a judged latency that must not contain it (the fake cohort answers in 10 ms).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.responses import Response

from tests.inprocess.doubles import LiveCohort, RouterClass, body, http_request, rank, wait_for


class Recorded:
    """A metric's ``observe`` calls (value, tags), in place of Ray's histogram."""

    def __init__(self) -> None:
        self.values: list[tuple[float, dict[str, str]]] = []

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.append((value, dict(tags or {})))


def router_with(**config: Any) -> Any:
    router = RouterClass(LiveCohort("stable"), LiveCohort("canary"))
    router.reconfigure({"probe_interval_s": 0.05, **config})
    return router


async def started(router: Any) -> None:
    await router(http_request("GET", "/livez"))  # starts the probes
    await wait_for(lambda: router._health["stable"].serving, "stable seen serving")


def slow_request(
    payload: bytes, *, pause_s: float, release: asyncio.Event | None = None, declared: bool = True
) -> Any:
    """A rank request whose body comes in two halves, ``pause_s`` apart (or, with
    ``release``, the second half once it is set)."""
    parts = [payload[: len(payload) // 2], payload[len(payload) // 2 :]]

    async def receive() -> dict[str, Any]:
        if not parts:
            return {"type": "http.request", "body": b"", "more_body": False}
        if len(parts) == 1:
            if release is not None:
                await release.wait()
            else:
                await asyncio.sleep(pause_s)
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    headers = {"content-type": "application/json"}
    if declared:
        headers["content-length"] = str(len(payload))
    return http_request("POST", "/v1/rank", headers, receive)


def test_a_slow_upload_is_not_the_cohorts_judged_latency() -> None:
    async def main() -> None:
        router = router_with(canary_bp=10_000, reveal_cohort=True)
        await started(router)
        judged, uploads = Recorded(), Recorded()
        router._metrics.latency, router._metrics.body_read = judged, uploads

        response = await router(slow_request(body("slow-uploader"), pause_s=1.0))

        assert response.status_code == 200, response.body
        assert json.loads(response.body)["model"]["cohort"] == "canary"
        [(latency_ms, tags)] = judged.values
        assert tags == {"cohort": "canary", "outcome": "ok"}
        # The 1 s upload is in the upload metric (no cohort), not in the canary's latency.
        assert latency_ms < 500, latency_ms
        [(upload_ms, upload_tags)] = uploads.values
        assert upload_ms >= 1000 and upload_tags == {}, (upload_ms, upload_tags)
        router.__del__()

    asyncio.run(main())


def test_stalled_uploads_below_the_read_bound_never_turn_a_normal_request_into_a_503() -> None:
    async def main() -> None:
        router = router_with(max_in_flight=2, max_body_reads=8, body_timeout_s=60)
        await started(router)
        release = asyncio.Event()
        stalled = [
            asyncio.ensure_future(router(slow_request(body(f"s{i}"), pause_s=0, release=release)))
            for i in range(6)
        ]
        await wait_for(lambda: router._body_reads.reading == 6, "six uploads stalled")

        normal = await asyncio.gather(*(rank(router, f"u{i}") for i in range(2)))
        assert [code for code, _, _ in normal] == [200, 200], normal
        for _ in range(3):  # and again: nothing was left holding a slot
            assert (await rank(router, "again"))[0] == 200

        # Released at once, the six compete for the two admission slots like any burst.
        release.set()
        answers: list[Response] = await asyncio.gather(*stalled)
        codes = sorted(a.status_code for a in answers)
        assert codes.count(200) >= 2 and set(codes) <= {200, 503}, codes
        assert all(
            json.loads(a.body)["detail"] == "over 2 requests"
            for a in answers
            if a.status_code == 503
        )
        assert router._body_reads.reading == 0 and router._body_reads.held_bytes == 0
        router.__del__()

    asyncio.run(main())


def test_a_body_past_its_deadline_is_a_408_that_closes_the_connection() -> None:
    async def main() -> None:
        router = router_with(body_timeout_s=0.2)
        await started(router)
        response = await router(slow_request(body("stalled"), pause_s=30))
        assert response.status_code == 408, response.body
        answer = json.loads(response.body)
        assert answer["error"] == "body_timeout" and answer["limit_s"] == 0.2, answer
        assert "body_timeout_s" in answer["detail"], answer
        assert response.headers["connection"] == "close"
        assert router._body_reads.reading == 0
        assert (await rank(router, "next"))[0] == 200
        router.__del__()

    asyncio.run(main())


def test_a_declared_length_reserves_its_bytes_and_is_refused_beyond_the_byte_bound() -> None:
    async def main() -> None:
        router = router_with(max_body_read_bytes=8 << 20, body_timeout_s=60)
        await started(router)
        release = asyncio.Event()
        # A declared 8 MiB reserves the whole byte budget before a byte of it arrives.
        big = asyncio.ensure_future(
            router(slow_request(b" " * (8 << 20), pause_s=0, release=release))
        )
        await wait_for(lambda: router._body_reads.reading == 1, "the big upload stalled")

        code, answer, _ = await rank(router, "small")
        assert code == 503 and answer["limit"] == "max_body_read_bytes", answer
        assert "max_body_read_bytes" in answer["detail"], answer

        release.set()
        assert (await big).status_code == 422  # spaces: read whole, then refused as JSON
        assert router._body_reads.reading == 0 and router._body_reads.held_bytes == 0
        assert (await rank(router, "after"))[0] == 200
        router.__del__()

    asyncio.run(main())


def test_bodies_beyond_the_read_count_are_refused_naming_the_bound_until_they_end() -> None:
    async def main() -> None:
        router = router_with(max_body_reads=2, body_timeout_s=60)
        await started(router)
        release = asyncio.Event()
        stalled = [
            asyncio.ensure_future(
                router(slow_request(body(f"s{i}"), pause_s=0, release=release, declared=i == 0))
            )
            for i in range(2)  # one with a Content-Length, one chunked
        ]
        await wait_for(lambda: router._body_reads.reading == 2, "two uploads stalled")

        code, answer, _ = await rank(router, "third")
        assert code == 503 and answer["limit"] == "max_body_reads", answer
        assert answer["error"] == "overloaded" and "max_body_reads" in answer["detail"]

        release.set()
        assert [r.status_code for r in await asyncio.gather(*stalled)] == [200, 200]
        assert router._body_reads.reading == 0 and router._body_reads.held_bytes == 0
        assert (await rank(router, "after"))[0] == 200
        router.__del__()

    asyncio.run(main())


def test_an_answer_names_its_cohort_only_where_the_config_says_so() -> None:
    async def main() -> None:
        router = router_with(canary_bp=10_000)
        await started(router)

        async def answer() -> Response:
            payload = body("who-am-i")
            sent = False

            async def receive() -> dict[str, Any]:
                nonlocal sent
                more, sent = not sent, True
                return {"type": "http.request", "body": payload if more else b"",
                        "more_body": False}  # fmt: skip

            return await router(http_request("POST", "/v1/rank", {}, receive))

        hidden = await answer()
        assert hidden.status_code == 200
        assert "x-model-cohort" not in hidden.headers
        assert "cohort" not in json.loads(hidden.body)["model"]
        assert hidden.headers["x-model-artifact"] == "canary-model"

        router.reconfigure({"probe_interval_s": 0.05, "canary_bp": 10_000, "reveal_cohort": True})
        shown = await answer()
        assert shown.headers["x-model-cohort"] == "canary"
        assert json.loads(shown.body)["model"]["cohort"] == "canary"
        router.__del__()

    asyncio.run(main())
