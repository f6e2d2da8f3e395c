"""Doubles of what the ingress core is given: the replicas behind its send callables, metric
recorders in place of Ray's classes, a clock the test moves, and rank requests as the Serve
shell hands their bodies over. No Ray, no Starlette."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app import telemetry as t
from app.contracts import CANARY, FALLBACK, STABLE, InstanceReport, ModelMeta, WireAnswer
from app.ingress.core import IngressCore
from app.ingress.instruments import RouterInstruments, ShadowInstruments, StandbyInstruments
from app.ingress.routing import NOT_SERVING_CATEGORY
from app.model_family import DEFAULT_FAMILIES, families_for
from app.models.ranker_mlp.features import NUM_FEATURES

SCHEMA = families_for(DEFAULT_FAMILIES).schema(None)
EVALUATION = {"ndcg_at_10": 0.41}


class NotServing(RuntimeError):
    """What a replica without a model raises (its category, as app.replica's)."""

    category = NOT_SERVING_CATEGORY


class Replicas:
    """The core's transport. ``rank[role]``: how its calls end ("ok", "fail", "not_serving",
    "hang"); ``probe[role]``: what a status call finds ("serving", "idle" without a model,
    "gone": the call fails, "hang": no answer). ``sent`` lists (role, batch size) of every
    rank call."""

    def __init__(self) -> None:
        self.rank = {STABLE: "ok", CANARY: "ok", FALLBACK: "ok"}
        self.probe = {STABLE: "serving", CANARY: "serving", FALLBACK: "serving"}
        self.sent: list[tuple[str, int]] = []
        self.asked: list[str] = []
        self.cancelled = 0

    async def send(self, role: str, batch: list[Any]) -> WireAnswer:
        self.sent.append((role, len(batch)))
        mode = self.rank[role]
        try:
            if mode == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if mode == "fail":
            raise RuntimeError(f"{role} replica died")
        if mode == "not_serving":
            raise NotServing(f"{role} holds no model")
        meta = ModelMeta(f"{role}-model", 3, role, "torch-test", f"{role}-1")
        return WireAnswer(meta, [[("a", 0.5, "good"), ("b", 0.25, "bad")] for _ in batch])

    async def ask_status(self, role: str) -> dict[str, Any]:
        self.asked.append(role)
        mode = self.probe[role]
        if mode == "gone":
            raise ConnectionError(f"no {role} replica")
        if mode == "hang":
            await asyncio.sleep(3600)
        serving = mode == "serving"
        return InstanceReport(
            replica_id=f"{role}-1",
            cohort=role,  # type: ignore[arg-type]
            pid=1,
            phase="ready" if serving else "idle",  # type: ignore[arg-type]
            actual_revision=3 if serving else None,
            actual_artifact=f"{role}-model" if serving else None,
            heartbeat=time.time(),
            seq=len(self.asked),
            evaluation=EVALUATION if serving else {},
        ).model_dump(mode="json")


class Recorder:
    """A metric: every ``inc``/``set``/``observe`` as (value, tags)."""

    def __init__(self, spec: t.MetricSpec) -> None:
        self.spec = spec
        self.calls: list[tuple[float, dict[str, str]]] = []

    def _record(self, value: float, tags: dict[str, str] | None) -> None:
        if set(tags or {}) - set(self.spec.labels):
            raise AssertionError(f"{self.spec.name}: tags {tags} not in {self.spec.labels}")
        self.calls.append((value, dict(tags or {})))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)

    def total(self, **tags: str) -> float:
        return sum(v for v, seen in self.calls if all(seen.get(k) == x for k, x in tags.items()))


class Clock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_core(
    replicas: Replicas,
    *,
    fallback: bool = False,
    clock: Callable[[], float] = time.monotonic,
    **config: Any,
) -> IngressCore:
    roles = (STABLE, CANARY, FALLBACK) if fallback else (STABLE, CANARY)
    core = IngressCore(
        roles,  # type: ignore[arg-type]
        SCHEMA,
        send=replicas.send,  # type: ignore[arg-type]
        ask_status=replicas.ask_status,  # type: ignore[arg-type]
        instruments=RouterInstruments.build(Recorder),
        shadow_instruments=ShadowInstruments.build(Recorder),
        standby_instruments=StandbyInstruments.build(Recorder) if fallback else None,
        clock=clock,
        rng=random.Random(7),
    )
    core.reconfigure({"probe_interval_s": 0.05, "reveal_cohort": True, **config})
    return core


async def probed(core: IngressCore) -> None:
    """One probe round of every role, as the probe loop runs it."""
    core.probe_now()
    await core.probe_turn()


def body(user: str | None) -> bytes:
    candidates = [{"id": c, "features": [0.5] * NUM_FEATURES} for c in ("a", "b")]
    document: dict[str, Any] = {"candidates": candidates, "top_n": 2}
    if user is not None:
        document["user_id"] = user
    return json.dumps(document).encode()


async def rank(
    core: IngressCore, user: str | None = "u1", *, cohort_header: str | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON answer, headers) of one rank request."""
    payload = body(user)

    async def chunks() -> AsyncIterator[bytes]:
        yield payload

    answer = await asyncio.wait_for(core.rank(str(len(payload)), chunks(), cohort_header), 30)
    return answer.status, json.loads(answer.body), dict(answer.headers or {})
