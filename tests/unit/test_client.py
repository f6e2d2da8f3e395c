"""The client honours Retry-After, backs off with capped jitter, and never retries mistakes.

httpx.MockTransport plays the server; sleeps are recorded, not slept.
"""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from app.api import RankResponse
from app.client import AsyncRankerClient, RankerClient, RetryPolicy, parse_retry_after
from app.contracts import ModelMeta
from app.errors import RankerHTTPError, RetriesExhausted

OK_BODY = {"ranking": [{"id": "a", "score": 0.9}], "model": {"artifact_id": "ranker-v41"}}


def scripted(*answers: httpx.Response | Exception) -> tuple[httpx.MockTransport, list[str]]:
    queue = list(answers)
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handler), seen


def client(transport: httpx.MockTransport, sleeps: list[float], **policy: float) -> RankerClient:
    return RankerClient(
        "http://ranker",
        transport=transport,
        policy=RetryPolicy(**policy),  # type: ignore[arg-type]
        rng=random.Random(0),
        sleep=sleeps.append,
    )


def test_success_needs_one_attempt() -> None:
    transport, seen = scripted(httpx.Response(200, json=OK_BODY))
    sleeps: list[float] = []
    result = client(transport, sleeps).rank({"candidates": []})
    assert result.body == OK_BODY and result.attempts == 1 and sleeps == [] and seen == ["/v1/rank"]


def test_an_answer_reads_back_into_the_routers_answer_model() -> None:
    meta = ModelMeta("ranker-v41", 3, "stable", "torch-2", "stable-1")
    sent = RankResponse.from_answer(meta, [("a", 0.9, "good")], failover=False, reveal_cohort=False)
    ok = httpx.Response(200, content=sent.body(), headers={"content-type": "application/json"})
    transport, _ = scripted(ok)
    answer = client(transport, []).rank({"candidates": []}).answer()
    assert answer == sent and answer.model.backbone_artifact_id is None
    assert answer.model.cohort is None and answer.ranking[0].id == "a"


def test_retry_after_is_honoured() -> None:
    transport, _ = scripted(
        httpx.Response(503, headers={"Retry-After": "2"}, json={"error": "draining"}),
        httpx.Response(200, json=OK_BODY),
    )
    sleeps: list[float] = []
    result = client(transport, sleeps, initial_s=0.1).rank({})
    assert result.attempts == 2
    assert len(sleeps) == 1 and 2.0 <= sleeps[0] <= 2.0 + 0.05 + 1e-9


def test_retry_after_is_capped() -> None:
    transport, _ = scripted(
        httpx.Response(503, headers={"Retry-After": "3600"}), httpx.Response(200, json=OK_BODY)
    )
    sleeps: list[float] = []
    client(transport, sleeps, max_retry_after_s=5.0, deadline_s=100).rank({})
    assert 5.0 <= sleeps[0] <= 7.5


def test_backoff_without_retry_after_grows_with_jitter_and_is_capped() -> None:
    transport, _ = scripted(
        *[httpx.Response(502) for _ in range(5)], httpx.Response(200, json=OK_BODY)
    )
    sleeps: list[float] = []
    client(transport, sleeps, initial_s=0.1, cap_s=0.4, max_attempts=6).rank({})
    ceilings = [0.1, 0.2, 0.4, 0.4, 0.4]
    assert len(sleeps) == 5
    for slept, ceiling in zip(sleeps, ceilings, strict=True):
        assert ceiling / 2 <= slept <= ceiling


def test_connection_errors_are_retried() -> None:
    transport, _ = scripted(httpx.ConnectError("refused"), httpx.Response(200, json=OK_BODY))
    sleeps: list[float] = []
    assert client(transport, sleeps).rank({}).attempts == 2


def test_a_call_lost_with_its_router_replica_is_retried() -> None:
    # Serve's proxy answers 500 when the replica serving a call dies (its node lost).
    transport, seen = scripted(
        httpx.Response(500, text="Internal Server Error"), httpx.Response(200, json=OK_BODY)
    )
    sleeps: list[float] = []
    assert client(transport, sleeps).rank({}).attempts == 2
    assert len(seen) == 2 and len(sleeps) == 1


def test_client_mistakes_are_not_retried() -> None:
    transport, seen = scripted(
        httpx.Response(422, json={"error": "invalid_request", "field": "candidates"})
    )
    sleeps: list[float] = []
    with pytest.raises(RankerHTTPError) as info:
        client(transport, sleeps).rank({})
    assert info.value.status == 422 and info.value.body["field"] == "candidates"
    assert len(seen) == 1 and sleeps == []


def test_gives_up_after_max_attempts() -> None:
    transport, seen = scripted(*[httpx.Response(503) for _ in range(3)])
    sleeps: list[float] = []
    with pytest.raises(RetriesExhausted, match="HTTP 503"):
        client(transport, sleeps, max_attempts=3).rank({})
    assert len(seen) == 3 and len(sleeps) == 2


def test_gives_up_at_the_deadline() -> None:
    transport, seen = scripted(*[httpx.Response(503, headers={"Retry-After": "10"})] * 3)
    sleeps: list[float] = []
    with pytest.raises(RetriesExhausted, match="deadline"):
        client(transport, sleeps, deadline_s=5.0).rank({})
    assert len(seen) == 1 and sleeps == []


def test_parse_retry_after() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("5") == 5.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30)), now=now) == 30.0
    assert parse_retry_after(format_datetime(now - timedelta(seconds=30)), now=now) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_async_client_retries_the_same_way() -> None:
    answers = [httpx.Response(503, headers={"Retry-After": "0"}), httpx.Response(200, json=OK_BODY)]

    async def handler(request: httpx.Request) -> httpx.Response:
        return answers.pop(0)

    async def main() -> int:
        async with AsyncRankerClient(
            "http://ranker",
            transport=httpx.MockTransport(handler),
            rng=random.Random(0),
            policy=RetryPolicy(initial_s=0.01, cap_s=0.02),
        ) as c:
            return (await c.rank({})).attempts

    assert asyncio.run(main()) == 2
