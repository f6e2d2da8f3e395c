"""The router deployment's own object (deployments/router.py), outside Serve: its handlers are
called as Serve calls them (a Starlette request), its cohorts are fakes of a deployment handle.

What is checked here: a bad user_config is refused and shown, never raised, once the router
has a good one; the probe loop is restarted (and the death shown) when it dies, with no
request needed to bring it back; bodies over the cap get 413 before they are read whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from app.api import MAX_BODY_BYTES
from app.contracts import InstanceReport
from app.errors import ConfigError
from tests.inprocess.doubles import RouterClass, endless_chunks, http_request, wait_for


class FakeCohort:
    """A deployment handle's surface the router uses: ``options(...)``, ``status.remote()``
    and ``remote(batch)``. The first ``cancelled_probes`` status calls end the way a cancelled
    Ray call does (asyncio.CancelledError out of the await)."""

    def __init__(self, cohort: str, cancelled_probes: int = 0, serving: bool = True) -> None:
        self.cohort = cohort
        self.cancelled_probes = cancelled_probes
        self.serving = serving  # False: its replica holds no model (an idle pool)
        self.status_calls = 0
        self.status = self  # handle.status.remote()

    def options(self, **_: Any) -> FakeCohort:
        return self

    def remote(self, *args: Any) -> Awaitable[Any]:
        if args:  # a rank call: not used by these tests
            raise AssertionError("no rank calls expected")
        self.status_calls += 1
        call = self.status_calls

        async def answer() -> dict[str, Any]:
            if call <= self.cancelled_probes:
                raise asyncio.CancelledError()
            model = {"actual_revision": 3, "actual_artifact": "ranker-v41"}
            return InstanceReport(
                replica_id=f"{self.cohort}-1",
                cohort=self.cohort,  # type: ignore[arg-type]
                pid=1,
                phase="ready" if self.serving else "idle",  # type: ignore[arg-type]
                heartbeat=time.time(),
                seq=call,
                **(model if self.serving else {}),
            ).model_dump(mode="json")

        return answer()


def status_json(router: Any) -> dict[str, Any]:
    return router.status().model_dump(mode="json")


# --------------------------------------------------------------------------- user_config


def test_a_bad_config_after_a_good_one_is_refused_shown_and_cleared() -> None:
    async def main() -> None:
        router = RouterClass(FakeCohort("stable"), FakeCohort("canary"))
        router.reconfigure({"canary_bp": 2500, "probe_interval_s": 0.05})
        for bad, field in (
            ({"canary_pb": 5000}, "user_config.canary_pb"),
            ({"canary_bp": 10001}, "user_config.canary_bp"),
            ({"probe_interval_s": 1e12}, "user_config.probe_interval_s"),
        ):
            router.reconfigure(bad)  # does not raise
            status = status_json(router)
            assert status["canary_bp"] == 2500, status  # the last good config stays
            error = status["config_error"]
            assert error["category"] == "config" and error["field"] == field, error
            assert field.removeprefix("user_config.") in error["message"], error
        router.reconfigure({"canary_bp": 5000})
        status = status_json(router)
        assert status["config_error"] is None and status["canary_bp"] == 5000

    asyncio.run(main())


def test_a_bad_first_config_refuses_to_start_naming_the_field() -> None:
    router = RouterClass(FakeCohort("stable"), FakeCohort("canary"))
    with pytest.raises(ConfigError, match=r"user_config\.canary_pb"):
        router.reconfigure({"canary_pb": 5000})


# --------------------------------------------------------------------------- probe loop


def test_a_dead_probe_loop_is_restarted_and_reported_without_any_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        stable = FakeCohort("stable", cancelled_probes=1)
        canary = FakeCohort("canary")
        router = RouterClass(stable, canary)
        router.reconfigure({"probe_interval_s": 0.05})
        # One request starts probing (as the first request through Serve does); then none.
        response = await router(http_request("GET", "/livez"))
        assert response.status_code == 200
        await wait_for(lambda: stable.status_calls >= 5, "stable probed again after the death")
        status = status_json(router)
        loop = status["probe_loop"]
        assert loop["restarts"] >= 1 and "CancelledError" in loop["last_error"], loop
        stable_view = next(c for c in status["cohorts"] if c["cohort"] == "stable")
        assert stable_view["replicas"], status  # a later probe's answer is in the view
        router.__del__()

    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        asyncio.run(main())
    assert any("probe loop" in r.getMessage() for r in caplog.records), caplog.records


def test_an_idle_canary_is_probed_unless_it_idles_at_zero_replicas() -> None:
    """A probe is a request: one to a canary pool Serve autoscales to zero would start a
    replica (and keep an idle one from going). With ``probe_idle_canary`` off, once found
    holding no model at weight 0 it is left alone; given weight (the controller does so only
    once its replicas report ready) it is tried at once. By default it is probed on, so a
    canary given a target at 0% becomes a failover destination again."""

    async def main() -> None:
        stable, canary = FakeCohort("stable"), FakeCohort("canary", serving=False)
        router = RouterClass(stable, canary)
        router.reconfigure({"probe_interval_s": 0.02})
        response = await router(http_request("GET", "/livez"))
        assert response.status_code == 200
        await wait_for(lambda: canary.status_calls >= 20, "the idle canary probed on")

        idle = {"probe_interval_s": 0.02, "probe_idle_canary": False}
        router.reconfigure(idle)
        asked = canary.status_calls
        await wait_for(lambda: stable.status_calls >= asked + 20, "stable probed on")
        assert canary.status_calls <= asked + 2, canary.status_calls  # a round at most
        assert router._health["canary"].serving is False  # no failover destination

        canary.serving = True  # a rollout loaded the candidate; the controller gives weight
        asked = canary.status_calls
        router.reconfigure({**idle, "canary_bp": 2000})
        assert router._health["canary"].serving is None  # tried, not skipped, until probed
        await wait_for(lambda: router._health["canary"].serving is True, "probed at once")
        await wait_for(lambda: canary.status_calls >= asked + 10, "probed every round again")
        router.__del__()

    asyncio.run(main())


# --------------------------------------------------------------------------- body cap


def test_router_refuses_a_declared_body_over_the_cap_before_reading() -> None:
    async def main() -> None:
        router = RouterClass(FakeCohort("stable"), FakeCohort("canary"))
        router.reconfigure({})

        async def never() -> dict[str, Any]:
            await asyncio.sleep(3600)
            raise AssertionError("the body was read")

        request = http_request("POST", "/v1/rank", {"content-length": str(1 << 30)}, never)
        response = await asyncio.wait_for(router(request), 30)
        payload = json.loads(response.body)
        assert response.status_code == 413, payload
        assert payload["field"] == "body" and payload["limit_bytes"] == MAX_BODY_BYTES
        assert str(MAX_BODY_BYTES) in payload["detail"], payload
        router.__del__()

    asyncio.run(main())


def test_router_stops_reading_a_chunked_body_at_the_cap() -> None:
    async def main() -> None:
        router = RouterClass(FakeCohort("stable"), FakeCohort("canary"))
        router.reconfigure({})
        handed_out = [0]
        request = http_request(
            "POST", "/v1/rank", {"transfer-encoding": "chunked"}, endless_chunks(handed_out)
        )
        response = await asyncio.wait_for(router(request), 30)
        assert response.status_code == 413, response.body
        assert handed_out[0] <= MAX_BODY_BYTES + 64 * 1024, handed_out
        router.__del__()

    asyncio.run(main())
