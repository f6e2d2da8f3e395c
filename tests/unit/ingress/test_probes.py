"""Status probes (app.ingress.probes): what one probe finds, the replica views it leaves, and
the bookkeeping of a probe loop that dies and is started again. No Ray."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.contracts import STABLE
from app.ingress.probes import (
    PROBE_RESTART_MAX_DELAY_S,
    ProbeFinding,
    ProbeLoopRestarts,
    ReplicaViews,
    probe_cohort,
)
from tests.unit.ingress.fakes import Replicas


def test_a_probe_finds_serving_replicas_and_their_evaluation() -> None:
    replicas = Replicas()
    finding = asyncio.run(probe_cohort(STABLE, lambda: replicas.ask_status(STABLE), timeout_s=1))
    assert finding.answered and finding.serving and len(finding.reports) == 2
    assert finding.evaluation == {"ndcg_at_10": 0.41}


def test_failed_calls_and_reports_that_are_not_reports_are_no_answer() -> None:
    async def not_a_report() -> Any:
        return {"replica_id": "x"}

    async def hangs() -> Any:
        await asyncio.sleep(3600)

    for ask in (not_a_report, hangs):
        finding = asyncio.run(probe_cohort(STABLE, ask, timeout_s=0.05))
        assert not finding.answered and not finding.serving and finding.evaluation is None


def test_a_cancelled_call_ends_the_probe_so_the_loop_can_be_restarted() -> None:
    async def cancelled() -> Any:
        raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(probe_cohort(STABLE, cancelled, timeout_s=1))


def test_replica_views_forget_everyone_when_nobody_answers_and_the_stale_after_the_ttl():
    replicas = Replicas()
    finding = asyncio.run(probe_cohort(STABLE, lambda: replicas.ask_status(STABLE), timeout_s=1))
    views = ReplicaViews()
    views.record(finding, now=0.0, ttl_s=30)
    assert len(views) == 1 and views.items()[0][0] == "stable-1"
    views.record(ProbeFinding(answered=True, serving=True), now=31.0, ttl_s=30)
    assert len(views) == 0  # not heard of for longer than the ttl
    views.record(finding, now=40.0, ttl_s=30)
    views.record(ProbeFinding(answered=False, serving=False), now=41.0, ttl_s=30)
    assert len(views) == 0


def test_restart_delays_double_while_the_loop_dies_in_a_row_up_to_the_cap() -> None:
    restarts = ProbeLoopRestarts()
    delays = [restarts.died("RuntimeError: x", now=float(i)) for i in range(8)]
    assert delays[:3] == [0.5, 1.0, 2.0] and delays[-1] == PROBE_RESTART_MAX_DELAY_S
    restarts.round_completed()
    assert restarts.died("RuntimeError: y", now=10.0) == 0.5
    view = restarts.status(now=12.5)
    assert view.restarts == 9 and view.last_error == "RuntimeError: y"
    assert view.last_error_s_ago == 2.5
