"""The router's per-cohort coalescing of requests into handle calls (app.ingress.coalescing):
asyncio with a fake replica whose calls the test answers one by one, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from app.contracts import ModelMeta, WireAnswer, WireRequest
from app.ingress.coalescing import Answer, CohortCoalescer
from app.models.ranker_mlp.features import NUM_FEATURES

META = ModelMeta("ranker-v42", 7, "canary", "torch-test", "replica-1")
TIMEOUT_S = 5.0  # a test that hangs (a lost waiter) fails after this instead


class FakeReplica:
    """``send`` records each call's requests (by name) and returns when the test answers."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], asyncio.Future[WireAnswer]]] = []
        self.concurrent = 0
        self.most_concurrent = 0

    async def send(self, batch: list[WireRequest]) -> WireAnswer:
        answer: asyncio.Future[WireAnswer] = asyncio.get_running_loop().create_future()
        self.calls.append(([r.candidate_ids[0] for r in batch], answer))
        self.concurrent += 1
        self.most_concurrent = max(self.most_concurrent, self.concurrent)
        try:
            return await answer
        finally:
            self.concurrent -= 1

    @property
    def batches(self) -> list[list[str]]:
        return [names for names, _ in self.calls]

    def answer(self, call: int, rankings: int | None = None) -> None:
        """Answer call ``call``: each request's ranking is its own name (or ``rankings`` of
        them, to answer the wrong number)."""
        names, future = self.calls[call]
        count = len(names) if rankings is None else rankings
        future.set_result(WireAnswer(META, [[(n, 0.5, "fair")] for n in names[:count]]))

    def fail(self, call: int, exc: BaseException) -> None:
        self.calls[call][1].set_exception(exc)


def request(name: str) -> WireRequest:
    return WireRequest((name,), np.zeros((1, NUM_FEATURES), dtype=np.float32), {}, 1)


async def settle() -> None:
    """Let every task that can run, run (the fake replica does no I/O)."""
    for _ in range(10):
        await asyncio.sleep(0)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), TIMEOUT_S)

    asyncio.run(bounded())


def submit(coalescer: CohortCoalescer, name: str) -> asyncio.Task[Answer]:
    return asyncio.get_running_loop().create_task(coalescer.submit(request(name)))


def ranked(task: asyncio.Task[Answer]) -> str:
    meta, ranking = task.result()
    assert meta == META
    [(name, _, _)] = ranking
    return name


def make(replica: FakeReplica, *, max_calls: int = 1, max_batch: int = 64) -> CohortCoalescer:
    send: Callable[[list[WireRequest]], Awaitable[WireAnswer]] = replica.send
    return CohortCoalescer(send, max_calls=max_calls, max_batch=max_batch)


def test_an_idle_request_goes_out_alone_at_once() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica)
        a = submit(coalescer, "a")
        await settle()
        assert replica.batches == [["a"]]  # sent without waiting for company
        replica.answer(0)
        await settle()
        assert ranked(a) == "a" and coalescer.in_flight == 0

    run(scenario)


def test_busy_requests_ride_together_up_to_the_batch_cap() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica, max_calls=1, max_batch=3)
        tasks = {"a": submit(coalescer, "a")}
        await settle()
        for name in "bcde":
            tasks[name] = submit(coalescer, name)
        await settle()
        assert replica.batches == [["a"]]  # the others wait for the call in flight
        replica.answer(0)
        await settle()
        assert replica.batches == [["a"], ["b", "c", "d"]]  # one call, at most 3 requests
        replica.answer(1)
        await settle()
        assert replica.batches[2:] == [["e"]]
        replica.answer(2)
        await settle()
        assert {name: ranked(task) for name, task in tasks.items()} == {n: n for n in "abcde"}

    run(scenario)


def test_calls_in_flight_are_capped() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica, max_calls=2)
        tasks = [submit(coalescer, name) for name in "abcde"]
        await settle()
        assert replica.batches == [["a"], ["b"]] and coalescer.in_flight == 2
        replica.answer(1)
        await settle()
        assert replica.batches[2:] == [["c", "d", "e"]]  # the freed slot takes all waiting
        replica.answer(0)
        replica.answer(2)
        await settle()
        assert replica.most_concurrent == 2
        assert [ranked(t) for t in tasks] == list("abcde") and coalescer.in_flight == 0

    run(scenario)


def test_a_raised_limit_applies_to_the_next_calls() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica, max_calls=1, max_batch=1)
        tasks = [submit(coalescer, name) for name in "abc"]
        await settle()
        coalescer.max_calls, coalescer.max_batch = 2, 64  # e.g. a replica more
        replica.answer(0)
        await settle()
        assert replica.batches == [["a"], ["b", "c"]]
        replica.answer(1)
        await settle()
        assert [ranked(t) for t in tasks] == list("abc")

    run(scenario)


def test_an_error_reaches_every_waiter_of_that_call_and_no_other() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica)
        a = submit(coalescer, "a")
        await settle()
        b, c = submit(coalescer, "b"), submit(coalescer, "c")
        await settle()
        replica.answer(0)
        await settle()
        assert replica.batches[1] == ["b", "c"]
        boom = ConnectionError("replica died")
        replica.fail(1, boom)
        await settle()
        assert ranked(a) == "a"
        assert b.exception() is boom and c.exception() is boom
        # The failed call freed its slot: the next request goes out at once.
        d = submit(coalescer, "d")
        await settle()
        assert replica.batches[2:] == [["d"]]
        replica.answer(2)
        await settle()
        assert ranked(d) == "d" and coalescer.in_flight == 0

    run(scenario)


def test_an_answer_with_the_wrong_number_of_rankings_fails_every_waiter() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica)
        submit(coalescer, "a")
        await settle()
        b, c = submit(coalescer, "b"), submit(coalescer, "c")
        await settle()
        replica.answer(0)
        await settle()
        replica.answer(1, rankings=1)  # one ranking for two requests
        await settle()
        for task in (b, c):
            with pytest.raises(RuntimeError, match="1 rankings for 2 requests"):
                task.result()
        assert coalescer.in_flight == 0

    run(scenario)


def test_a_submit_cancelled_while_waiting_is_left_out_and_breaks_nothing() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica)
        a = submit(coalescer, "a")
        await settle()
        b, c, d = submit(coalescer, "b"), submit(coalescer, "c"), submit(coalescer, "d")
        await settle()
        c.cancel()
        await settle()
        replica.answer(0)
        await settle()
        assert replica.batches == [["a"], ["b", "d"]]  # nobody waits for c's answer
        replica.answer(1)
        await settle()
        assert (ranked(a), ranked(b), ranked(d)) == ("a", "b", "d") and c.cancelled()
        assert coalescer.in_flight == 0 and coalescer.waiting == 0

    run(scenario)


def test_a_waiter_cancelled_in_flight_leaves_its_call_running_for_the_others() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica)
        submit(coalescer, "a")
        await settle()
        b, c = submit(coalescer, "b"), submit(coalescer, "c")
        await settle()
        replica.answer(0)
        await settle()
        assert replica.batches[1] == ["b", "c"]
        b.cancel()
        await settle()
        assert coalescer.in_flight == 1  # the call goes on
        replica.answer(1)
        await settle()
        assert b.cancelled() and ranked(c) == "c" and coalescer.in_flight == 0
        e = submit(coalescer, "e")  # and the slot is free again
        await settle()
        assert replica.batches[2:] == [["e"]]
        replica.answer(2)
        await settle()
        assert ranked(e) == "e"

    run(scenario)


def test_a_cancelled_call_cancels_its_waiters_and_frees_its_slot() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        coalescer = make(replica)
        a = submit(coalescer, "a")
        await settle()
        b = submit(coalescer, "b")
        await settle()
        replica.calls[0][1].cancel()  # the handle call itself was cancelled
        await settle()
        assert a.cancelled()
        assert replica.batches == [["a"], ["b"]] and coalescer.in_flight == 1
        replica.answer(1)
        await settle()
        assert ranked(b) == "b" and coalescer.in_flight == 0

    run(scenario)
