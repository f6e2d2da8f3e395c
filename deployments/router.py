"""The HTTP ingress: splits traffic between the stable and canary cohorts.

A raw Starlette request handler, not FastAPI: the hop through this deployment is the cost to
keep small (every request pays for it, on cores the replicas need), and FastAPI's routing +
response-model machinery is pure overhead for five fixed paths. Validation happens
once, here (app.api), and the replicas receive compact, validated ``WireRequest``s.

The other half of the cost is the handle call per request. A ``CohortCoalescer``
(``app.coalescing``) per cohort keeps at most ``coalesce_calls_per_replica`` handle calls in
flight per replica of the cohort; requests that arrive meanwhile ride together in the next
call. Idle: a request goes out alone at once (no added latency). Busy: one handle call
carries many requests, and the replica's @serve.batch merges calls further.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from app import telemetry as t
from app.api import CohortView, LoopView, ReplicaView, StatusResponse
from app.body_reads import BodyReads
from app.coalescing import CohortCoalescer
from app.contracts import (
    BASIS_POINTS,
    CANARY,
    COHORTS,
    FALLBACK,
    MAX_DURATION_S,
    MAX_FIELD_PATH,
    STABLE,
    AppArgs,
    Cohort,
    ErrorInfo,
    InstanceReport,
    Role,
    RouterConfig,
    StandbyView,
    WireAnswer,
    WireRequest,
    clip_text,
)
from app.errors import ConfigError, RequestInvalid
from app.model_family import DEFAULT_FAMILIES, ParsedRequest, families_for
from app.routing import (
    CohortHealth,
    can_fail_over_to,
    decide_route,
    parse_forced_cohort,
    request_key,
    says_not_serving,
)
from app.shadow import Comparison, ShadowMirror, is_mirrored
from app.standby import (
    AccuracyVerdict,
    BreakerState,
    PrimaryBreaker,
    StandbyRoute,
    accuracy_verdict,
    primaries_down,
    route_with_standby,
)

log = logging.getLogger("ray.serve")

COHORT_HEADER = "x-ranker-cohort"
JSON = "application/json"
# Requests one router replica accepts at once, for a Router bound without options:
# deployments.app always passes AppArgs.router_max_ongoing_requests, whose default this is.
DEFAULT_MAX_ONGOING_REQUESTS: Final = AppArgs().router_max_ongoing_requests
# A replica's probe answer is kept this many probe intervals before it is dropped from status.
REPLICA_VIEW_TTL_INTERVALS = 30
# A probe loop that died is started again after this long, doubled for every death in a row
# (no probe round completed in between) up to the maximum: a loop that dies on every round
# must neither spin nor flood the log.
PROBE_RESTART_DELAY_S = 0.5
PROBE_RESTART_MAX_DELAY_S = 10.0


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = metrics.Counter(
            t.ROUTER_REQUESTS,
            description="Rank requests by the cohort asked and the outcome of asking it.",
            tag_keys=(t.COHORT, t.OUTCOME),
        )
        self.latency = metrics.Histogram(
            t.ROUTER_LATENCY_MS,
            description="End-to-end latency of rank requests in the router (ms).",
            boundaries=list(t.LATENCY_BOUNDARIES_MS),
            tag_keys=(t.COHORT, t.OUTCOME),
        )
        self.failovers = metrics.Counter(
            t.ROUTER_FAILOVERS,
            description="Requests answered by the other cohort than the one bucketed.",
            tag_keys=(t.FROM_COHORT, t.COHORT),
        )
        self.body_read = metrics.Histogram(
            t.ROUTER_BODY_READ_MS,
            description=(
                "Time to receive a rank request's body (ms), before its cohort is chosen: "
                "the client's upload, which no judge check reads."
            ),
            boundaries=list(t.LATENCY_BOUNDARIES_MS),
        )
        self.rejections = metrics.Counter(
            t.ROUTER_REJECTIONS,
            description="Rank requests refused by the router, by reason.",
            tag_keys=(t.REASON,),
        )
        self.canary_weight = metrics.Gauge(
            t.ROUTER_CANARY_WEIGHT_BP, description="Canary weight in basis points."
        )
        self.in_flight = metrics.Gauge(
            t.ROUTER_IN_FLIGHT,
            description="Rank requests admitted and not yet answered (sampled every <= 1 s).",
        )
        self.batch = metrics.Histogram(
            t.ROUTER_BATCH_SIZE,
            description="Requests per coalesced handle call.",
            boundaries=list(t.BATCH_SIZE_BOUNDARIES),
            tag_keys=(t.COHORT,),
        )


class ShadowMetrics:
    """Shadow traffic: what the comparisons of mirrored copies found (app.shadow)."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            t.ROUTER_SHADOW_REQUESTS,
            description="Copies of stable-answered requests for the canary, by outcome.",
            tag_keys=(t.OUTCOME,),
        )
        self.rbo = metrics.Histogram(
            t.ROUTER_SHADOW_RBO,
            description="Rank-biased overlap of the canary's ranking with stable's, per copy.",
            boundaries=list(t.SHARE_BOUNDARIES),
            tag_keys=(t.ARTIFACT,),
        )
        self.overlap = metrics.Histogram(
            t.ROUTER_SHADOW_OVERLAP,
            description="Share of stable's top k in the canary's top k, per copy.",
            boundaries=list(t.SHARE_BOUNDARIES),
            tag_keys=(t.ARTIFACT,),
        )
        self.score_diff = metrics.Histogram(
            t.ROUTER_SHADOW_SCORE_DIFF,
            description="Largest score difference of one candidate between the two, per copy.",
            boundaries=list(t.SCORE_DIFF_BOUNDARIES),
            tag_keys=(t.ARTIFACT,),
        )
        self.top1_changed = metrics.Counter(
            t.ROUTER_SHADOW_TOP1_CHANGED,
            description="Copies whose first candidate differs from stable's.",
            tag_keys=(t.ARTIFACT,),
        )
        self.in_flight = metrics.Gauge(
            t.ROUTER_SHADOW_IN_FLIGHT, description="Copies sent and not answered yet."
        )
        self.fraction_bp = metrics.Gauge(
            t.ROUTER_SHADOW_FRACTION_BP,
            description="Share of stable-answered requests copied to the canary (bp).",
        )

    def compared(self, comparison: Comparison) -> None:
        tags = {t.ARTIFACT: comparison.canary_artifact}
        d = comparison.divergence
        self.rbo.observe(d.rbo, tags=tags)
        self.overlap.observe(d.overlap, tags=tags)
        self.score_diff.observe(d.max_score_diff, tags=tags)
        if d.top1_changed:
            self.top1_changed.inc(tags=tags)


class StandbyMetrics:
    """The hot standby's gauges: created only by a router with a fallback deployment."""

    def __init__(self) -> None:
        self.breaker_state = metrics.Gauge(
            t.ROUTER_BREAKER_STATE,
            description="A primary cohort's standby breaker: 1 for its state, 0 for the others.",
            tag_keys=(t.COHORT, t.STATE),
        )
        self.serving_from_fallback = metrics.Gauge(
            t.ROUTER_SERVING_FROM_FALLBACK,
            description="1 while no primary cohort takes all traffic and the fallback answers.",
        )
        self.primaries_down = metrics.Gauge(
            t.ROUTER_PRIMARIES_DOWN,
            description="1 while no primary cohort takes all traffic, fallback or not.",
        )
        self.ready = metrics.Gauge(
            t.ROUTER_FALLBACK_READY, description="1 while a fallback replica serves a model."
        )
        self.allowed = metrics.Gauge(
            t.ROUTER_FALLBACK_ALLOWED,
            description="1 while the accuracy guard (or the policy) lets the fallback answer.",
        )
        self.waiting = metrics.Gauge(
            t.ROUTER_FALLBACK_WAITING, description="Requests waiting for a cold fallback."
        )


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload), status_code=status, media_type=JSON, headers=headers)


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
        # The request schema of the family the app serves (torch-free: the router parses
        # requests, it never loads a model); build_app checked the names already.
        self._schema = families_for(models).schema(feature_schema)
        self._handles: dict[str, DeploymentHandle] = {STABLE: stable, CANARY: canary}
        if fallback is not None:
            self._handles[FALLBACK] = fallback
        # The deployments this router calls: the primary cohorts, and the fallback if any.
        self._roles: tuple[Role, ...] = tuple(self._handles)  # type: ignore[arg-type]
        self._rank_handles = {c: h.options(method_name="rank") for c, h in self._handles.items()}
        self._config = RouterConfig()
        self._health = {c: CohortHealth() for c in self._roles}
        # Per cohort: replica id -> (when its probe answered, its report).
        self._views: dict[str, dict[str, tuple[float, InstanceReport]]] = {
            c: {} for c in self._roles
        }
        # Hot standby (an app with a fallback deployment only).
        self._standby = fallback is not None
        started = time.monotonic()
        self._breakers = {c: PrimaryBreaker(c, since=started) for c in COHORTS}
        self._coalescers = {
            c: CohortCoalescer(
                self._sender(c),
                max_calls=self._config.coalesce_calls_per_replica,
                max_batch=self._config.coalesce_max_batch,
            )
            for c in self._roles
        }
        self._served_before = False  # a primary cohort served once (an outage needs that)
        # The offline evaluation each role's serving model reported last (kept while the
        # cohort is down: the guard needs stable's while stable is gone).
        self._evaluations: dict[str, dict[str, float]] = {}
        self._verdict: AccuracyVerdict = accuracy_verdict(self._config.standby, None, None)
        self._fallback_answered = 0
        self._fallback_waiting = 0
        self._down_since: float | None = None
        self._probe_round = asyncio.Event()  # set (and replaced) after every probe round
        self._standby_metrics = StandbyMetrics() if self._standby else None
        self._rng = random.Random()
        self._in_flight = 0
        self._body_reads = BodyReads()
        self._request_counts: dict[tuple[str, str], int] = {}
        self._metrics = RouterMetrics()
        self._shadow_metrics = ShadowMetrics()
        self._shadow_coalescer = CohortCoalescer(
            self._shadow_sender(),
            max_calls=self._config.coalesce_calls_per_replica,
            max_batch=self._config.coalesce_max_batch,
        )
        self._mirror = ShadowMirror(
            self._shadow_coalescer.submit,
            on_compared=self._shadow_metrics.compared,
            # The shadow sender times the handle call out (request_timeout_s from when it
            # goes out); a copy holds its in-flight slot until then.
            timeout_s=None,
        )
        self._probe_task: asyncio.Task[None] | None = None
        self._first_probe = asyncio.Event()
        self._probe_loop_view = LoopView()
        self._probe_died_at: float | None = None
        self._probe_deaths_in_row = 0
        self._closing = False
        self._has_config = False
        self._config_error: ErrorInfo | None = None
        self._probe_due = False  # a probe round is due now, not at the next interval

    # ------------------------------------------------------------------ config

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply a new user_config; a bad one is refused, never raised, once there is a good
        one: a raising reconfigure makes Serve kill this replica, and every router replica
        gets the same config: the whole ingress would go down for a typo. The refusal shows
        in ``/v1/status`` (``config_error``) until a valid config arrives.

        At startup there is no good config to keep: the first one raises (Serve reports the
        replica as failed to start, naming the field)."""
        try:
            config = RouterConfig.from_user_config(user_config)
        except ConfigError as exc:
            if not self._has_config:
                raise
            field = str(exc.ids.get("field") or "user_config")
            log.error("router user_config refused, keeping the current one: %s", exc)
            self._config_error = ErrorInfo(
                category=ConfigError.category,
                message=clip_text(f"user_config refused, the previous one stays: {exc}"),
                field=clip_text(field, MAX_FIELD_PATH),
            )
            return
        was_resting = self._canary_resting()
        self._config = config
        self._has_config = True
        self._config_error = None
        if was_resting and not self._canary_resting():
            # Users or copies for the canary again (the controller gives them only once its
            # replicas report ready): unknown until the probe round due now, so a request
            # tries it (failing over if it still holds no model) instead of skipping it.
            self._health[CANARY].serving = None
            self._probe_due = True
        for cohort in self._roles:
            self._size_coalescer(cohort)
        self._mirror.config = config.shadow
        now = time.monotonic()
        for breaker in self._breakers.values():
            breaker.reconfigure(config.standby, now)
        self._update_verdict()
        self._metrics.canary_weight.set(config.canary_bp)

    def _size_coalescer(self, cohort: str) -> None:
        replicas = max(1, len(self._views[cohort]))
        coalescers = [self._coalescers[cohort]]
        if cohort == CANARY:
            coalescers.append(self._shadow_coalescer)
        for coalescer in coalescers:
            coalescer.max_calls = self._config.coalesce_calls_per_replica * replicas
            coalescer.max_batch = self._config.coalesce_max_batch

    # ------------------------------------------------------------------ cohort calls

    def _sender(self, cohort: str) -> Callable[[list[WireRequest]], Awaitable[WireAnswer]]:
        breaker = self._breakers.get(cohort) if self._standby else None

        async def send(batch: list[WireRequest]) -> WireAnswer:
            self._metrics.batch.observe(len(batch), tags={t.COHORT: cohort})
            sent_in = breaker.epoch if breaker is not None else 0
            response = self._rank_handles[cohort].remote(batch)
            try:
                answer = await asyncio.wait_for(response, self._config.request_timeout_s)
            except BaseException as exc:
                if isinstance(exc, TimeoutError):
                    response.cancel()
                # The standby breaker counts calls, not the requests riding in them. A
                # cohort without a model is not failing (an idle pool).
                if breaker is not None and isinstance(exc, Exception) and not says_not_serving(exc):
                    breaker.record_failure(time.monotonic(), type(exc).__name__, sent_in=sent_in)
                raise
            if breaker is not None:
                breaker.record_success(time.monotonic())
            return answer

        return send

    def _shadow_sender(self) -> Callable[[list[WireRequest]], Awaitable[WireAnswer]]:
        """Copies go to the canary through their own coalescer: they never wait behind, or
        delay, the canary's user traffic in its coalescer, and their failures touch neither
        the cohort's health nor its standby breaker (nobody waits for them)."""

        async def send(batch: list[WireRequest]) -> WireAnswer:
            response = self._rank_handles[CANARY].remote(batch)
            try:
                return await asyncio.wait_for(response, self._config.request_timeout_s)
            except TimeoutError:
                response.cancel()
                raise

        return send

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
        self._probe_died_at = time.monotonic()
        self._probe_loop_view = LoopView(
            restarts=self._probe_loop_view.restarts + 1, last_error=clip_text(why)
        )
        delay = min(
            PROBE_RESTART_MAX_DELAY_S, PROBE_RESTART_DELAY_S * 2.0**self._probe_deaths_in_row
        )
        self._probe_deaths_in_row += 1
        log.error(
            "router probe loop died (%s); restarting it in %.1f s (restart %d)",
            why,
            delay,
            self._probe_loop_view.restarts,
        )
        asyncio.get_running_loop().call_later(delay, self._start_probing)

    def _canary_resting(self) -> bool:
        """With ``probe_idle_canary`` off (a canary pool Serve autoscales to zero between
        rollouts): the pool at weight 0 with no copies mirrored to it, last found holding no
        model or gone, is not probed until it gets weight or copies again. A probe is a
        request: it would start a replica of a pool at zero, and keep an idle one from
        scaling down."""
        health = self._health.get(CANARY)
        return (
            not self._config.probe_idle_canary
            and health is not None
            and health.serving is False
            and self._config.canary_bp == 0
            and self._config.shadow.fraction_bp == 0
        )

    async def _probe_loop(self) -> None:
        next_probe = 0.0
        while True:
            if time.monotonic() >= next_probe or self._probe_due:
                self._probe_due = False
                resting = self._canary_resting()
                if resting:
                    self._views[CANARY].clear()
                    self._size_coalescer(CANARY)
                probed = [c for c in self._roles if not (resting and c == CANARY)]
                await asyncio.gather(*(self._probe(c) for c in probed))
                self._first_probe.set()
                self._probe_deaths_in_row = 0
                next_probe = time.monotonic() + self._config.probe_interval_s
                self._after_probe_round()
            self._flush_counts()
            await asyncio.sleep(min(t.REQUEST_COUNT_FLUSH_S, self._config.probe_interval_s))

    async def _probe(self, cohort: str) -> None:
        """Ask one replica of the cohort for its report (two, to see more replicas)."""
        timeout = max(0.5, min(2.0, 2 * self._config.probe_interval_s))
        now = time.monotonic()
        serving = False
        answered = False
        for _ in range(2):
            try:
                raw = await asyncio.wait_for(self._handles[cohort].status.remote(), timeout=timeout)
            except Exception:
                continue
            try:
                report = InstanceReport.model_validate(raw)
            except ValidationError as exc:
                log.warning("a %s replica's report is not an InstanceReport: %s", cohort, exc)
                continue
            answered = True
            self._views[cohort][report.replica_id] = (now, report)
            serving = serving or report.serving
            if report.serving:
                self._evaluations[cohort] = dict(report.evaluation)
        if cohort == FALLBACK and answered and not serving:
            # Its model is gone (target cleared): the guard must not judge by the old one.
            # A primary's last evaluation is kept: the guard needs stable's while it is down.
            self._evaluations.pop(FALLBACK, None)
        if serving and cohort in self._breakers:
            self._served_before = True
        self._health[cohort].record_probe(serving, answered=answered)
        if cohort == FALLBACK and serving and self._fallback_waiting:
            self._update_verdict()
            self._wake_waiters()
        if cohort in self._breakers:
            self._breakers[cohort].record_probe(
                time.monotonic(), answered=answered, serving=serving
            )
        if not answered:
            self._views[cohort].clear()
        ttl = REPLICA_VIEW_TTL_INTERVALS * self._config.probe_interval_s
        for rid, (seen, _) in list(self._views[cohort].items()):
            if now - seen > ttl:
                del self._views[cohort][rid]
        self._size_coalescer(cohort)

    # ------------------------------------------------------------------ HTTP

    async def __call__(self, request: Request) -> Response:
        self._ensure_probing()
        path = request.url.path.rstrip("/")
        if path.endswith("/v1/rank"):
            if request.method != "POST":
                return _json(405, {"error": "method_not_allowed", "detail": "use POST"})
            return await self._rank(request)
        if request.method != "GET":
            return _json(405, {"error": "method_not_allowed", "detail": "use GET"})
        if path.endswith("/v1/status"):
            return _json(200, self.status().model_dump(mode="json"))
        if path.endswith("/livez"):
            return _json(200, {"live": True})
        if path.endswith("/startupz"):
            started = await self._serving()
            return _json(200 if started else 503, {"started": started})
        if path.endswith("/readyz"):
            started = await self._serving()
            ready = started and not self._config.draining
            why = "draining" if self._config.draining else ("ok" if started else "no_model")
            headers = None if ready else {"Retry-After": str(self._config.retry_after_s)}
            return _json(200 if ready else 503, {"ready": ready, "reason": why}, headers)
        return _json(404, {"error": "not_found", "detail": f"no route {path or '/'}"})

    async def _serving(self) -> bool:
        """A verified model serves in at least one cohort (after at least one probe)."""
        if not self._first_probe.is_set():
            try:
                await asyncio.wait_for(self._first_probe.wait(), timeout=5.0)
            except TimeoutError:
                return False
        if any(self._health[c].serving for c in COHORTS):
            return True
        return self._standby and bool(self._health[FALLBACK].serving) and self._verdict.allowed

    def _reject(self, status: int, reason: str, detail: str, **extra: Any) -> Response:
        self._metrics.rejections.inc(tags={t.REASON: reason})
        headers = None
        if status == 503:
            headers = {"Retry-After": str(self._config.retry_after_s)}
        return _json(status, {"error": reason, "detail": detail, **extra}, headers)

    async def _rank(self, request: Request) -> Response:
        config = self._config
        if config.draining:
            return self._reject(503, "draining", "the router is draining; retry shortly")
        # The body first, under bounds of its own (app.body_reads): a slow upload holds no
        # admission slot, and its time is not the cohort's latency.
        reading = time.perf_counter()
        try:
            raw = await self._body_reads.read(
                request.headers.get("content-length"),
                request.stream(),
                timeout_s=config.body_timeout_s,
                max_reads=config.max_body_reads,
                max_bytes=config.max_body_read_bytes,
            )
            self._metrics.body_read.observe((time.perf_counter() - reading) * 1000.0)
            parsed = self._schema.parse(raw)
            forced = parse_forced_cohort(
                request.headers.get(COHORT_HEADER), allowed=config.allow_cohort_header
            )
        except RequestInvalid as exc:
            response = self._reject(exc.status, exc.category, exc.detail, **exc.extra())
            if exc.field == "body" and exc.status in (408, 413, 503):
                # The rest of the body stays unread: the connection cannot carry another
                # request after this one.
                response.headers["Connection"] = "close"
            return response
        except ValueError as exc:
            return self._reject(422, "invalid_request", str(exc), field=COHORT_HEADER)
        if self._in_flight >= config.max_in_flight:
            return self._reject(503, "overloaded", f"over {config.max_in_flight} requests")
        self._in_flight += 1
        try:
            return await self._rank_admitted(parsed, forced, config)
        finally:
            self._in_flight -= 1

    async def _rank_admitted(
        self, parsed: ParsedRequest, forced: Cohort | None, config: RouterConfig
    ) -> Response:
        # The judged latency (ROUTER_LATENCY_MS, by cohort) starts here: the request read
        # and parsed, its cohort about to be chosen.
        started = time.perf_counter()
        wire = parsed.wire
        key = request_key(parsed.user_id, parsed.session_id)
        decision = decide_route(
            canary_bp=config.canary_bp,
            salt=config.salt,
            key=key,
            forced=forced,
            health=self._health,
            now=time.monotonic(),
            random_bp=lambda: self._rng.randrange(BASIS_POINTS),
            failover=config.failover,
        )
        primaries = (decision.primary,) + (
            (decision.failover_to,) if decision.failover_to is not None else ()
        )
        if self._standby and forced is None:
            route = await self._standby_route(primaries, key)
            if not route.destinations:
                # Meant for a cohort that cannot take it: a failure of that cohort for the
                # judge, as below.
                self._count(decision.bucketed, "diverted")
                return self._refuse_without_fallback(route)
            destinations: tuple[Role, ...] = route.destinations
        else:
            destinations = primaries
        if destinations[0] != decision.bucketed:
            # Meant for a cohort that cannot take it: a failure of that cohort for the judge
            # (its window must not look empty, "inconclusive", while it fails everything).
            self._count(decision.bucketed, "diverted")
        answer = None
        tried: list[str] = []
        for cohort in destinations:
            if tried and not can_fail_over_to(cohort, self._health, time.monotonic()):
                continue  # it stopped serving while the one before was tried
            if tried:
                log.info("failover %s -> %s", tried[-1], cohort)
            tried.append(cohort)
            try:
                answer = await self._coalescers[cohort].submit(wire)
                break
            except Exception as exc:
                self._cohort_failed(cohort, exc, started)
                log.warning("cohort %s could not answer: %s", cohort, exc)
        if answer is None:
            if len(tried) == 1:
                return self._reject(503, "unavailable", f"cohort {tried[0]} could not answer")
            return self._reject(503, "unavailable", "no cohort could answer")
        meta, ranking = answer
        self._health[cohort].record_success()
        if cohort == FALLBACK:
            self._fallback_answered += 1
        failover = cohort != decision.bucketed
        if failover:
            self._metrics.failovers.inc(tags={t.FROM_COHORT: decision.bucketed, t.COHORT: cohort})
        self._observe(cohort, "ok", started)
        payload = {
            "ranking": [{"id": i, "score": s, "label": lb} for i, s, lb in ranking],
            "model": {
                "artifact_id": meta.artifact_id,
                "revision": meta.revision,
                "runtime_build": meta.runtime_build,
                "replica": meta.replica,
                "backbone_artifact_id": meta.backbone,
            },
            "failover": failover,
        }
        headers = {
            "X-Model-Artifact": meta.artifact_id,
            "X-Model-Revision": str(meta.revision),
        }
        if config.reveal_cohort:
            payload["model"]["cohort"] = meta.cohort  # type: ignore[index]
            headers["X-Model-Cohort"] = meta.cohort
        if meta.backbone is not None:
            headers["X-Model-Backbone"] = meta.backbone
        response = _json(200, payload, headers)
        if (
            cohort == STABLE
            and not failover
            and forced is None
            and is_mirrored(
                fraction_bp=config.shadow.fraction_bp,
                salt=config.salt,
                key=key,
                random_bp=lambda: self._rng.randrange(BASIS_POINTS),
            )
        ):
            # After the response is built; the copy runs in its own task (app.shadow).
            self._mirror.offer(wire, meta, ranking)
        return response

    def _cohort_failed(self, cohort: str, exc: BaseException, started: float) -> None:
        self._observe(cohort, "error", started)
        if says_not_serving(exc):
            # No model there (an idle pool, a cleared target): not a failover destination
            # until a probe sees it serving again, whatever the last probe said. Not a
            # failure for the standby breaker either (see _sender): nothing is broken there.
            self._health[cohort].record_not_serving(time.monotonic())
        else:
            self._health[cohort].record_failure(time.monotonic())

    # ------------------------------------------------------------------ hot standby

    def _fallback_ready(self) -> bool:
        return can_fail_over_to(FALLBACK, self._health, time.monotonic())

    def _route_now(self, primaries: tuple[Role, ...], key: str | None) -> StandbyRoute:
        return route_with_standby(
            primaries,  # type: ignore[arg-type]
            self._breakers,
            now=time.monotonic(),
            key=key,
            random_bp=lambda: self._rng.randrange(BASIS_POINTS),
            serving={c: self._health[c].serving for c in COHORTS},
            fallback_ready=self._fallback_ready(),
            verdict=self._verdict,
        )

    async def _standby_route(self, primaries: tuple[Role, ...], key: str | None) -> StandbyRoute:
        """Where the request may go; when only a cold fallback could take it, wait for the
        fallback (or a primary) to serve: at most ``cold_queue_max`` requests at once, each
        at most ``cold_wait_s``, re-checked after every probe round."""
        route = self._route_now(primaries, key)
        if route.destinations or not route.wait_for_fallback:
            return route
        standby = self._config.standby
        if self._fallback_waiting >= standby.cold_queue_max:
            return StandbyRoute((), wait_for_fallback=True, queue_full=True)
        deadline = time.monotonic() + standby.cold_wait_s
        self._fallback_waiting += 1
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._probe_round.wait(), timeout=left)
                except TimeoutError:
                    break
                route = self._route_now(primaries, key)
                if route.destinations or not route.wait_for_fallback:
                    return route
        finally:
            self._fallback_waiting -= 1
        return StandbyRoute((), wait_for_fallback=True)

    def _refuse_without_fallback(self, route: StandbyRoute) -> Response:
        standby = self._config.standby
        if route.queue_full:
            return self._reject(
                503,
                "standby_queue_full",
                f"no primary cohort can answer and {standby.cold_queue_max} requests already "
                f"wait for the fallback (standby.cold_queue_max)",
            )
        if route.wait_for_fallback:
            return self._reject(
                503,
                "fallback_not_ready",
                f"no primary cohort can answer and the fallback is not serving after "
                f"{standby.cold_wait_s:g} s (standby.cold_wait_s)",
            )
        return self._reject(
            503,
            "fallback_refused",
            f"no primary cohort can answer and the fallback may not: {route.refused}",
        )

    def _update_verdict(self) -> None:
        self._verdict = accuracy_verdict(
            self._config.standby, self._evaluations.get(FALLBACK), self._evaluations.get(STABLE)
        )

    def _after_probe_round(self) -> None:
        if self._standby:
            self._update_verdict()
            self._track_down(time.monotonic())
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Requests waiting for a cold fallback re-check their route: after every probe
        round, and as soon as the fallback's own probe finds it serving (a round waits for
        its slowest probe, and a cohort that is gone makes every round slow)."""
        event, self._probe_round = self._probe_round, asyncio.Event()
        event.set()

    def _track_down(self, now: float) -> None:
        """Whether the primaries are down, and since when (logged as it changes). Computed
        whenever it is read, so a view never lags the breakers."""
        serving = {c: self._health[c].serving for c in COHORTS}
        if primaries_down(self._breakers, serving, served_before=self._served_before):
            if self._down_since is None:
                self._down_since = now
                log.warning(
                    "no primary cohort takes all traffic; the fallback: %s", self._verdict.reason
                )
        elif self._down_since is not None:
            log.warning("back on the primary cohorts after %.1f s", now - self._down_since)
            self._down_since = None

    def standby_view(self) -> StandbyView | None:
        if not self._standby:
            return None
        now = time.monotonic()
        self._track_down(now)
        verdict = self._verdict
        since = self._down_since
        ready = self._fallback_ready()
        return StandbyView(
            policy=self._config.standby.policy,
            primaries_down=since is not None,
            down_s=None if since is None else round(min(now - since, MAX_DURATION_S), 3),
            serving_from_fallback=since is not None and ready and verdict.allowed,
            ready=ready,
            allowed=verdict.allowed,
            allowed_reason=clip_text(verdict.reason),
            metric=self._config.standby.accuracy_metric,
            fallback_metric=verdict.fallback_metric,
            stable_metric=verdict.stable_metric,
            answered=self._fallback_answered,
            waiting=self._fallback_waiting,
            breakers=tuple(self._breakers[c].view(now) for c in COHORTS),
        )

    def _export_standby(self) -> None:
        gauges = self._standby_metrics
        if gauges is None:
            return
        now = time.monotonic()
        self._track_down(now)
        for cohort, breaker in self._breakers.items():
            breaker.advance(now)
            for state in BreakerState:
                gauges.breaker_state.set(
                    1.0 if breaker.state is state else 0.0,
                    tags={t.COHORT: cohort, t.STATE: state.value},
                )
        down = self._down_since is not None
        answering = down and self._fallback_ready() and self._verdict.allowed
        gauges.serving_from_fallback.set(1.0 if answering else 0.0)
        gauges.primaries_down.set(1.0 if down else 0.0)
        gauges.ready.set(1.0 if self._fallback_ready() else 0.0)
        gauges.allowed.set(1.0 if self._verdict.allowed else 0.0)
        gauges.waiting.set(self._fallback_waiting)

    def _count(self, cohort: str, outcome: str) -> None:
        key = (cohort, outcome)
        self._request_counts[key] = self._request_counts.get(key, 0) + 1

    def _observe(self, cohort: str, outcome: str, started: float) -> None:
        self._count(cohort, outcome)
        tags = {t.COHORT: cohort, t.OUTCOME: outcome}
        self._metrics.latency.observe((time.perf_counter() - started) * 1000.0, tags=tags)

    def _flush_counts(self) -> None:
        # Request counts are added up locally and flushed with every probe round (<= 1 s):
        # one metric call per request is a measurable part of the hop's cost on 2 cores.
        counts, self._request_counts = self._request_counts, {}
        for (cohort, outcome), n in counts.items():
            self._metrics.requests.inc(n, tags={t.COHORT: cohort, t.OUTCOME: outcome})
        # Gauges set again every round: sampled (in flight, not set per request, for the same
        # reason), and refreshed (Ray's agent drops a gauge value not set again within two
        # export intervals: a weight set once at reconfigure would vanish from the scrape).
        self._metrics.in_flight.set(self._in_flight)
        self._metrics.canary_weight.set(self._config.canary_bp)
        for outcome, n in self._mirror.take_counts().items():
            self._shadow_metrics.requests.inc(n, tags={t.OUTCOME: outcome})
        self._shadow_metrics.in_flight.set(self._mirror.in_flight)
        self._shadow_metrics.fraction_bp.set(self._config.shadow.fraction_bp)
        self._export_standby()

    # ------------------------------------------------------------------ status

    def status(self) -> StatusResponse:
        now = time.monotonic()
        weights = {
            CANARY: self._config.canary_bp,
            STABLE: BASIS_POINTS - self._config.canary_bp,
            FALLBACK: 0,
        }
        cohorts = []
        for cohort in self._roles:
            replicas = []
            for rid, (seen, rep) in sorted(self._views[cohort].items()):
                replicas.append(
                    ReplicaView(
                        replica=rid,
                        cohort=cohort,
                        phase=rep.phase,
                        desired_revision=rep.desired_revision,
                        desired_artifact=rep.desired_artifact,
                        actual_revision=rep.actual_revision,
                        actual_artifact=rep.actual_artifact,
                        last_error=rep.last_error,
                        seen_s_ago=round(now - seen, 3),
                    )
                )
            health = self._health[cohort]
            cohorts.append(
                CohortView(
                    cohort=cohort,
                    weight_bp=weights[cohort],
                    serving=health.serving,
                    breaker_open=health.is_open(now),
                    replicas=replicas,
                )
            )
        probe_loop = self._probe_loop_view
        if self._probe_died_at is not None:
            probe_loop = probe_loop.model_copy(
                update={"last_error_s_ago": round(now - self._probe_died_at, 3)}
            )
        return StatusResponse(
            draining=self._config.draining,
            in_flight=self._in_flight,
            canary_bp=self._config.canary_bp,
            cohorts=cohorts,
            config_error=self._config_error,
            probe_loop=probe_loop,
            standby=self.standby_view(),
            shadow_bp=self._config.shadow.fraction_bp,
            shadow_in_flight=self._mirror.in_flight,
        )

    def __del__(self) -> None:
        self._closing = True  # the loop's cancellation below is ours: no restart
        self._mirror.close()
        if self._probe_task is not None:
            self._probe_task.cancel()
