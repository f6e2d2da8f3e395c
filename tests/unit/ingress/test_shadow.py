"""Mirroring of stable-answered requests to the canary (app/ingress/shadow.py): which users are
copied, and the bound on copies in flight. asyncio with a fake canary the test answers, no Ray."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from app.contracts import BASIS_POINTS, ModelMeta, ShadowRouting, WireRequest
from app.ingress.routing import choose_cohort, request_key
from app.ingress.shadow import COMPARED, DROPPED, ERROR, Comparison, ShadowMirror, is_mirrored
from app.models.ranker_mlp.features import NUM_FEATURES

STABLE_META = ModelMeta("ranker-v41", 3, "stable", "torch-test", "stable-1")
CANARY_META = ModelMeta("ranker-v43", 4, "canary", "torch-test", "canary-1")
STABLE_RANKING = [("a", 0.9, "excellent"), ("b", 0.5, "good"), ("c", 0.1, "poor")]


def request(name: str = "a") -> WireRequest:
    return WireRequest((name,), np.zeros((1, NUM_FEATURES), np.float32), {}, 3)


async def settle() -> None:
    """Let every ready task run (wait_for adds a task hop of its own)."""
    for _ in range(5):
        await asyncio.sleep(0.001)


def never():
    raise AssertionError("a keyed request must not be sampled at random")


# ---------------------------------------------------------------------------- the sampler


def test_a_user_is_mirrored_on_every_request_or_on_none() -> None:
    keys = [request_key(f"user-{i}", None) for i in range(2000)]
    first = [is_mirrored(fraction_bp=1000, salt="s", key=k, random_bp=never) for k in keys]
    again = [is_mirrored(fraction_bp=1000, salt="s", key=k, random_bp=never) for k in keys]
    assert first == again
    share = sum(first) / len(first)
    assert 0.07 < share < 0.13, share  # 10% of users, within sampling noise
    # A larger fraction keeps every user it had (the hash point is compared with it).
    wider = [is_mirrored(fraction_bp=3000, salt="s", key=k, random_bp=never) for k in keys]
    assert all(w for f, w in zip(first, wider, strict=True) if f)
    # Another salt picks other users.
    other = [is_mirrored(fraction_bp=1000, salt="t", key=k, random_bp=never) for k in keys]
    assert other != first


def test_mirrored_users_do_not_follow_the_canary_bucketing() -> None:
    """The copies are sampled by another hash than the weights: at 10% of each, the users
    mirrored are not the users a canary weight would take."""
    keys = [request_key(f"user-{i}", None) for i in range(4000)]
    mirrored = {k for k in keys if is_mirrored(fraction_bp=1000, salt="s", key=k, random_bp=never)}
    canary = {
        k
        for k in keys
        if choose_cohort(canary_bp=1000, salt="s", key=k, random_bp=never) == "canary"
    }
    both = len(mirrored & canary) / len(mirrored)
    assert 0.05 < both < 0.15, both  # independent: about 10% of the mirrored are in both


def test_off_all_and_keyless_requests() -> None:
    assert not is_mirrored(fraction_bp=0, salt="s", key="u:1", random_bp=never)
    assert is_mirrored(fraction_bp=BASIS_POINTS, salt="s", key="u:1", random_bp=never)
    rng = random.Random(3)
    keyless = [
        is_mirrored(fraction_bp=2500, salt="s", key=None, random_bp=lambda: rng.randrange(10_000))
        for _ in range(4000)
    ]
    assert 0.22 < sum(keyless) / len(keyless) < 0.28


# ---------------------------------------------------------------------------- the mirror


class FakeCanary:
    def __init__(self) -> None:
        self.calls: list[asyncio.Future[Any]] = []

    async def send(self, _request: WireRequest) -> Any:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls.append(answer)
        return await answer


def test_copies_beyond_the_bound_are_dropped_not_queued() -> None:
    async def scenario() -> None:
        canary = FakeCanary()
        compared: list[Comparison] = []
        mirror = ShadowMirror(canary.send, on_compared=compared.append, timeout_s=5)
        mirror.config = ShadowRouting(fraction_bp=10_000, max_in_flight=3)
        sent = [mirror.offer(request(), STABLE_META, STABLE_RANKING) for _ in range(10)]
        assert sent == [True] * 3 + [False] * 7
        assert mirror.in_flight == 3
        await settle()  # the copies' tasks start
        assert len(canary.calls) == 3
        # The canary answers one: room for one more copy, and only one.
        canary.calls[0].set_result((CANARY_META, [("b", 0.8, "good"), ("a", 0.7, "good")]))
        await settle()
        assert mirror.in_flight == 2
        assert mirror.offer(request(), STABLE_META, STABLE_RANKING) is True
        assert mirror.offer(request(), STABLE_META, STABLE_RANKING) is False
        await settle()
        assert len(canary.calls) == 4
        # One fails; the rest answer.
        canary.calls[1].set_exception(RuntimeError("canary down"))
        for answer in canary.calls[2:]:
            answer.set_result((CANARY_META, list(STABLE_RANKING)))
        await settle()
        assert mirror.in_flight == 0
        counts = mirror.take_counts()
        assert counts == {DROPPED: 8, COMPARED: 3, ERROR: 1}
        assert mirror.take_counts() == {}
        assert [c.canary_artifact for c in compared] == ["ranker-v43"] * 3
        assert compared[0].stable_artifact == "ranker-v41"
        first = compared[0].divergence
        assert first.top1_changed and first.max_score_diff == pytest.approx(0.3)
        assert all(c.divergence.rbo == pytest.approx(1.0) for c in compared[1:])

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_stuck_canary_costs_a_copy_its_timeout_and_nothing_else() -> None:
    async def scenario() -> None:
        canary = FakeCanary()
        mirror = ShadowMirror(canary.send, on_compared=lambda _c: None, timeout_s=0.05)
        mirror.config = ShadowRouting(fraction_bp=10_000, max_in_flight=2)
        # offer never waits for the canary: it returns before the copy is even sent.
        assert mirror.offer(request(), STABLE_META, STABLE_RANKING)
        assert canary.calls == []
        await asyncio.sleep(0.2)
        assert mirror.in_flight == 0
        assert mirror.take_counts() == {ERROR: 1}
        # Closing cancels what is in flight; a cancelled copy is counted, not lost.
        mirror.timeout_s = 5
        mirror.offer(request(), STABLE_META, STABLE_RANKING)
        await asyncio.sleep(0)
        mirror.close()
        await settle()
        assert mirror.in_flight == 0
        assert mirror.take_counts() == {ERROR: 1}

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_without_a_timeout_of_its_own_a_copy_holds_its_slot_until_the_call_ends() -> None:
    """The router's mirror leaves timing out to its sender: a slow canary keeps the copies
    it has and gets no more (the bound holds at the canary, not only in the mirror)."""

    async def scenario() -> None:
        canary = FakeCanary()
        mirror = ShadowMirror(canary.send, on_compared=lambda _c: None, timeout_s=None)
        mirror.config = ShadowRouting(fraction_bp=10_000, max_in_flight=2)
        assert mirror.offer(request(), STABLE_META, STABLE_RANKING)
        assert mirror.offer(request(), STABLE_META, STABLE_RANKING)
        await asyncio.sleep(0.2)
        assert mirror.in_flight == 2
        assert not mirror.offer(request(), STABLE_META, STABLE_RANKING)
        canary.calls[0].set_exception(TimeoutError())  # the sender's own timeout
        canary.calls[1].set_result((CANARY_META, [("b", 0.6, "good")]))
        await settle()
        assert mirror.in_flight == 0
        assert mirror.take_counts() == {DROPPED: 1, ERROR: 1, COMPARED: 1}

    asyncio.run(asyncio.wait_for(scenario(), 10))
