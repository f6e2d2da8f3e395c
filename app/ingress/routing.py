"""Pure routing decisions of the router: which cohort answers a request.

No Ray, no clock of its own, no I/O: the router passes in the weights, the request's key, a
random source and ``now``, and gets a decision back.

Weights are in basis points (1/100 of a percent): ``canary_bp`` of 10 000 go to the canary,
the rest to stable. A request with a key (user id, else session id) is bucketed
deterministically, ``bucket(salt, key) < canary_bp``, so raising the weight only ever moves
users from stable to canary (a user who reached the canary at 5% stays there at 25%). A request
without a key is split at random with the same probability.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from app.contracts import BASIS_POINTS, CANARY, COHORTS, STABLE, Cohort

# Status probe rounds in a row that no replica of a cohort answered before the router takes it
# for gone (not serving): one round that times out is as likely a loaded machine as a dead
# cohort, and a cohort taken for gone is no failover destination.
UNANSWERED_PROBES_GONE: Final = 2

# The category of the error a replica raises when it has no model to serve (an idle pool or
# a cleared target): app.errors.ReplicaNotReady and app.errors.NotReady.
NOT_SERVING_CATEGORY: Final = "serving.not_ready"


def says_not_serving(exc: BaseException) -> bool:
    """Did a cohort's call fail because the replica serves no model?

    Ray re-raises a replica's exception as a RayTaskError that is also an instance of the
    original class (so ``category`` is there) and keeps the original as ``cause``.
    """
    for candidate in (exc, getattr(exc, "cause", None)):
        if getattr(candidate, "category", None) == NOT_SERVING_CATEGORY:
            return True
    return False


def other_cohort(cohort: str) -> Cohort:
    if cohort == STABLE:
        return CANARY
    if cohort == CANARY:
        return STABLE
    raise ValueError(f"unknown cohort {cohort!r}")


def bucket(salt: str, key: str) -> int:
    """The key's bucket in [0, 10 000): stable across processes, hosts and Python versions.

    (Python's ``hash()`` is salted per process, so it cannot be used.)
    """
    digest = hashlib.blake2b(
        key.encode("utf-8"), digest_size=8, key=salt.encode("utf-8")[:64]
    ).digest()
    return int.from_bytes(digest, "big") % BASIS_POINTS


def check_basis_points(canary_bp: int) -> int:
    if not 0 <= canary_bp <= BASIS_POINTS:
        raise ValueError(f"canary_bp must be within [0, {BASIS_POINTS}], got {canary_bp}")
    return canary_bp


def choose_cohort(
    *, canary_bp: int, salt: str, key: str | None, random_bp: Callable[[], int]
) -> Cohort:
    """The cohort a request belongs to by weight alone.

    ``random_bp`` returns a uniform integer in [0, 10 000); it is only called for a request
    without a key.
    """
    check_basis_points(canary_bp)
    if canary_bp == 0:
        return STABLE
    if canary_bp == BASIS_POINTS:
        return CANARY
    point = bucket(salt, key) if key else random_bp()
    return CANARY if point < canary_bp else STABLE


def request_key(user_id: str | None, session_id: str | None) -> str | None:
    """Bucketing key: the user id, else the session id, else none (random split)."""
    if user_id:
        return f"u:{user_id}"
    if session_id:
        return f"s:{session_id}"
    return None


def parse_forced_cohort(header_value: str | None, *, allowed: bool) -> Cohort | None:
    """The cohort forced by the test header, if the router allows forcing at all.

    Raises ValueError for an unknown cohort name (the router answers 422 naming the header).
    A header sent to a router that does not allow forcing is ignored, not an error: clients
    must not be able to tell, or choose, their cohort in production.
    """
    if not allowed or header_value is None:
        return None
    value = header_value.strip().lower()
    if value not in COHORTS:
        raise ValueError(f"unknown cohort {header_value!r}; expected one of {COHORTS}")
    return value  # type: ignore[return-value]


@dataclass
class CohortHealth:
    """What the router knows about one cohort's ability to answer.

    ``serving``: the cohort answered with a verified model recently (None: not known yet).
    ``open_until``: after a failure the cohort is skipped until then (a short circuit
    breaker), so requests bucketed to a pool that is gone go straight to the other cohort
    instead of each waiting for a timeout. After it, one request tries the cohort again.
    """

    serving: bool | None = None
    open_until: float = 0.0
    consecutive_failures: int = 0
    unanswered_probes: int = 0

    def record_success(self) -> None:
        self.serving = True
        self.open_until = 0.0
        self.consecutive_failures = 0

    def record_failure(self, now: float, *, base_s: float = 1.0, cap_s: float = 10.0) -> None:
        # ``serving`` is left to the probes: after the window one request tries again.
        self.consecutive_failures += 1
        self.open_until = now + min(cap_s, base_s * 2 ** (self.consecutive_failures - 1))

    def record_not_serving(self, now: float) -> None:
        """A call failed because the cohort serves no model (e.g. its target was cleared):
        no failover goes there until a probe sees it serving again."""
        self.record_failure(now)
        self.serving = False

    def record_probe(self, serving: bool, *, answered: bool = True) -> None:
        """A status probe round: a serving cohort closes the breaker at once; one whose
        replicas answer without a model is not serving; one nobody answered is taken for
        gone only after ``UNANSWERED_PROBES_GONE`` such rounds in a row (a probe that timed
        out on a loaded machine must not take stable away as a failover destination)."""
        if not answered:
            self.unanswered_probes += 1
            if self.unanswered_probes >= UNANSWERED_PROBES_GONE:
                self.serving = False
            return
        self.unanswered_probes = 0
        if serving:
            self.record_success()
        else:
            self.serving = False

    def is_open(self, now: float) -> bool:
        return now < self.open_until


@dataclass(frozen=True)
class RouteDecision:
    """Where to send a request first, and which primary cohort to fail over to (if any)."""

    primary: Cohort
    failover_to: Cohort | None  # the other primary cohort (the fallback deployment is apart)
    bucketed: Cohort  # the cohort the weights chose, before breaker and forcing
    reason: str  # "weight", "forced", "breaker_open", "not_serving"


def can_fail_over_to(cohort: Cohort, health: Mapping[str, CohortHealth], now: float) -> bool:
    """Failover goes to a cohort that serves a verified model and is not in its breaker."""
    state = health.get(cohort)
    return state is not None and state.serving is True and not state.is_open(now)


def decide_route(
    *,
    canary_bp: int,
    salt: str,
    key: str | None,
    forced: Cohort | None,
    health: Mapping[str, CohortHealth],
    now: float,
    random_bp: Callable[[], int],
    failover: bool = True,
) -> RouteDecision:
    """Weights (or the forcing header) pick a cohort; an open breaker, or a cohort known not
    to serve, sends the request to the other cohort when that one serves; otherwise the other
    cohort is the one to fail over to.

    A forced request never fails over: a test that forces a cohort wants that cohort's
    answer or its error.
    """
    if forced is not None:
        return RouteDecision(primary=forced, failover_to=None, bucketed=forced, reason="forced")
    chosen = choose_cohort(canary_bp=canary_bp, salt=salt, key=key, random_bp=random_bp)
    other = other_cohort(chosen)
    other_ok = failover and can_fail_over_to(other, health, now)
    chosen_state = health.get(chosen)
    if chosen_state is not None and other_ok:
        if chosen_state.is_open(now):
            return RouteDecision(
                primary=other, failover_to=None, bucketed=chosen, reason="breaker_open"
            )
        if chosen_state.serving is False:
            # Known not to serve (an idle pool, or every probe failed): do not make the
            # request wait for a timeout first.
            return RouteDecision(
                primary=other, failover_to=None, bucketed=chosen, reason="not_serving"
            )
    return RouteDecision(
        primary=chosen, failover_to=other if other_ok else None, bucketed=chosen, reason="weight"
    )
