"""The ranker replica as a Ray Serve deployment: a thin shell around app.replica.

One class, bound twice by deployments.app as ``stable`` and ``canary``; they differ only in the
``user_config`` they are given. The router calls ``rank`` with lists of already validated
requests; ``__call__`` lets the deployment serve HTTP directly too (the benchmark's baseline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Final

import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from app import telemetry as t
from app.api import RankResponse, read_body
from app.contracts import (
    BatchingConfig,
    CohortArgs,
    ControllerRef,
    InstanceReport,
    ReplicaConfig,
    WireAnswer,
    WireRequest,
)
from app.errors import InjectedFault, RequestInvalid
from app.replica import RankerReplica
from app.tasks.rank import RANK_ROUTE
from deployments.metrics import serve_metric

log = logging.getLogger("ray.serve")

# Handle calls one replica accepts at once, for a Ranker bound without options:
# deployments.app always passes CohortArgs.max_ongoing_requests, whose default this is. It is
# not tied to the batch size: every call from the router already carries a coalesced batch of
# requests, and @serve.batch merges at most batching.max_batch_size calls into one forward.
DEFAULT_MAX_ONGOING_REQUESTS: Final = CohortArgs().max_ongoing_requests
# @serve.batch starts from BatchingConfig's defaults; the live values come from user_config
# (reconfigure), within BatchingConfig's bounds.
_BATCHING: Final = BatchingConfig()
# Ray's metrics agent drops a gauge's value that was not set again within two export intervals
# (Ray 2.60, OpenTelemetry path): a revision set once, at install, would vanish from the
# scrape seconds later. The observer sets its gauges again this often.
GAUGE_REFRESH_S: Final = 1.0


class ControllerSink:
    """Sends reports to the rollout controller's named actor (fire and forget)."""

    def __init__(self, ref: ControllerRef) -> None:
        import ray

        self._actor = ray.get_actor(ref.name, namespace=ref.namespace)
        self._last: Any = None

    def send(self, report: InstanceReport) -> None:
        import ray

        # Fire and forget, but not into the void: a handle to a controller that was killed
        # and created anew (same name, new actor) fails every call. The previous call's
        # outcome tells; raising makes the reporter look the name up again.
        if self._last is not None:
            done, _ = ray.wait([self._last], timeout=0)
            if done:
                ray.get(done[0])  # raises RayActorError for a dead controller
        self._last = self._actor.report_instance.remote(report.model_dump(mode="json"))


class ServeMetricsObserver:
    """app.replica's metric hooks on ray.serve.metrics (tags: application, deployment,
    replica added by Ray; cohort added here). Gauges are set again every GAUGE_REFRESH_S by
    a daemon thread, so that they stay in the scrape while nothing changes."""

    def __init__(self) -> None:
        self._cohort = "unknown"
        self._last_revisions: tuple[int, int] | None = None
        self._closed = threading.Event()
        # Names, descriptions, labels and buckets: app.telemetry's table.
        self._stage = serve_metric(t.REPLICA_LOAD_STAGE_S)
        self._desired = serve_metric(t.REPLICA_DESIRED_REVISION)
        self._actual = serve_metric(t.REPLICA_ACTUAL_REVISION)
        self._failures = serve_metric(t.REPLICA_LOAD_FAILURES)
        self._batch = serve_metric(t.REPLICA_BATCH_SIZE)

    def set_cohort(self, cohort: str) -> None:
        self._cohort = cohort

    def load_stage(self, stage: str, seconds: float, ok: bool) -> None:
        tags = {t.COHORT: self._cohort, t.STAGE: stage, t.RESULT: "ok" if ok else "error"}
        self._stage.observe(seconds, tags=tags)

    def revisions(self, desired: int | None, actual: int | None) -> None:
        self._last_revisions = (desired or 0, actual or 0)
        self._set_revisions()

    def _set_revisions(self) -> None:
        last = self._last_revisions
        if last is not None:
            self._desired.set(last[0], tags={t.COHORT: self._cohort})
            self._actual.set(last[1], tags={t.COHORT: self._cohort})

    def start_refreshing(self) -> None:
        threading.Thread(target=self._refresh, name="gauge-refresh", daemon=True).start()

    def _refresh(self) -> None:
        while not self._closed.wait(GAUGE_REFRESH_S):
            try:
                self._set_revisions()
            except Exception:  # a metrics hiccup must not end the refreshing for good
                log.exception("setting the revision gauges failed; trying again")

    def close(self) -> None:
        self._closed.set()

    def load_failure(self, category: str) -> None:
        self._failures.inc(tags={t.COHORT: self._cohort, t.REASON: category})

    def batch_size(self, requests: int) -> None:
        self._batch.observe(requests, tags={t.COHORT: self._cohort})


@serve.deployment(max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS)
class Ranker:
    def __init__(self) -> None:
        # Two cores are shared by the proxy, the router and every replica: one intra-op
        # thread per replica avoids oversubscription (batching gives the parallelism).
        if not torch.cuda.is_available():
            torch.set_num_threads(1)

        replica_id = serve.get_replica_context().replica_id.unique_id
        self._observer = ServeMetricsObserver()
        self._core = RankerReplica(replica_id, sink_factory=ControllerSink, observer=self._observer)
        self._observer.start_refreshing()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        # Keep this instant after startup: Ray sends the replica no traffic while it runs.
        # After startup the core never raises (a raising reconfigure kills the replica and
        # its replacements): a bad config is refused and reported, the old one stays.
        if not self._core.has_config:
            # Startup: label the first load's metrics; an invalid first config raises here.
            self._observer.set_cohort(ReplicaConfig.from_user_config(user_config).cohort)
        if self._core.reconfigure(user_config):
            config = self._core.config
            self._forward.set_max_batch_size(config.batching.max_batch_size)
            self._forward.set_batch_wait_timeout_s(config.batching.batch_wait_timeout_s)

    @serve.batch(
        max_batch_size=_BATCHING.max_batch_size,
        batch_wait_timeout_s=_BATCHING.batch_wait_timeout_s,
    )
    async def _forward(self, calls: list[list[WireRequest]]) -> list[WireAnswer]:
        """Concurrent handle calls (each already a batch from the router) share a forward."""
        flat = [request for call in calls for request in call]
        answer = self._core.rank(flat)
        out: list[WireAnswer] = []
        start = 0
        for call in calls:
            out.append(WireAnswer(answer.model, answer.rankings[start : start + len(call)]))
            start += len(call)
        return out

    async def rank(self, batch: list[WireRequest]) -> WireAnswer:
        await self._inject_faults()
        return await self._forward(batch)

    async def _inject_faults(self) -> None:
        """Test-only faults (user_config ``faults``, honoured only where allowed): the delay
        awaits, so it holds back this call's answer and nothing else."""
        plan = self._core.plan_fault()
        if plan.delay_s > 0:
            await asyncio.sleep(plan.delay_s)
        if plan.fail:
            raise self._core.injected_fault()

    async def status(self) -> dict[str, Any]:
        """The instance report, JSON-ready (the router's probes validate it again)."""
        return self._core.report().model_dump(mode="json")

    async def __call__(self, request: Request) -> Response:
        """Direct HTTP ingress (benchmark baseline): same parsing as the router. It answers
        the rank task's route with the rank answer (the route is checked before the core is
        reached: a body over the cap is refused unread, even before the first config)."""
        if request.method != "POST" or not request.url.path.endswith(RANK_ROUTE):
            return Response(b'{"error":"not_found"}', status_code=404)
        try:
            raw = await read_body(request.headers.get("content-length"), request.stream())
            parsed = self._core.schema.parse(raw)
        except RequestInvalid as exc:
            # A body over the cap (413) is left unread: the connection is not reusable.
            headers = {"Connection": "close"} if exc.status == 413 else None
            return Response(
                json.dumps(exc.payload()),
                status_code=exc.status,
                media_type="application/json",
                headers=headers,
            )
        try:
            await self._inject_faults()
        except InjectedFault as exc:
            payload = {"error": exc.category, "detail": str(exc)}
            return Response(json.dumps(payload), status_code=503, media_type="application/json")
        answer = await self._forward([parsed.wire])
        # The router's answer, built by the same model (app.api.RankResponse): one replica
        # answers here, so its cohort is shown and nothing failed over.
        text, _ = RankResponse.encode(
            answer.model, answer.rankings[0], failover=False, reveal_cohort=True
        )
        return Response(text, media_type="application/json")

    def check_health(self) -> None:
        self._core.check_health()

    def __del__(self) -> None:
        observer = getattr(self, "_observer", None)
        if observer is not None:
            observer.close()
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()
