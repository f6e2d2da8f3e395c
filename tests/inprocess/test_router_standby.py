"""The router's hot standby, outside Serve: the router object with fake deployment handles
whose rank calls answer, fail or hang and whose status probes find a model, none, or nobody.

What is checked here, where the pure tests (tests/unit/ingress/test_standby.py) cannot reach: that a
coalesced call counts once for the breaker, that a cold fallback's wait is bounded in time and
in number, that an app without a fallback exports no standby at all, and that the view holds
on the router's real clock. The real stack is tests/e2e/test_standby.py.
"""

from __future__ import annotations

import asyncio

from tests.inprocess.doubles import LiveCohort, RouterClass, http_request, rank, wait_for

LITE = {"ndcg_at_10": 0.401}
STABLE_EVAL = {"ndcg_at_10": 0.412}


def standby_router(stable: LiveCohort, canary: LiveCohort, fallback: LiveCohort, **standby):
    router = RouterClass(stable, canary, fallback)
    router.reconfigure(
        {
            "probe_interval_s": 0.05,
            "request_timeout_s": 0.3,
            "reveal_cohort": True,  # the answers' cohort is what these tests check
            "standby": {"fail_back_after_s": 60, "ramp_s": 10, **standby},
        }
    )
    return router


def test_an_app_without_a_fallback_has_no_standby_and_routes_as_before() -> None:
    async def main() -> None:
        stable, canary = LiveCohort("stable"), LiveCohort("canary", rank="fail")
        router = RouterClass(stable, canary)
        router.reconfigure({"canary_bp": 10_000, "probe_interval_s": 0.05, "reveal_cohort": True})
        await router(http_request("GET", "/livez"))  # starts the probes
        await wait_for(lambda: router._health["stable"].serving, "stable seen serving")
        for i in range(12):  # every canary call fails: each request fails over to stable
            code, answer, _ = await rank(router, f"u{i}")
            assert code == 200 and answer["model"]["cohort"] == "stable", answer
            assert answer["failover"] is True
        status = router.status().model_dump(mode="json")
        assert status["standby"] is None
        assert [c["cohort"] for c in status["cohorts"]] == ["stable", "canary"]
        router.__del__()

    asyncio.run(main())


def test_requests_coalesced_into_one_failed_call_count_once_for_the_breaker() -> None:
    async def main() -> None:
        stable = LiveCohort("stable", rank="hang", evaluation=STABLE_EVAL)
        canary = LiveCohort("canary", probe="idle")
        fallback = LiveCohort("fallback", evaluation=LITE)
        router = standby_router(stable, canary, fallback, trip_after_failures=3)
        await router(http_request("GET", "/livez"))  # starts the probes
        await wait_for(lambda: router.standby_view().ready, "the fallback ready")
        # Twelve requests at once: they ride in a few calls, each timing out.
        results = await asyncio.gather(*(rank(router, f"u{i}") for i in range(12)))
        assert all(code == 200 for code, _, _ in results), results
        # The fallback answered each one the stable cohort could not (the last resort).
        assert {a["model"]["cohort"] for _, a, _ in results} == {"fallback"}
        view = router.standby_view()
        stable_breaker = view.breakers[0]
        assert len(stable.calls) < 3 <= sum(stable.calls), stable.calls
        assert stable_breaker.state == "closed", stable_breaker  # calls, not requests, count
        # Calls that keep failing trip it.
        for i in range(3):
            await rank(router, f"v{i}")
        view = router.standby_view()
        # Open; or already half-open: its probes still find it serving, only its calls hang
        # (it then takes the probe share, and a failure opens it again).
        assert view.breakers[0].state in ("open", "half_open") and view.breakers[0].opened == 1
        router.__del__()

    asyncio.run(main())


def test_a_cold_fallback_holds_requests_within_its_bounds_then_answers() -> None:
    async def main() -> None:
        stable = LiveCohort("stable", rank="hang", evaluation=STABLE_EVAL)
        canary = LiveCohort("canary", probe="idle")
        fallback = LiveCohort("fallback", probe="idle")  # cold since the router started
        router = standby_router(
            stable, canary, fallback, cold_queue_max=2, cold_wait_s=2.5, trip_after_probes=2
        )
        await router(http_request("GET", "/livez"))
        await wait_for(lambda: router.standby_view().stable_metric is not None, "stable seen")
        stable.probe = "gone"  # its replicas die
        await wait_for(lambda: router.standby_view().breakers[0].state == "open", "stable open")
        assert router.standby_view().primaries_down
        # Five at once: two wait (the bound) and give up at the deadline; three are refused
        # at once. None refused by the guard: an unreported fallback is waited for.
        results = await asyncio.gather(*(rank(router, f"u{i}") for i in range(5)))
        errors = sorted((a["error"], took) for _, a, took in results)
        assert [e for e, _ in errors] == ["fallback_not_ready"] * 2 + ["standby_queue_full"] * 3
        assert all(2.45 <= took <= 4.0 for e, took in errors if e == "fallback_not_ready")
        assert all(took < 0.3 for e, took in errors if e == "standby_queue_full"), errors
        assert all(code == 503 for code, _, _ in results)
        # The fallback comes up while a request waits: that request is answered by it.
        waiting = asyncio.ensure_future(rank(router, "w"))
        await asyncio.sleep(0.1)
        fallback.probe, fallback.evaluation = "serving", LITE
        code, answer, took = await waiting
        assert code == 200 and answer["model"]["cohort"] == "fallback", answer
        assert took > 0.1  # it waited
        assert router.standby_view().serving_from_fallback
        router.__del__()

    asyncio.run(main())


def test_the_view_holds_on_the_routers_real_clock() -> None:
    async def main() -> None:
        router = standby_router(
            LiveCohort("stable", evaluation=STABLE_EVAL), LiveCohort("canary", probe="idle"),
            LiveCohort("fallback", evaluation=LITE),
        )  # fmt: skip
        await router(http_request("GET", "/livez"))
        await wait_for(lambda: router.standby_view().allowed, "the guard allows the fallback")
        status = router.status().model_dump(mode="json")
        standby = status["standby"]
        assert standby["primaries_down"] is False and standby["serving_from_fallback"] is False
        assert all(b["state"] == "closed" and b["in_state_s"] < 60 for b in standby["breakers"])
        assert "within 5%" in standby["allowed_reason"]
        assert [c["cohort"] for c in status["cohorts"]] == ["stable", "canary", "fallback"]
        router.__del__()

    asyncio.run(main())
