"""The ingress core (app.ingress.core) without Ray: admission, the failover order, the
breakers as requests and probes move them, the hot standby's route and its bounded cold wait,
the mirroring offer and the outcome counts. Replicas are fakes behind the core's send
callables (tests/unit/ingress/fakes.py); the Serve shell around it is tests/inprocess's.
"""

from __future__ import annotations

import asyncio
import json

from app import telemetry as t
from app.contracts import CANARY, FALLBACK, STABLE
from app.ingress.core import COHORT_HEADER
from tests.unit.ingress.fakes import Clock, Replicas, make_core, probed, rank

ALWAYS = {"policy": "always"}  # the guard out of the way: the fallback may always answer


def counts(core) -> dict[tuple[str, str], int]:
    return core.take_counts()


# --------------------------------------------------------------------------- admission


def test_a_draining_router_refuses_with_retry_after() -> None:
    async def main() -> None:
        core = make_core(Replicas(), draining=True, retry_after_s=7)
        status, answer, headers = await rank(core)
        assert status == 503 and answer["error"] == "draining", answer
        assert headers == {"Retry-After": "7"}
        assert core.metrics.rejections.total(reason="draining") == 1

    asyncio.run(main())


def test_requests_over_the_in_flight_bound_are_refused_as_overloaded() -> None:
    async def main() -> None:
        replicas = Replicas()
        replicas.rank[STABLE] = "hang"
        core = make_core(replicas, max_in_flight=2, request_timeout_s=0.5, failover=False)
        await probed(core)
        held = [asyncio.ensure_future(rank(core, f"u{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        assert core.in_flight == 2
        status, answer, _ = await rank(core, "third")
        assert (status, answer["detail"]) == (503, "over 2 requests"), answer
        assert [s for s, _, _ in await asyncio.gather(*held)] == [503, 503]  # timed out
        assert core.in_flight == 0

    asyncio.run(main())


def test_a_bad_body_and_a_bad_cohort_header_are_422s_naming_the_field() -> None:
    async def main() -> None:
        core = make_core(Replicas(), allow_cohort_header=True)

        async def empty():
            if False:
                yield b""

        answer = await core.rank("0", empty())
        assert answer.status == 422 and json.loads(answer.body)["field"] == "body"
        assert not answer.close_connection  # the body was read whole
        status, refused, _ = await rank(core, cohort_header="blue")
        assert status == 422 and refused["field"] == COHORT_HEADER, refused

    asyncio.run(main())


def test_a_declared_body_over_the_cap_closes_the_connection() -> None:
    async def main() -> None:
        core = make_core(Replicas())

        async def never():
            raise AssertionError("the body was read")
            yield b""

        answer = await core.rank(str(1 << 30), never())
        assert answer.status == 413 and answer.close_connection

    asyncio.run(main())


# --------------------------------------------------------------------------- failover order


def test_a_failing_cohort_fails_over_to_the_other_then_is_skipped_while_its_breaker_is_open():
    async def main() -> None:
        replicas, clock = Replicas(), Clock()
        replicas.rank[CANARY] = "fail"
        core = make_core(replicas, clock=clock, canary_bp=10_000)
        await probed(core)

        status, answer, headers = await rank(core, "u1")
        assert status == 200 and answer["failover"] is True, answer
        assert answer["model"]["cohort"] == STABLE and headers["X-Model-Cohort"] == STABLE
        assert [role for role, _ in replicas.sent] == [CANARY, STABLE]  # bucketed first
        assert core.metrics.failovers.total(from_cohort=CANARY, cohort=STABLE) == 1
        assert counts(core) == {(CANARY, "error"): 1, (STABLE, "ok"): 1}
        assert core.health[CANARY].is_open(clock())

        # While its breaker is open the canary is not tried; its users are diverted, and the
        # judge still sees them as the canary's (not an empty window).
        replicas.sent.clear()
        status, answer, _ = await rank(core, "u2")
        assert status == 200 and answer["failover"] is True
        assert [role for role, _ in replicas.sent] == [STABLE]
        assert counts(core) == {(CANARY, "diverted"): 1, (STABLE, "ok"): 1}

        # After the breaker's window one request tries the canary again.
        clock.advance(1.5)
        replicas.rank[CANARY] = "ok"
        replicas.sent.clear()
        status, answer, _ = await rank(core, "u3")
        assert answer["failover"] is False and [r for r, _ in replicas.sent] == [CANARY]

    asyncio.run(main())


def test_failover_goes_bucketed_cohort_then_other_primary_then_fallback() -> None:
    async def main() -> None:
        replicas = Replicas()
        replicas.rank[CANARY] = replicas.rank[STABLE] = "fail"
        core = make_core(replicas, fallback=True, canary_bp=10_000, standby=ALWAYS)
        await probed(core)
        status, answer, _ = await rank(core)
        assert status == 200 and answer["model"]["cohort"] == FALLBACK, answer
        assert [role for role, _ in replicas.sent] == [CANARY, STABLE, FALLBACK]
        assert core.standby.answered == 1
        assert core.metrics.failovers.total(from_cohort=CANARY, cohort=FALLBACK) == 1

    asyncio.run(main())


def test_no_cohort_answering_is_a_503_naming_what_was_tried() -> None:
    async def main() -> None:
        replicas = Replicas()
        replicas.rank[CANARY] = replicas.rank[STABLE] = "fail"
        core = make_core(replicas, allow_cohort_header=True)
        await probed(core)
        status, answer, headers = await rank(core)
        assert (status, answer["detail"]) == (503, "no cohort could answer"), answer
        assert "Retry-After" in headers
        # A forced request never fails over: the forced cohort's own error.
        status, answer, _ = await rank(core, cohort_header="canary")
        assert answer["detail"] == "cohort canary could not answer", answer

    asyncio.run(main())


def test_a_cohort_without_a_model_is_no_failover_destination_until_probed_serving() -> None:
    async def main() -> None:
        replicas, clock = Replicas(), Clock()
        core = make_core(replicas, clock=clock, canary_bp=10_000)
        await probed(core)
        replicas.rank[CANARY] = "not_serving"  # its target was cleared
        await rank(core, "u1")
        assert core.health[CANARY].serving is False
        # Stable's calls now fail: nothing to fail over to (the canary holds no model).
        replicas.rank[STABLE] = "fail"
        clock.advance(60)
        replicas.sent.clear()
        status, _, _ = await rank(core, "u2")
        assert status == 503 and [role for role, _ in replicas.sent] == [STABLE]

    asyncio.run(main())


def test_calls_that_outlast_request_timeout_are_cancelled_and_fail_over() -> None:
    async def main() -> None:
        replicas = Replicas()
        replicas.rank[CANARY] = "hang"
        core = make_core(replicas, canary_bp=10_000, request_timeout_s=0.1)
        await probed(core)
        status, answer, _ = await rank(core)
        assert status == 200 and answer["model"]["cohort"] == STABLE
        assert replicas.cancelled == 1  # the hung call was cancelled, not left running

    asyncio.run(main())


# --------------------------------------------------------------------------- breakers


def test_the_standby_breaker_opens_on_failed_calls_and_fails_back_through_its_states() -> None:
    async def main() -> None:
        replicas, clock = Replicas(), Clock()
        replicas.probe[CANARY] = "idle"
        replicas.rank[STABLE] = "fail"
        standby = {**ALWAYS, "trip_after_failures": 2, "min_open_s": 5, "fail_back_after_s": 60,
                   "ramp_s": 30}  # fmt: skip
        core = make_core(replicas, fallback=True, clock=clock, standby=standby)
        await probed(core)
        breaker = core.standby.breakers[STABLE]

        for i in range(2):  # each answered by the fallback after stable failed
            clock.advance(10)  # past the cohort's short health breaker
            status, answer, _ = await rank(core, f"u{i}")
            assert status == 200 and answer["model"]["cohort"] == FALLBACK
        assert breaker.state == "open" and breaker.opened == 1
        assert "2 calls in a row failed" in (breaker.reason or "")

        # Open: stable is not tried at all.
        replicas.sent.clear()
        clock.advance(10)
        await rank(core, "u3")
        assert [role for role, _ in replicas.sent] == [FALLBACK]

        # A probe that finds it serving, min_open_s after it opened: half-open, then time
        # alone ramps it and closes it.
        replicas.rank[STABLE] = "ok"
        await probed(core)
        assert breaker.state == "half_open"
        clock.advance(60)
        assert core.standby_view().breakers[0].state == "ramping"
        clock.advance(30)
        assert core.standby_view().breakers[0].state == "closed"

    asyncio.run(main())


def test_a_call_to_a_cohort_without_a_model_does_not_count_for_its_breaker() -> None:
    async def main() -> None:
        replicas, clock = Replicas(), Clock()
        replicas.probe[CANARY] = "idle"
        replicas.rank[STABLE] = "not_serving"
        standby = {**ALWAYS, "trip_after_failures": 1}
        core = make_core(replicas, fallback=True, clock=clock, standby=standby)
        await probed(core)
        status, answer, _ = await rank(core)
        assert status == 200 and answer["model"]["cohort"] == FALLBACK
        assert core.standby.breakers[STABLE].state == "closed"

    asyncio.run(main())


def test_unanswered_probes_open_the_breaker_and_the_view_shows_the_outage() -> None:
    async def main() -> None:
        replicas, clock = Replicas(), Clock()
        core = make_core(replicas, fallback=True, clock=clock, standby={"trip_after_probes": 2})
        await probed(core)
        assert core.standby_view().primaries_down is False
        replicas.probe[STABLE] = replicas.probe[CANARY] = "gone"
        await probed(core)
        await probed(core)
        view = core.standby_view()
        assert [b.state for b in view.breakers] == ["open", "open"]
        assert view.primaries_down and view.ready
        # The guard compared the two models' evaluations: equal, so the fallback answers.
        assert view.allowed and view.serving_from_fallback, view.allowed_reason
        core.flush_counts()
        gauges = core.standby_metrics
        assert gauges.primaries_down.calls[-1][0] == 1.0
        assert gauges.breaker_state.total(cohort=STABLE, state="open") >= 1.0

    asyncio.run(main())


# --------------------------------------------------------------------------- cold wait


async def cold_standby(cold_queue_max: int, cold_wait_s: float):
    """Stable gone (its breaker open), the canary idle at weight 0, the fallback cold."""
    replicas = Replicas()
    replicas.probe[CANARY] = replicas.probe[FALLBACK] = "idle"
    standby = {**ALWAYS, "trip_after_probes": 1, "cold_queue_max": cold_queue_max,
               "cold_wait_s": cold_wait_s}  # fmt: skip
    core = make_core(replicas, fallback=True, standby=standby)
    await probed(core)
    replicas.probe[STABLE] = "gone"
    await probed(core)
    assert core.standby.breakers[STABLE].state == "open"
    return replicas, core


def test_a_cold_fallback_holds_at_most_cold_queue_max_requests_for_at_most_cold_wait_s():
    async def main() -> None:
        _, core = await cold_standby(cold_queue_max=2, cold_wait_s=0.3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        timed: list[tuple[str, float]] = []

        async def one(user: str) -> None:
            _, answer, _ = await rank(core, user)
            timed.append((answer["error"], loop.time() - started))

        await asyncio.gather(*(one(f"u{i}") for i in range(4)))
        errors = sorted(timed)
        assert [e for e, _ in errors] == ["fallback_not_ready"] * 2 + ["standby_queue_full"] * 2
        assert all(0.29 <= took < 2.0 for e, took in errors if e == "fallback_not_ready")
        assert all(took < 0.2 for e, took in errors if e == "standby_queue_full")
        assert core.standby.waiting == 0
        # Each one meant for stable: counted against it, not left out of its window.
        assert counts(core) == {(STABLE, "diverted"): 4}

    asyncio.run(main())


def test_a_waiting_request_is_answered_as_soon_as_the_fallbacks_probe_finds_it_serving():
    async def main() -> None:
        replicas, core = await cold_standby(cold_queue_max=4, cold_wait_s=30)
        waiting = asyncio.ensure_future(rank(core, "w"))
        await asyncio.sleep(0.05)
        assert core.standby.waiting == 1
        replicas.probe[FALLBACK] = "serving"
        await core.probe(FALLBACK)  # its own probe wakes the waiter, before the round ends
        status, answer, _ = await asyncio.wait_for(waiting, 5)
        assert status == 200 and answer["model"]["cohort"] == FALLBACK, answer

    asyncio.run(main())


def test_a_refused_fallback_is_a_503_at_once_with_the_guards_reason() -> None:
    async def main() -> None:
        replicas = Replicas()
        replicas.probe[CANARY] = "idle"
        standby = {"policy": "never", "trip_after_probes": 1}
        core = make_core(replicas, fallback=True, standby=standby)
        await probed(core)
        replicas.probe[STABLE] = "gone"
        await probed(core)
        status, answer, _ = await rank(core)
        assert (status, answer["error"]) == (503, "fallback_refused"), answer
        assert "policy never" in answer["detail"]

    asyncio.run(main())


# --------------------------------------------------------------------------- mirroring


def test_stable_answers_are_offered_for_mirroring_and_failovers_are_not() -> None:
    async def main() -> None:
        replicas = Replicas()
        core = make_core(replicas, shadow={"fraction_bp": 10_000})
        await probed(core)
        status, answer, _ = await rank(core, "u1")
        assert status == 200 and answer["model"]["cohort"] == STABLE
        await asyncio.sleep(0.05)  # the copy runs in a task of its own
        assert [role for role, _ in replicas.sent] == [STABLE, CANARY]
        assert core.mirror.take_counts() == {"compared": 1}
        assert core.shadow_metrics.rbo.calls[0][1] == {t.ARTIFACT: "canary-model"}

        # Answered by failover (stable failed; the canary answered): no copy.
        replicas.rank[STABLE] = "fail"
        replicas.sent.clear()
        status, answer, _ = await rank(core, "u2")
        assert answer["failover"] is True
        await asyncio.sleep(0.05)
        assert [role for role, _ in replicas.sent] == [STABLE, CANARY]
        assert core.mirror.take_counts() == {}

    asyncio.run(main())


def test_nothing_is_mirrored_at_fraction_zero() -> None:
    async def main() -> None:
        replicas = Replicas()
        core = make_core(replicas)
        await probed(core)
        for i in range(5):
            await rank(core, f"u{i}")
        await asyncio.sleep(0.02)
        assert {role for role, _ in replicas.sent} == {STABLE}

    asyncio.run(main())


# --------------------------------------------------------------------------- counts, status


def test_outcome_counts_are_flushed_once_into_the_requests_counter_with_the_gauges() -> None:
    async def main() -> None:
        replicas = Replicas()
        core = make_core(replicas, canary_bp=2500)
        await probed(core)
        for i in range(20):
            await rank(core, f"u{i}")
        core.flush_counts()
        requests = core.metrics.requests
        by_cohort = {c: requests.total(cohort=c, outcome="ok") for c in (STABLE, CANARY)}
        assert sum(by_cohort.values()) == 20 and all(by_cohort.values()), by_cohort
        core.flush_counts()  # flushed once: nothing more
        assert requests.total(outcome="ok") == 20
        assert core.metrics.canary_weight.calls[-1][0] == 2500
        assert core.metrics.in_flight.calls[-1][0] == 0
        assert len(core.metrics.latency.calls) == 20

    asyncio.run(main())


def test_counts_are_flushed_while_a_probe_round_waits_on_a_silent_replica() -> None:
    # The controller's first window after a weight change waits the flush interval for the
    # counts of the old weights: a probe that waits out its timeout must not hold them back.
    async def main() -> None:
        replicas = Replicas()
        core = make_core(replicas)  # probes time out after 0.5 s here
        await probed(core)
        for i in range(5):
            await rank(core, f"u{i}")
        replicas.probe[STABLE] = "hang"
        core.probe_now()
        turn = asyncio.ensure_future(core.probe_turn())
        await asyncio.sleep(t.REQUEST_COUNT_FLUSH_S + 0.1)
        assert not turn.done()  # the round still waits on stable's silent replica
        assert core.metrics.requests.total(outcome="ok") == 5
        await turn
        assert core.probe_restarts.view.restarts == 0

    asyncio.run(main())


def test_status_shows_weights_health_replicas_and_the_probe_loops_deaths() -> None:
    async def main() -> None:
        replicas, clock = Replicas(), Clock()
        core = make_core(replicas, clock=clock, canary_bp=1500)
        await probed(core)
        core.probe_restarts.died("RuntimeError: boom", clock())
        clock.advance(2)
        status = core.status().model_dump(mode="json")
        weights = {c["cohort"]: c["weight_bp"] for c in status["cohorts"]}
        assert weights == {STABLE: 8500, CANARY: 1500}
        assert all(c["serving"] and c["replicas"] for c in status["cohorts"])
        assert status["probe_loop"]["restarts"] == 1
        assert status["probe_loop"]["last_error_s_ago"] == 2.0
        assert status["standby"] is None

    asyncio.run(main())


def test_startup_waits_for_the_first_probe_and_readiness_reports_draining() -> None:
    async def main() -> None:
        core = make_core(Replicas())
        await probed(core)
        assert (await core.startup()).status == 200
        core.reconfigure({"draining": True})
        ready = await core.readiness()
        assert ready.status == 503 and json.loads(ready.body)["reason"] == "draining"

    asyncio.run(main())
