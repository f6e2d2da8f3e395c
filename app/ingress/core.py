"""The ingress core: what the router does with a rank request, without Ray or Starlette.

``IngressCore`` takes a request's body and headers and gives back an ``HttpAnswer``: it
admits the request (body bounds, the in-flight bound), parses it, decides its cohort (weight
and user bucket, the forcing header, breakers), routes it through the hot standby (waiting a
bounded time for a cold fallback), tries its destinations in order (failover), keeps the
per-cohort breakers and outcome counts, and offers stable-answered requests for mirroring to
the canary. It also runs the status probes' rounds and builds ``/v1/status``.

Replicas are reached only through two injected async callables, the way Ray Serve keeps its
request-router policy apart from the replica transport: ``send(role, batch)`` (one rank call
of a coalesced batch) and ``ask_status(role)`` (one replica's report). The Serve shell
(``deployments/router.py``) builds them on deployment handles; unit tests on fakes. The
clock, the timer and the random source are injected too.

Coalescing (``app.ingress.coalescing``): per cohort at most ``coalesce_calls_per_replica``
calls are in flight per replica; requests that arrive meanwhile ride together in the next call.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from app import telemetry as t
from app.api import CohortView, ReplicaView, StatusResponse
from app.body_reads import BodyReads
from app.contracts import (
    BASIS_POINTS,
    CANARY,
    COHORTS,
    FALLBACK,
    MAX_FIELD_PATH,
    STABLE,
    Cohort,
    ErrorInfo,
    ModelMeta,
    Role,
    RouterConfig,
    StandbyView,
    WireAnswer,
    WireRequest,
    clip_text,
)
from app.errors import ConfigError, RequestInvalid
from app.ingress.answers import BuildAnswer, HttpAnswer, json_answer, rank_answer
from app.ingress.coalescing import Answer, CohortCoalescer
from app.ingress.instruments import RouterInstruments, ShadowInstruments, StandbyInstruments
from app.ingress.probes import (
    REPLICA_VIEW_TTL_INTERVALS,
    ProbeLoopRestarts,
    ReplicaViews,
    probe_cohort,
    probe_timeout_s,
)
from app.ingress.routing import (
    CohortHealth,
    RouteDecision,
    can_fail_over_to,
    decide_route,
    parse_forced_cohort,
    request_key,
    says_not_serving,
)
from app.ingress.shadow import ShadowMirror, is_mirrored
from app.ingress.standby_gate import StandbyGate
from app.model_family import ParsedRequest, RequestSchema

log = logging.getLogger("ray.serve")

COHORT_HEADER: Final = "x-ranker-cohort"
# How long /startupz and /readyz wait for the first probe round before saying "not yet".
FIRST_PROBE_WAIT_S: Final = 5.0

# One rank call of a coalesced batch to a role's replicas (the shell's handle call). The
# core bounds it by ``request_timeout_s``; a send cancelled at the bound cancels its call.
Send = Callable[[Role, list[WireRequest]], Awaitable[WireAnswer]]
# One status call to one of a role's replicas: its InstanceReport as JSON.
AskStatus = Callable[[Role], Awaitable[Any]]


@dataclass(frozen=True)
class Attempt:
    """The failover loop's result: the roles tried in order, and who answered what (None:
    nobody could)."""

    tried: tuple[Role, ...]
    cohort: Role | None = None
    answer: Answer | None = None


class IngressCore:
    def __init__(
        self,
        roles: Sequence[Role],
        schema: RequestSchema,
        *,
        send: Send,
        ask_status: AskStatus,
        instruments: RouterInstruments,
        shadow_instruments: ShadowInstruments,
        standby_instruments: StandbyInstruments | None = None,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        rng: random.Random | None = None,
    ) -> None:
        # The deployments this router calls: the primary cohorts, and the fallback if any.
        self.roles = tuple(roles)
        self.schema = schema
        self._send = send
        self._ask_status = ask_status
        self._clock = clock
        self._timer = timer  # latencies (perf_counter); ``clock`` for breakers and probes
        self._rng = rng or random.Random()
        self.config = RouterConfig()
        self.has_config = False
        self.config_error: ErrorInfo | None = None
        self.metrics = instruments
        self.shadow_metrics = shadow_instruments
        self.standby_metrics = standby_instruments
        self.health = {c: CohortHealth() for c in self.roles}
        self.views = {c: ReplicaViews() for c in self.roles}
        # Hot standby (an app with a fallback deployment only).
        self.standby = StandbyGate(
            self.health, enabled=FALLBACK in self.roles, clock=clock, random_bp=self._random_bp
        )
        self.coalescers = {c: self._coalescer(self._tracked_sender(c)) for c in self.roles}
        # Copies go to the canary through their own coalescer: they never wait behind, or
        # delay, the canary's user traffic in its coalescer, and their failures touch neither
        # the cohort's health nor its standby breaker (nobody waits for them).
        self._copy_coalescer = self._coalescer(self._copy_sender)
        self.mirror = ShadowMirror(
            self._copy_coalescer.submit,
            on_compared=shadow_instruments.compared,
            # The copy sender times the call out (request_timeout_s from when it goes out);
            # a copy holds its in-flight slot until then.
            timeout_s=None,
        )
        self.in_flight = 0
        self.body_reads = BodyReads()
        self._request_counts: dict[tuple[str, str], int] = {}
        self.first_probe = asyncio.Event()
        self.probe_restarts = ProbeLoopRestarts()
        self._probe_due = False  # a probe round is due now, not at the next interval
        self._next_probe = 0.0

    def _random_bp(self) -> int:
        return self._rng.randrange(BASIS_POINTS)

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
            if not self.has_config:
                raise
            field = str(exc.ids.get("field") or "user_config")
            log.error("router user_config refused, keeping the current one: %s", exc)
            self.config_error = ErrorInfo(
                category=ConfigError.category,
                message=clip_text(f"user_config refused, the previous one stays: {exc}"),
                field=clip_text(field, MAX_FIELD_PATH),
            )
            return
        was_resting = self.canary_resting()
        self.config = config
        self.has_config = True
        self.config_error = None
        if was_resting and not self.canary_resting():
            # Users or copies for the canary again (the controller gives them only once its
            # replicas report ready): unknown until the probe round due now, so a request
            # tries it (failing over if it still holds no model) instead of skipping it.
            self.health[CANARY].serving = None
            self._probe_due = True
        for cohort in self.roles:
            self._size_coalescer(cohort)
        self.mirror.config = config.shadow
        self.standby.reconfigure(config.standby, self._clock())
        self.metrics.canary_weight.set(config.canary_bp)

    def canary_resting(self) -> bool:
        """With ``probe_idle_canary`` off (a canary pool Serve autoscales to zero between
        rollouts): the pool at weight 0 with no copies mirrored to it, last found holding no
        model or gone, is not probed until it gets weight or copies again. A probe is a
        request: it would start a replica of a pool at zero, and keep an idle one from
        scaling down."""
        health = self.health.get(CANARY)
        return (
            not self.config.probe_idle_canary
            and health is not None
            and health.serving is False
            and self.config.canary_bp == 0
            and self.config.shadow.fraction_bp == 0
        )

    # ------------------------------------------------------------------ cohort calls

    def _coalescer(
        self, send: Callable[[list[WireRequest]], Awaitable[WireAnswer]]
    ) -> CohortCoalescer:
        return CohortCoalescer(
            send,
            max_calls=self.config.coalesce_calls_per_replica,
            max_batch=self.config.coalesce_max_batch,
        )

    def _size_coalescer(self, cohort: Role) -> None:
        replicas = max(1, len(self.views[cohort]))
        coalescers = [self.coalescers[cohort]]
        if cohort == CANARY:
            coalescers.append(self._copy_coalescer)
        for coalescer in coalescers:
            coalescer.max_calls = self.config.coalesce_calls_per_replica * replicas
            coalescer.max_batch = self.config.coalesce_max_batch

    def _tracked_sender(self, cohort: Role) -> Callable[[list[WireRequest]], Awaitable[WireAnswer]]:
        """A cohort's calls, bounded in time and counted for its standby breaker."""
        breaker = self.standby.breakers.get(cohort) if self.standby.enabled else None

        async def send(batch: list[WireRequest]) -> WireAnswer:
            self.metrics.batch.observe(len(batch), tags={t.COHORT: cohort})
            sent_in = breaker.epoch if breaker is not None else 0
            try:
                answer = await asyncio.wait_for(
                    self._send(cohort, batch), self.config.request_timeout_s
                )
            except BaseException as exc:
                # The standby breaker counts calls, not the requests riding in them. A
                # cohort without a model is not failing (an idle pool).
                if breaker is not None and isinstance(exc, Exception) and not says_not_serving(exc):
                    breaker.record_failure(self._clock(), type(exc).__name__, sent_in=sent_in)
                raise
            if breaker is not None:
                breaker.record_success(self._clock())
            return answer

        return send

    async def _copy_sender(self, batch: list[WireRequest]) -> WireAnswer:
        return await asyncio.wait_for(self._send(CANARY, batch), self.config.request_timeout_s)

    # ------------------------------------------------------------------ a rank request

    async def rank(
        self,
        content_length: str | None,
        chunks: AsyncIterable[bytes],
        cohort_header: str | None = None,
    ) -> HttpAnswer:
        """Admit, parse, route and answer one ``POST /v1/rank``."""
        return await self.serve(
            content_length, chunks, cohort_header, self.schema.parse, rank_answer
        )

    async def serve(
        self,
        content_length: str | None,
        chunks: AsyncIterable[bytes],
        cohort_header: str | None,
        parse: Callable[[bytes], ParsedRequest],
        build: BuildAnswer,
    ) -> HttpAnswer:
        """Admit, parse (``parse``: the body's protocol, ``/v1/rank`` or the Open Inference
        Protocol), route and answer (``build``) one request."""
        config = self.config
        if config.draining:
            return self.reject(503, "draining", "the router is draining; retry shortly")
        # The body first, under bounds of its own (app.body_reads): a slow upload holds no
        # admission slot, and its time is not the cohort's latency.
        reading = self._timer()
        try:
            raw = await self.body_reads.read(
                content_length,
                chunks,
                timeout_s=config.body_timeout_s,
                max_reads=config.max_body_reads,
                max_bytes=config.max_body_read_bytes,
            )
            self.metrics.body_read.observe((self._timer() - reading) * 1000.0)
            parsed = parse(raw)
            forced = parse_forced_cohort(cohort_header, allowed=config.allow_cohort_header)
        except RequestInvalid as exc:
            # A body left unread (too large, too slow, no room to read it): the connection
            # cannot carry another request after this one.
            unread = exc.field == "body" and exc.status in (408, 413, 503)
            return self.reject(
                exc.status, exc.category, exc.detail, close_connection=unread, **exc.extra()
            )
        except ValueError as exc:
            return self.reject(422, "invalid_request", str(exc), field=COHORT_HEADER)
        if self.in_flight >= config.max_in_flight:
            return self.reject(503, "overloaded", f"over {config.max_in_flight} requests")
        self.in_flight += 1
        try:
            return await self._rank_admitted(parsed, forced, config, build)
        finally:
            self.in_flight -= 1

    def decide(self, key: str | None, forced: Cohort | None, config: RouterConfig) -> RouteDecision:
        """The request's cohort by weight and user bucket (or the forcing header), and the
        primary cohort to fail over to, as the cohorts' health stands now."""
        return decide_route(
            canary_bp=config.canary_bp,
            salt=config.salt,
            key=key,
            forced=forced,
            health=self.health,
            now=self._clock(),
            random_bp=self._random_bp,
            failover=config.failover,
        )

    async def _rank_admitted(
        self,
        parsed: ParsedRequest,
        forced: Cohort | None,
        config: RouterConfig,
        build: BuildAnswer,
    ) -> HttpAnswer:
        # The judged latency (ROUTER_LATENCY_MS, by cohort) starts here: the request read
        # and parsed, its cohort about to be chosen.
        started = self._timer()
        key = request_key(parsed.user_id, parsed.session_id)
        decision = self.decide(key, forced, config)
        primaries: tuple[Role, ...] = (decision.primary,) + (
            (decision.failover_to,) if decision.failover_to is not None else ()
        )
        destinations = primaries
        if self.standby.enabled and forced is None:
            route = await self.standby.route(primaries, key)
            if not route.destinations:
                # Meant for a cohort that cannot take it: a failure of that cohort for the
                # judge, as below.
                self.count(decision.bucketed, "diverted")
                return self.reject(503, *self.standby.refusal(route))
            destinations = route.destinations
        if destinations[0] != decision.bucketed:
            # Meant for a cohort that cannot take it: a failure of that cohort for the judge
            # (its window must not look empty, "inconclusive", while it fails everything).
            self.count(decision.bucketed, "diverted")
        attempt = await self.send_in_order(destinations, parsed.wire, started)
        if attempt.cohort is None or attempt.answer is None:
            if len(attempt.tried) == 1:
                detail = f"cohort {attempt.tried[0]} could not answer"
                return self.reject(503, "unavailable", detail)
            return self.reject(503, "unavailable", "no cohort could answer")
        cohort, (meta, ranking) = attempt.cohort, attempt.answer
        self.health[cohort].record_success()
        if cohort == FALLBACK:
            self.standby.answered += 1
        failover = cohort != decision.bucketed
        if failover:
            self.metrics.failovers.inc(tags={t.FROM_COHORT: decision.bucketed, t.COHORT: cohort})
        self._observe(cohort, "ok", started)
        answer = build(meta, ranking, failover, config.reveal_cohort)
        if cohort == STABLE and not failover and forced is None:
            self.offer_copy(parsed.wire, key, meta, ranking, config)
        return answer

    async def send_in_order(
        self, destinations: Sequence[Role], wire: WireRequest, started: float
    ) -> Attempt:
        """Try each destination until one answers. A later one is tried only while it can
        still take a failover (it may have stopped serving while the one before was tried)."""
        tried: list[Role] = []
        for cohort in destinations:
            if tried and not can_fail_over_to(cohort, self.health, self._clock()):
                continue
            if tried:
                log.info("failover %s -> %s", tried[-1], cohort)
            tried.append(cohort)
            try:
                answer = await self.coalescers[cohort].submit(wire)
            except Exception as exc:
                self._cohort_failed(cohort, exc, started)
                log.warning("cohort %s could not answer: %s", cohort, exc)
                continue
            return Attempt(tuple(tried), cohort, answer)
        return Attempt(tuple(tried))

    def _cohort_failed(self, cohort: Role, exc: BaseException, started: float) -> None:
        self._observe(cohort, "error", started)
        if says_not_serving(exc):
            # No model there (an idle pool, a cleared target): not a failover destination
            # until a probe sees it serving again, whatever the last probe said. Not a
            # failure for the standby breaker either (see _tracked_sender): nothing is broken.
            self.health[cohort].record_not_serving(self._clock())
        else:
            self.health[cohort].record_failure(self._clock())

    def offer_copy(
        self,
        wire: WireRequest,
        key: str | None,
        meta: ModelMeta,
        ranking: Sequence[tuple[str, float, str]],
        config: RouterConfig,
    ) -> bool:
        """Mirror a stable-answered request to the canary when its user is sampled; after the
        client's answer is built, and in a task of its own (app.ingress.shadow)."""
        mirrored = is_mirrored(
            fraction_bp=config.shadow.fraction_bp,
            salt=config.salt,
            key=key,
            random_bp=self._random_bp,
        )
        return mirrored and self.mirror.offer(wire, meta, ranking)

    def reject(
        self, status: int, reason: str, detail: str, *, close_connection: bool = False, **extra: Any
    ) -> HttpAnswer:
        self.metrics.rejections.inc(tags={t.REASON: reason})
        headers = None
        if status == 503:
            headers = {"Retry-After": str(self.config.retry_after_s)}
        answer = json_answer(status, {"error": reason, "detail": detail, **extra}, headers)
        if close_connection:
            return HttpAnswer(answer.status, answer.body, answer.headers, close_connection=True)
        return answer

    # ------------------------------------------------------------------ outcome counts

    def count(self, cohort: str, outcome: str) -> None:
        key = (cohort, outcome)
        self._request_counts[key] = self._request_counts.get(key, 0) + 1

    def _observe(self, cohort: str, outcome: str, started: float) -> None:
        self.count(cohort, outcome)
        tags = {t.COHORT: cohort, t.OUTCOME: outcome}
        self.metrics.latency.observe((self._timer() - started) * 1000.0, tags=tags)

    def take_counts(self) -> dict[tuple[str, str], int]:
        """(cohort, outcome) -> requests since the last call."""
        counts, self._request_counts = self._request_counts, {}
        return counts

    def flush_counts(self) -> None:
        # Request counts are added up locally and flushed with every probe turn (<= 1 s):
        # one metric call per request is a measurable part of the hop's cost on 2 cores.
        for (cohort, outcome), n in self.take_counts().items():
            self.metrics.requests.inc(n, tags={t.COHORT: cohort, t.OUTCOME: outcome})
        # Gauges set again every turn: sampled (in flight, not set per request, for the same
        # reason), and refreshed (Ray's agent drops a gauge value not set again within two
        # export intervals: a weight set once at reconfigure would vanish from the scrape).
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.canary_weight.set(self.config.canary_bp)
        for outcome, n in self.mirror.take_counts().items():
            self.shadow_metrics.requests.inc(n, tags={t.OUTCOME: outcome})
        self.shadow_metrics.in_flight.set(self.mirror.in_flight)
        self.shadow_metrics.fraction_bp.set(self.config.shadow.fraction_bp)
        if self.standby_metrics is not None:
            self.standby.export(self.standby_metrics)

    # ------------------------------------------------------------------ probes

    def probe_now(self) -> None:
        """The next probe turn runs a round at once (a probe loop just started)."""
        self._probe_due = True

    async def probe_turn(self) -> float:
        """One turn of the probe loop: a probe round of every role when one is due, then the
        counts flushed; returns the seconds to sleep before the next turn. The counts are
        also flushed every ``REQUEST_COUNT_FLUSH_S`` while a round runs: a probe of a silent
        replica waits out its timeout (up to 2 s), and the controller's first window after a
        weight change waits only the flush interval for the counts of the old weights."""
        if self._clock() >= self._next_probe or self._probe_due:
            self._probe_due = False
            probe_round = asyncio.ensure_future(self._probe_round())
            try:
                while not probe_round.done():
                    await asyncio.wait({probe_round}, timeout=t.REQUEST_COUNT_FLUSH_S)
                    if not probe_round.done():
                        self.flush_counts()
            except asyncio.CancelledError:
                probe_round.cancel()
                raise
            probe_round.result()  # a round that raised ends the turn (the loop restarts)
        self.flush_counts()
        return min(t.REQUEST_COUNT_FLUSH_S, self.config.probe_interval_s)

    async def _probe_round(self) -> None:
        """Probe every role once (the canary not while it rests) and record the findings."""
        resting = self.canary_resting()
        if resting:
            self.views[CANARY].clear()
            self._size_coalescer(CANARY)
        probed = [c for c in self.roles if not (resting and c == CANARY)]
        await asyncio.gather(*(self.probe(c) for c in probed))
        self.first_probe.set()
        self.probe_restarts.round_completed()
        self._next_probe = self._clock() + self.config.probe_interval_s
        self.standby.after_probe_round(self._clock())

    async def probe(self, cohort: Role) -> None:
        """Probe one role and record what was found: health, breaker, replica views."""
        interval = self.config.probe_interval_s
        now = self._clock()
        finding = await probe_cohort(
            cohort, lambda: self._ask_status(cohort), timeout_s=probe_timeout_s(interval)
        )
        self.health[cohort].record_probe(finding.serving, answered=finding.answered)
        self.standby.record_probe(cohort, finding, self._clock())
        ttl = REPLICA_VIEW_TTL_INTERVALS * self.config.probe_interval_s
        self.views[cohort].record(finding, now, ttl)
        self._size_coalescer(cohort)

    # ------------------------------------------------------------------ readiness, status

    async def serving(self) -> bool:
        """A verified model serves in at least one cohort (after at least one probe)."""
        if not self.first_probe.is_set():
            try:
                await asyncio.wait_for(self.first_probe.wait(), timeout=FIRST_PROBE_WAIT_S)
            except TimeoutError:
                return False
        if any(self.health[c].serving for c in COHORTS):
            return True
        return (
            self.standby.enabled
            and bool(self.health[FALLBACK].serving)
            and self.standby.verdict.allowed
        )

    async def startup(self) -> HttpAnswer:
        started = await self.serving()
        return json_answer(200 if started else 503, {"started": started})

    async def readiness(self) -> HttpAnswer:
        started = await self.serving()
        draining = self.config.draining
        ready = started and not draining
        why = "draining" if draining else ("ok" if started else "no_model")
        headers = None if ready else {"Retry-After": str(self.config.retry_after_s)}
        return json_answer(200 if ready else 503, {"ready": ready, "reason": why}, headers)

    def standby_view(self) -> StandbyView | None:
        return self.standby.view()

    def status(self) -> StatusResponse:
        now = self._clock()
        canary_bp = self.config.canary_bp
        weights = {CANARY: canary_bp, STABLE: BASIS_POINTS - canary_bp, FALLBACK: 0}
        cohorts = []
        for cohort in self.roles:
            replicas = [
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
                for rid, (seen, rep) in self.views[cohort].items()
            ]
            health = self.health[cohort]
            cohorts.append(
                CohortView(
                    cohort=cohort,
                    weight_bp=weights[cohort],
                    serving=health.serving,
                    breaker_open=health.is_open(now),
                    replicas=replicas,
                )
            )
        return StatusResponse(
            draining=self.config.draining,
            in_flight=self.in_flight,
            canary_bp=canary_bp,
            cohorts=cohorts,
            config_error=self.config_error,
            probe_loop=self.probe_restarts.status(now),
            standby=self.standby_view(),
            shadow_bp=self.config.shadow.fraction_bp,
            shadow_in_flight=self.mirror.in_flight,
        )

    def close(self) -> None:
        self.mirror.close()
