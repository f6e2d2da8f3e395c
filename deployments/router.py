"""The HTTP ingress as a Ray Serve deployment: a thin shell around ``app.ingress.IngressCore``.

Everything the router decides (admission, the cohort, failover, breakers, the hot standby,
mirroring, the status views) is the core's, without Ray or Starlette. This shell holds what
only a Serve replica has: the deployment handles and the send callables built on them, the
probe task on the replica's event loop, the Starlette request -> core -> response dispatch,
and the Ray metrics the core records into (``deployments.metrics``, from the table in
``app.telemetry``).

A raw Starlette request handler, not FastAPI: the hop through this deployment is the cost to
keep small (every request pays for it, on cores the replicas need), and FastAPI's routing +
response-model machinery is pure overhead for a handful of fixed paths: the family's task route
(``/v1/rank``), ``/v1/status``, the probes, and the Open Inference Protocol's ``/v2/...``
(``app.ingress.oip_endpoint``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from app.api import StatusResponse
from app.contracts import CANARY, FALLBACK, STABLE, AppArgs, Role, StandbyView, WireRequest
from app.ingress.answers import HttpAnswer, json_answer
from app.ingress.core import COHORT_HEADER, IngressCore
from app.ingress.instruments import RouterInstruments, ShadowInstruments, StandbyInstruments
from app.ingress.oip_endpoint import OipEndpoint, protocol_path
from app.model_family import DEFAULT_FAMILIES, families_for
from deployments.metrics import ray_metric

log = logging.getLogger("ray.serve")

__all__ = ["COHORT_HEADER", "DEFAULT_MAX_ONGOING_REQUESTS", "Router"]

# Requests one router replica accepts at once, for a Router bound without options:
# deployments.app always passes AppArgs.router_max_ongoing_requests, whose default this is.
DEFAULT_MAX_ONGOING_REQUESTS: Final = AppArgs().router_max_ongoing_requests


def _response(answer: HttpAnswer) -> Response:
    response = Response(
        answer.body, status_code=answer.status, media_type=answer.media_type, headers=answer.headers
    )
    if answer.close_connection:
        response.headers["Connection"] = "close"
    return response


@serve.deployment(max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS)
class Router:
    def __init__(
        self,
        stable: DeploymentHandle,
        canary: DeploymentHandle,
        fallback: DeploymentHandle | None = None,
        *,
        models: Sequence[str] = DEFAULT_FAMILIES,
        feature_schema: str | None = None,
    ) -> None:
        self._handles: dict[Role, DeploymentHandle] = {STABLE: stable, CANARY: canary}
        if fallback is not None:
            self._handles[FALLBACK] = fallback
        self._rank_handles = {c: h.options(method_name="rank") for c, h in self._handles.items()}
        standby = StandbyInstruments.build(ray_metric) if fallback is not None else None
        # The family the app serves (torch-free: the router parses requests, it never loads
        # a model; build_app checked the names already): its request schema, and its task's
        # route.
        family = families_for(models).serving(feature_schema)
        self._route = family.task.route
        self._core = IngressCore(
            tuple(self._handles),
            family.schema,
            send=self._send,
            ask_status=self._ask_status,
            instruments=RouterInstruments.build(ray_metric),
            shadow_instruments=ShadowInstruments.build(ray_metric),
            standby_instruments=standby,
        )
        # The Open Inference Protocol (/v2/...) for KServe and Triton clients, on the same core.
        self._oip = OipEndpoint(self._core, family.name)
        # The core's state under the names the in-process tests read (the same objects).
        self._health = self._core.health
        self._metrics = self._core.metrics
        self._body_reads = self._core.body_reads
        self._probe_task: asyncio.Task[None] | None = None
        self._closing = False

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """See ``IngressCore.reconfigure``: a bad config after a good one is refused and
        shown, never raised (a raising reconfigure makes Serve kill the replica)."""
        self._core.reconfigure(user_config)

    # ------------------------------------------------------------------ the transport

    async def _send(self, role: Role, batch: list[WireRequest]) -> Any:
        """One rank call to the role's replicas. The core bounds it in time; a call it
        cancels at the bound is cancelled in Serve too."""
        response = self._rank_handles[role].remote(batch)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise

    async def _ask_status(self, role: Role) -> Any:
        return await self._handles[role].status.remote()

    # ------------------------------------------------------------------ the probe task

    def _ensure_probing(self) -> None:
        """Start the probe loop (on the first request: the replica's event loop is only
        reachable from a request). Once started it restarts itself when it dies."""
        if self._probe_task is None or self._probe_task.done():
            self._start_probing()

    def _start_probing(self) -> None:
        if self._closing or (self._probe_task is not None and not self._probe_task.done()):
            return
        self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())
        self._probe_task.add_done_callback(self._probe_loop_ended)

    async def _probe_loop(self) -> None:
        self._core.probe_now()  # a loop (re)started probes at once
        while True:
            await asyncio.sleep(await self._core.probe_turn())

    def _probe_loop_ended(self, task: asyncio.Task[None]) -> None:
        """The probe loop never returns: an end is a death (an exception, or a cancellation
        not ours, e.g. a cancelled handle call surfacing as CancelledError). Without probes
        the router routes on stale health and sizes coalescing on stale replica counts, so
        the death is logged, shown in status and the loop started again."""
        if self._closing:
            return
        if task.cancelled():
            why = "CancelledError: the probe loop was cancelled"
        else:
            exc = task.exception()
            why = f"{type(exc).__name__}: {exc}"
        restarts = self._core.probe_restarts
        delay = restarts.died(why, time.monotonic())
        log.error(
            "router probe loop died (%s); restarting it in %.1f s (restart %d)",
            why,
            delay,
            restarts.view.restarts,
        )
        asyncio.get_running_loop().call_later(delay, self._start_probing)

    # ------------------------------------------------------------------ HTTP

    async def __call__(self, request: Request) -> Response:
        self._ensure_probing()
        path = request.url.path.rstrip("/")
        if path.endswith(self._route):
            if request.method != "POST":
                return _response(
                    json_answer(405, {"error": "method_not_allowed", "detail": "use POST"})
                )
            headers = request.headers
            answer = await self._core.rank(
                headers.get("content-length"), request.stream(), headers.get(COHORT_HEADER)
            )
            return _response(answer)
        below_v2 = protocol_path(path)
        if below_v2 is not None:
            oip = await self._oip.handle(
                request.method, below_v2, request.headers.get, request.stream()
            )
            return _response(oip)
        if request.method != "GET":
            return _response(json_answer(405, {"error": "method_not_allowed", "detail": "use GET"}))
        if path.endswith("/v1/status"):
            return _response(json_answer(200, self.status().model_dump(mode="json")))
        if path.endswith("/livez"):
            return _response(json_answer(200, {"live": True}))
        if path.endswith("/startupz"):
            return _response(await self._core.startup())
        if path.endswith("/readyz"):
            return _response(await self._core.readiness())
        return _response(
            json_answer(404, {"error": "not_found", "detail": f"no route {path or '/'}"})
        )

    # ------------------------------------------------------------------ views

    def status(self) -> StatusResponse:
        return self._core.status()

    def standby_view(self) -> StandbyView | None:
        return self._core.standby_view()

    def __del__(self) -> None:
        self._closing = True  # the loop's cancellation below is ours: no restart
        core = getattr(self, "_core", None)  # None: __init__ failed before making it
        if core is not None:
            core.close()
        task = getattr(self, "_probe_task", None)
        if task is not None:
            task.cancel()
