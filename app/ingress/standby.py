"""Hot standby: when the router answers from the fallback deployment, and when it comes back.

Pure: no Ray, no clock of its own, no I/O. The router feeds each primary cohort's breaker what
it sees (answers, failures, status probes) with ``now``, and asks where a request may go.

A breaker per primary cohort (stable, canary)::

    closed --(trip_after_failures failed requests in a row,
              or trip_after_probes probes in a row that no replica answered)--> open
    open --(a probe finds the cohort serving, min_open_s after it opened)--> half_open
                                                            (half_open_share of its traffic)
    half_open --(fail_back_after_s without a failure)--> ramping  (share grows to 1 over ramp_s)
    ramping --(ramp_s without a failure)--> closed
    half_open / ramping --(any failure: a request, or a probe no replica answered)--> open

A cohort that answers its probes but has no model (an idle canary pool, a first load) is not
failing: routing already skips it (``app.ingress.routing``), and opening its breaker would make a
rollout's canary wait out a fail-back window before taking its weight.

Traffic follows the breakers: a request goes to its bucketed cohort unless that cohort's
breaker is open, else to the other primary cohort, and the fallback is the last resort, after
the primaries, for a request they could not answer. Hysteresis (a half-open or ramping cohort
taking only its share) applies only while it matters: when the fallback can answer and no
primary cohort is fully available. With a healthy primary beside it, a recovering cohort
takes all its traffic at once (no traffic moves from one primary to the other for hysteresis:
that would starve a canary's judged traffic and flood stable's partner); with a fallback that
is refused or cold, holding users back would only turn them into 503s. Whether a partly open
cohort admits a request is decided by a hash of the request's key against its share, so the
users who come back first stay back and nobody flips between models.

Evidence is counted per handle call, not per request: the requests that rode together in one
coalesced call fail together, and one slow call must not count as many failures. A failure
of a call sent before the breaker's last change of state is ignored: it says nothing about
the cohort since then.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from app.contracts import (
    BASIS_POINTS,
    COHORTS,
    FALLBACK,
    MAX_DURATION_S,
    BreakerView,
    Cohort,
    Role,
    StandbyConfig,
    clip_text,
)

# The key of the hash that decides which users a partly open cohort takes; another key than
# the weights' bucketing, so the users who come back first are not the canary's users.
_ADMISSION_SALT: Final = b"standby-admission"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"
    RAMPING = "ramping"


@dataclass
class PrimaryBreaker:
    """One primary cohort's breaker on the router's monotonic clock (see the module)."""

    cohort: Cohort
    config: StandbyConfig = field(default_factory=StandbyConfig)
    state: BreakerState = BreakerState.CLOSED
    since: float = 0.0
    failures_in_row: int = 0
    unanswered_probes_in_row: int = 0
    opened: int = 0
    reason: str | None = None
    # Grows with every change of state: a call records the epoch it was sent in.
    epoch: int = 0

    # ------------------------------------------------------------------ evidence

    def record_success(self, now: float) -> None:
        """A call the cohort answered (it answers: probes that timed out meanwhile were
        slowness, not absence)."""
        self.advance(now)
        self.failures_in_row = 0
        self.unanswered_probes_in_row = 0

    def record_failure(self, now: float, why: str, *, sent_in: int | None = None) -> None:
        """A call the cohort failed or did not answer in time; ``sent_in``: the epoch it was
        sent in (a failure from before the last change of state is ignored)."""
        self.advance(now)
        if sent_in is not None and sent_in != self.epoch:
            return
        self.failures_in_row += 1
        if self.state is BreakerState.CLOSED:
            if self.failures_in_row >= self.config.trip_after_failures:
                self._open(now, f"{self.failures_in_row} calls in a row failed (last: {why})")
        elif self.state is not BreakerState.OPEN:
            self._open(now, f"failed again while failing back: {why}")

    def record_probe(self, now: float, *, answered: bool, serving: bool) -> None:
        """A status probe: did any replica answer, and does one serve a model?"""
        self.advance(now)
        if not answered:
            self.unanswered_probes_in_row += 1
            if self.state is BreakerState.CLOSED:
                if self.unanswered_probes_in_row >= self.config.trip_after_probes:
                    self._open(now, f"{self.unanswered_probes_in_row} probes in a row unanswered")
            elif self.state is not BreakerState.OPEN:
                self._open(now, "a probe went unanswered while failing back")
            return
        self.unanswered_probes_in_row = 0
        if (
            serving
            and self.state is BreakerState.OPEN
            and now - self.since >= self.config.min_open_s
        ):
            self._enter(BreakerState.HALF_OPEN, now)

    def reconfigure(self, config: StandbyConfig, now: float) -> None:
        self.advance(now)
        self.config = config
        self.advance(now)

    # ------------------------------------------------------------------ time

    def advance(self, now: float) -> None:
        """The transitions time alone makes: half-open -> ramping -> closed."""
        window, ramp = self.config.fail_back_after_s, self.config.ramp_s
        if self.state is BreakerState.HALF_OPEN and now - self.since >= window:
            self._enter(BreakerState.RAMPING, self.since + window)
        if self.state is BreakerState.RAMPING and now - self.since >= ramp:
            self._enter(BreakerState.CLOSED, self.since + ramp)

    def share(self, now: float) -> float:
        """The share of the cohort's own traffic it takes now."""
        self.advance(now)
        if self.state is BreakerState.CLOSED:
            return 1.0
        if self.state is BreakerState.OPEN:
            return 0.0
        low = self.config.half_open_share
        if self.state is BreakerState.HALF_OPEN:
            return low
        ramp = self.config.ramp_s
        progress = 1.0 if ramp <= 0 else min(1.0, (now - self.since) / ramp)
        return low + (1.0 - low) * progress

    def fail_back_in(self, now: float) -> float | None:
        """Seconds until the share is back to 1 if nothing fails (None while open)."""
        self.advance(now)
        c = self.config
        if self.state is BreakerState.CLOSED:
            return 0.0
        if self.state is BreakerState.OPEN:
            return None
        if self.state is BreakerState.HALF_OPEN:
            return max(0.0, self.since + c.fail_back_after_s - now) + c.ramp_s
        return max(0.0, self.since + c.ramp_s - now)

    def admits(self, now: float, key: str | None, random_bp: Callable[[], int]) -> bool:
        share = self.share(now)
        if share >= 1.0:
            return True
        if share <= 0.0:
            return False
        point = admission_point(key) if key else random_bp()
        return point < share * BASIS_POINTS

    def view(self, now: float) -> BreakerView:
        self.advance(now)
        return BreakerView(
            cohort=self.cohort,
            state=self.state.value,
            in_state_s=_seconds(now - self.since),
            share=round(self.share(now), 4),
            fail_back_in_s=_seconds(self.fail_back_in(now)),
            opened=self.opened,
            reason=clip_text(self.reason),
        )

    # ------------------------------------------------------------------ transitions

    def _open(self, now: float, reason: str) -> None:
        self._enter(BreakerState.OPEN, now)
        self.opened += 1
        self.reason = reason

    def _enter(self, state: BreakerState, at: float) -> None:
        self.state = state
        self.since = at
        self.epoch += 1
        self.failures_in_row = 0
        self.unanswered_probes_in_row = 0


def _seconds(value: float | None) -> float | None:
    """A duration for a view: rounded, within the contracts' bounds."""
    return None if value is None else round(min(max(0.0, value), MAX_DURATION_S), 3)


def admission_point(key: str) -> int:
    """The key's point in [0, 10 000) for a partly open cohort (stable across processes)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=_ADMISSION_SALT).digest()
    return int.from_bytes(digest, "big") % BASIS_POINTS


# --------------------------------------------------------------------------- accuracy guard


# Which way each known offline metric improves (True: higher is better). Names are matched
# lowercased, with a rank cutoff (``_at_10``, ``@10``) dropped and a ``neg_`` prefix (scikit-
# learn's negated losses) flipping the direction. A metric not here needs the operator's
# ``accuracy_higher_is_better``: guessing wrong would let a much worse fallback answer.
METRIC_HIGHER_IS_BETTER: Final[Mapping[str, bool]] = {
    **dict.fromkeys(
        (
            "accuracy",
            "auc",
            "roc_auc",
            "pr_auc",
            "ndcg",
            "dcg",
            "map",
            "mrr",
            "precision",
            "recall",
            "hit_rate",
            "f1",
            "r2",
        ),
        True,
    ),
    **dict.fromkeys(
        (
            "logloss",
            "log_loss",
            "cross_entropy",
            "loss",
            "rmse",
            "mse",
            "mae",
            "mean_squared_error",
            "root_mean_squared_error",
            "mean_absolute_error",
            "error_rate",
            "brier_score",
        ),
        False,
    ),
}
_RANK_CUTOFF: Final = re.compile(r"(?:_at_|@)\d+$")
_NEGATED: Final = "neg_"


def metric_direction(metric: str) -> bool | None:
    """True when a higher ``metric`` is better, False when lower is, None when unknown
    (``METRIC_HIGHER_IS_BETTER``)."""
    name = _RANK_CUTOFF.sub("", metric.lower())
    if name.startswith(_NEGATED):
        known = METRIC_HIGHER_IS_BETTER.get(name.removeprefix(_NEGATED))
        return None if known is None else not known
    return METRIC_HIGHER_IS_BETTER.get(name)


@dataclass(frozen=True)
class AccuracyVerdict:
    allowed: bool
    reason: str
    fallback_metric: float | None
    stable_metric: float | None
    # Refused only because the fallback has not reported its model yet (cold since the router
    # started): worth waiting for, the guard decides once it serves.
    fallback_unknown: bool = False


def accuracy_verdict(
    config: StandbyConfig,
    fallback: Mapping[str, float] | None,
    stable: Mapping[str, float] | None,
) -> AccuracyVerdict:
    """May the fallback answer? ``fallback`` and ``stable``: the offline evaluations their
    serving models report (None: not known yet). Under ``auto`` a number missing on either
    side refuses: the guard cannot tell how much worse the fallback is.

    The numbers are the manifests' own (``metadata.offline_evaluation``): the guard trusts
    them, it does not measure the models. It compares by the metric's direction (the
    config's ``accuracy_higher_is_better``, else ``metric_direction``; neither: refused). The
    margin is relative to the size of stable's number: the fallback may be worse by at most
    ``accuracy_margin * |stable|``, in absolute terms, whatever the direction and the sign (a
    factor ``1 - margin`` would tighten instead of loosen a negative number). An equal number
    always passes; with stable at 0 only an equal or better one does."""
    metric = config.accuracy_metric
    fb = None if fallback is None else fallback.get(metric)
    st = None if stable is None else stable.get(metric)
    if config.policy == "always":
        return AccuracyVerdict(True, "policy always: the operator allows the fallback", fb, st)
    if config.policy == "never":
        return AccuracyVerdict(False, "policy never: the operator refuses the fallback", fb, st)
    higher_is_better = config.accuracy_higher_is_better
    if higher_is_better is None:
        higher_is_better = metric_direction(metric)
    if higher_is_better is None:
        # A setting to fix, not a cold fallback to wait for: refused before that check.
        return AccuracyVerdict(
            False,
            f"whether a higher or lower {metric!r} is better is unknown: refused"
            " (set router.standby.accuracy_higher_is_better)",
            fb,
            st,
        )
    if fallback is None:
        return AccuracyVerdict(
            False, "the fallback has not served a model yet", fb, st, fallback_unknown=True
        )
    if fb is None:
        return AccuracyVerdict(
            False, f"the fallback's model reports no offline {metric}: refused", fb, st
        )
    if st is None:
        return AccuracyVerdict(
            False, f"stable's model has reported no offline {metric}: refused", fb, st
        )
    tolerance = config.accuracy_margin * abs(st)
    if higher_is_better:
        bound = st - tolerance
        ok = fb >= bound
        needed = f"higher is better, at least {bound:g} needed"
    else:
        bound = st + tolerance
        ok = fb <= bound
        needed = f"lower is better, at most {bound:g} needed"
    relation = f"fallback {metric} {fb:g} vs stable {st:g} ({needed})"
    margin = f"{config.accuracy_margin:.0%}"
    if ok:
        return AccuracyVerdict(True, f"within {margin}: {relation}", fb, st)
    return AccuracyVerdict(False, f"outside {margin}: {relation}; answering 503", fb, st)


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class StandbyRoute:
    """Where a request may go, in order (primary cohorts first, the fallback last), and why
    the fallback is not among them when it is not."""

    destinations: tuple[Role, ...]
    # The fallback would be next but serves no model yet: the request may wait for it.
    wait_for_fallback: bool = False
    refused: str | None = None  # why the fallback may not answer (accuracy guard, policy)
    queue_full: bool = False  # (the router's) too many requests wait for it already


def fully_available(
    cohort: str, breakers: Mapping[str, PrimaryBreaker], serving: Mapping[str, bool | None]
) -> bool:
    """The cohort's breaker is closed and a model serves there (as the probes last saw)."""
    return breakers[cohort].state is BreakerState.CLOSED and serving.get(cohort) is True


def route_with_standby(
    primaries: Sequence[Cohort],
    breakers: Mapping[str, PrimaryBreaker],
    *,
    now: float,
    key: str | None,
    random_bp: Callable[[], int],
    serving: Mapping[str, bool | None],
    fallback_ready: bool,
    verdict: AccuracyVerdict,
) -> StandbyRoute:
    """``primaries``: the routing decision's cohorts in order (bucketed or redirected first,
    then its failover); ``serving``: what the probes last saw of each primary cohort.

    An open cohort is left out. A half-open or ramping one takes only its share while the
    fallback can answer and no primary cohort is fully available; otherwise it takes all its
    traffic. The fallback comes last when it is ready and the guard allows it, whether or not
    a primary is left (it answers a request the primaries failed)."""
    for cohort in primaries:
        breakers[cohort].advance(now)
    usable = fallback_ready and verdict.allowed
    if usable and not any(fully_available(c, breakers, serving) for c in COHORTS):
        kept = tuple(c for c in primaries if breakers[c].admits(now, key, random_bp))
    else:
        kept = tuple(c for c in primaries if breakers[c].state is not BreakerState.OPEN)
    if usable:
        return StandbyRoute((*kept, FALLBACK))
    if not verdict.allowed and not (verdict.fallback_unknown and not fallback_ready):
        return StandbyRoute(kept, refused=verdict.reason)
    return StandbyRoute(kept, wait_for_fallback=not kept)


def primaries_down(
    breakers: Mapping[str, PrimaryBreaker],
    serving: Mapping[str, bool | None],
    *,
    served_before: bool,
) -> bool:
    """No primary cohort can take all traffic, after one did (a deploy whose first load is
    still running is not an outage)."""
    return served_before and not any(fully_available(c, breakers, serving) for c in COHORTS)


__all__ = [
    "METRIC_HIGHER_IS_BETTER",
    "AccuracyVerdict",
    "BreakerState",
    "PrimaryBreaker",
    "StandbyRoute",
    "accuracy_verdict",
    "admission_point",
    "fully_available",
    "metric_direction",
    "primaries_down",
    "route_with_standby",
]
