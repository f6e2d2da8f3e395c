"""The hot standby as one router replica runs it: breakers, the accuracy guard, the cold wait.

``app.ingress.standby`` holds the pure rules (a breaker's transitions, the guard's verdict,
where a request may go); ``StandbyGate`` holds their state over time and applies them for
the router: it feeds the breakers what the probes see, decides a request's destinations and,
when only a cold fallback could take it, holds the request a bounded time for the fallback to
come up. Asyncio only (the wait); no Ray, and the clock and randomness are injected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from app import telemetry as t
from app.contracts import (
    COHORTS,
    FALLBACK,
    MAX_DURATION_S,
    STABLE,
    Role,
    StandbyConfig,
    StandbyView,
    clip_text,
)
from app.ingress.instruments import StandbyInstruments
from app.ingress.probes import ProbeFinding
from app.ingress.routing import CohortHealth, can_fail_over_to
from app.ingress.standby import (
    AccuracyVerdict,
    BreakerState,
    PrimaryBreaker,
    StandbyRoute,
    accuracy_verdict,
    primaries_down,
    route_with_standby,
)

log = logging.getLogger("ray.serve")


class StandbyGate:
    """One router's standby state. ``enabled``: the app has a fallback deployment; without
    one the breakers and evaluations are still kept (a config may name a guard before a
    fallback exists) but no request is routed or held by them."""

    def __init__(
        self,
        health: Mapping[str, CohortHealth],
        *,
        enabled: bool,
        clock: Callable[[], float],
        random_bp: Callable[[], int],
    ) -> None:
        self.enabled = enabled
        self.config = StandbyConfig()
        self._health = health
        self._clock = clock
        self._random_bp = random_bp
        self.breakers = {c: PrimaryBreaker(c, since=clock()) for c in COHORTS}
        # The offline evaluation each role's serving model reported last (kept while the
        # cohort is down: the guard needs stable's while stable is gone).
        self.evaluations: dict[str, dict[str, float]] = {}
        self.verdict: AccuracyVerdict = accuracy_verdict(self.config, None, None)
        self.served_before = False  # a primary cohort served once (an outage needs that)
        self.answered = 0  # requests the fallback answered
        self.waiting = 0  # requests waiting for a cold fallback now
        self.down_since: float | None = None
        self._probe_round = asyncio.Event()  # set (and replaced) after every probe round

    # ------------------------------------------------------------------ evidence

    def reconfigure(self, config: StandbyConfig, now: float) -> None:
        self.config = config
        for breaker in self.breakers.values():
            breaker.reconfigure(config, now)
        self.update_verdict()

    def record_probe(self, cohort: Role, finding: ProbeFinding, now: float) -> None:
        """A probe of ``cohort``: its model's evaluation, its breaker, and a wake-up for the
        requests waiting when it is the fallback coming up."""
        evaluation = finding.evaluation
        if evaluation is not None:
            self.evaluations[cohort] = evaluation
        elif cohort == FALLBACK and finding.answered:
            # Its model is gone (target cleared): the guard must not judge by the old one.
            # A primary's last evaluation is kept: the guard needs stable's while it is down.
            self.evaluations.pop(FALLBACK, None)
        if finding.serving and cohort in self.breakers:
            self.served_before = True
        if cohort == FALLBACK and finding.serving and self.waiting:
            self.update_verdict()
            self.wake_waiters()
        if cohort in self.breakers:
            self.breakers[cohort].record_probe(
                now, answered=finding.answered, serving=finding.serving
            )

    def after_probe_round(self, now: float) -> None:
        if self.enabled:
            self.update_verdict()
            self.track_down(now)
        self.wake_waiters()

    def update_verdict(self) -> None:
        self.verdict = accuracy_verdict(
            self.config, self.evaluations.get(FALLBACK), self.evaluations.get(STABLE)
        )

    def wake_waiters(self) -> None:
        """Requests waiting for a cold fallback re-check their route: after every probe
        round, and as soon as the fallback's own probe finds it serving (a round waits for
        its slowest probe, and a cohort that is gone makes every round slow)."""
        event, self._probe_round = self._probe_round, asyncio.Event()
        event.set()

    # ------------------------------------------------------------------ routing

    def fallback_ready(self) -> bool:
        return can_fail_over_to(FALLBACK, self._health, self._clock())

    def route_now(self, primaries: Sequence[Role], key: str | None) -> StandbyRoute:
        return route_with_standby(
            primaries,  # type: ignore[arg-type]
            self.breakers,
            now=self._clock(),
            key=key,
            random_bp=self._random_bp,
            serving={c: self._health[c].serving for c in COHORTS},
            fallback_ready=self.fallback_ready(),
            verdict=self.verdict,
        )

    async def route(self, primaries: Sequence[Role], key: str | None) -> StandbyRoute:
        """Where the request may go; when only a cold fallback could take it, wait for the
        fallback (or a primary) to serve: at most ``cold_queue_max`` requests at once, each
        at most ``cold_wait_s``, re-checked after every probe round."""
        route = self.route_now(primaries, key)
        if route.destinations or not route.wait_for_fallback:
            return route
        if self.waiting >= self.config.cold_queue_max:
            return StandbyRoute((), wait_for_fallback=True, queue_full=True)
        deadline = self._clock() + self.config.cold_wait_s
        self.waiting += 1
        try:
            while (left := deadline - self._clock()) > 0:
                try:
                    await asyncio.wait_for(self._probe_round.wait(), timeout=left)
                except TimeoutError:
                    break
                route = self.route_now(primaries, key)
                if route.destinations or not route.wait_for_fallback:
                    return route
        finally:
            self.waiting -= 1
        return StandbyRoute((), wait_for_fallback=True)

    def refusal(self, route: StandbyRoute) -> tuple[str, str]:
        """(reason, detail) of the 503 for a request no destination may take."""
        standby = self.config
        if route.queue_full:
            return (
                "standby_queue_full",
                f"no primary cohort can answer and {standby.cold_queue_max} requests already "
                f"wait for the fallback (standby.cold_queue_max)",
            )
        if route.wait_for_fallback:
            return (
                "fallback_not_ready",
                f"no primary cohort can answer and the fallback is not serving after "
                f"{standby.cold_wait_s:g} s (standby.cold_wait_s)",
            )
        return (
            "fallback_refused",
            f"no primary cohort can answer and the fallback may not: {route.refused}",
        )

    # ------------------------------------------------------------------ views

    def track_down(self, now: float) -> None:
        """Whether the primaries are down, and since when (logged as it changes). Computed
        whenever it is read, so a view never lags the breakers."""
        serving = {c: self._health[c].serving for c in COHORTS}
        if primaries_down(self.breakers, serving, served_before=self.served_before):
            if self.down_since is None:
                self.down_since = now
                log.warning(
                    "no primary cohort takes all traffic; the fallback: %s", self.verdict.reason
                )
        elif self.down_since is not None:
            log.warning("back on the primary cohorts after %.1f s", now - self.down_since)
            self.down_since = None

    def view(self) -> StandbyView | None:
        if not self.enabled:
            return None
        now = self._clock()
        self.track_down(now)
        verdict = self.verdict
        since = self.down_since
        ready = self.fallback_ready()
        return StandbyView(
            policy=self.config.policy,
            primaries_down=since is not None,
            down_s=None if since is None else round(min(now - since, MAX_DURATION_S), 3),
            serving_from_fallback=since is not None and ready and verdict.allowed,
            ready=ready,
            allowed=verdict.allowed,
            allowed_reason=clip_text(verdict.reason),
            metric=self.config.accuracy_metric,
            fallback_metric=verdict.fallback_metric,
            stable_metric=verdict.stable_metric,
            answered=self.answered,
            waiting=self.waiting,
            breakers=tuple(self.breakers[c].view(now) for c in COHORTS),
        )

    def export(self, gauges: StandbyInstruments) -> None:
        """Set every standby gauge (each probe turn: Ray drops a gauge not set again)."""
        now = self._clock()
        self.track_down(now)
        for cohort, breaker in self.breakers.items():
            breaker.advance(now)
            for state in BreakerState:
                gauges.breaker_state.set(
                    1.0 if breaker.state is state else 0.0,
                    tags={t.COHORT: cohort, t.STATE: state.value},
                )
        down = self.down_since is not None
        answering = down and self.fallback_ready() and self.verdict.allowed
        gauges.serving_from_fallback.set(1.0 if answering else 0.0)
        gauges.primaries_down.set(1.0 if down else 0.0)
        gauges.ready.set(1.0 if self.fallback_ready() else 0.0)
        gauges.allowed.set(1.0 if self.verdict.allowed else 0.0)
        gauges.waiting.set(self.waiting)
