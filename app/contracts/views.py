"""What the controller actor answers the CLI (``rollout status``, commands, ping), and
the hot standby as a router replica sees it (``/v1/status``, shown by ``rollout status``)."""

from __future__ import annotations

import math
from typing import Annotated, Final, Literal

from pydantic import Field, StringConstraints

from app.contracts.app_args import ControllerSettings
from app.contracts.reports import LoadProgress
from app.contracts.targets import PublishedTarget
from app.contracts.vocabulary import (
    BASIS_POINTS,
    BasisPoints,
    Cohort,
    Contract,
    Name,
    OperatorCommandName,
    Probability,
    ReplicaPhase,
    Revision,
    Role,
    RolloutPhase,
    Seconds,
    Text,
    WallClock,
)

BreakerStateName = Literal["closed", "open", "half_open", "ramping"]


class BreakerView(Contract):
    """A primary cohort's standby breaker, as one router replica sees it."""

    cohort: Cohort
    state: BreakerStateName
    in_state_s: Seconds  # since the breaker entered ``state``
    # The share of the cohort's own traffic it takes now (1 closed, 0 open).
    share: Annotated[float, Field(ge=0, le=1)]
    # Until its share is back to 1 if nothing fails meanwhile (None while open: that waits
    # for the cohort to serve again; 0 when closed).
    fail_back_in_s: Seconds | None = None
    opened: Annotated[int, Field(ge=0)] = 0  # times it opened since the router started
    reason: Text | None = None  # why it last opened


class StandbyView(Contract):
    """The hot standby as one router replica sees it (``/v1/status``, ``rollout status``)."""

    policy: Name
    # No primary cohort can take all traffic (its breaker closed and a model serving), after
    # one did; since when, while it lasts.
    primaries_down: bool
    down_s: Seconds | None = None
    # Primaries down and the fallback answering (ready and allowed); else their requests
    # get 503 + Retry-After.
    serving_from_fallback: bool
    ready: bool  # a fallback replica serves a verified model
    allowed: bool  # the accuracy guard (or the operator's policy) lets the fallback answer
    allowed_reason: Text
    metric: Name
    fallback_metric: float | None = None
    stable_metric: float | None = None
    answered: Annotated[int, Field(ge=0)] = 0  # requests the fallback answered so far
    waiting: Annotated[int, Field(ge=0)] = 0  # requests waiting for a cold fallback now
    breakers: tuple[BreakerView, ...] = ()


class WeightsView(Contract):
    stable_bp: BasisPoints
    canary_bp: BasisPoints


class HoldView(Contract):
    since: WallClock
    reason: Text


EValue = Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)]


class EvidenceView(Contract):
    """One check's evidence after a window (sequential judge): its e-values against the
    canary and for it, and the bounds that fail it (``fail_at``) and pass it (``pass_at``).
    The sample-ratio guard neither fails nor passes a canary: it has ``hold_at`` instead."""

    check: Name
    against: EValue
    supporting: EValue | None = None
    fail_at: EValue | None = None
    pass_at: EValue | None = None
    hold_at: EValue | None = None


class VerdictView(Contract):
    step: Annotated[int, Field(ge=-1, le=BASIS_POINTS)]  # as RolloutSummary.step
    outcome: Name
    reasons: tuple[Text, ...] = ()
    evidence: Annotated[tuple[EvidenceView, ...], Field(max_length=32)] = ()


class RolloutEvent(Contract):
    """One entry of a rollout's event log (persisted with its state, shown by status)."""

    key: Name | None = None  # an audit record's idempotency key: replays are dropped
    event: Name
    message: Text
    at: WallClock
    canary_bp: BasisPoints | None = None  # weight events


class ShadowView(Contract):
    """The shadow phase as far as it went: how much is mirrored, what the comparisons saw
    over the phase (``max_score_diff_p99``: the last window's), and what the gate holds them
    to (``basis``)."""

    fraction_bp: BasisPoints
    live: bool  # the router was observed mirroring
    basis: Text
    compared: Annotated[int, Field(ge=0)] = 0
    dropped: Annotated[int, Field(ge=0)] = 0
    errors: Annotated[int, Field(ge=0)] = 0
    rbo_mean: Probability | None = None
    overlap_mean: Probability | None = None
    top1_change_rate: Probability | None = None
    max_score_diff_p99: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    windows: Annotated[int, Field(ge=0)] = 0

    def describe(self) -> str:
        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        top1 = None if self.top1_change_rate is None else self.top1_change_rate * 100
        if self.fraction_bp:
            live = "live" if self.live else "not confirmed"
            state = f"mirroring {self.fraction_bp / 100:g}% ({live})"
        else:
            state = "mirroring off"
        return (
            f"shadow: {state} | {self.compared} compared, "
            f"{self.dropped} dropped, {self.errors} unanswered | mean RBO "
            f"{num(self.rbo_mean, '.3f')}, top-k overlap {num(self.overlap_mean, '.3f')}, "
            f"top-1 changed {num(top1, '.1f')}%"
            f", p99 max score diff {num(self.max_score_diff_p99, '.4f')} | gate: {self.basis}"
        )


# The share of healthy canaries a progress deadline must let pass (``pass_late_s``: see
# rollout/estimate.py): 99%, with a margin for the step needing every check at once (the
# benchmark's A/A rollouts at the 99th percentile's deadline: 99.0-99.3% promoted).
PASS_QUANTILE: Final = 0.995
PASS_QUANTILE_TEXT: Final = f"{PASS_QUANTILE:.1%}"  # "99.5%", as the estimate's lines say it


def duration_text(seconds: float | None, *, unit_gap: str = " ") -> str:
    """A time as people read it: seconds under 90 s, minutes under 90 min, else hours
    ("never" for None or inf); ``unit_gap`` "" gives the status view's tight "7min"."""
    if seconds is None or math.isinf(seconds):
        return "never"
    if seconds < 90:
        return f"{seconds:.0f}{unit_gap}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}{unit_gap}min"
    return f"{seconds / 3600:.1f}{unit_gap}h"


class StepEstimateView(Contract):
    """What one step will take at the traffic measured before the start (the sequential
    judge; rollout/estimate.py): a healthy canary passes it in about ``pass_s`` (the median)
    and 99.5% of them within ``pass_late_s``; a regression of twice a check's bound is caught in
    about ``catch_s``. None: not at this traffic."""

    index: Annotated[int, Field(ge=0, le=BASIS_POINTS)]
    percent: Annotated[float, Field(gt=0, le=100)]
    canary_rps: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    pass_s: Seconds | None = None
    pass_late_s: Seconds | None = None
    limiting: Text  # what sets pass_s: a check, or a sanity floor
    catch_s: Seconds | None = None
    fits: bool  # pass_late_s within the progress deadline


class PlanEstimateView(Contract):
    """The start-time estimate of a rollout, kept with it: the traffic it was made from (the
    last ``measured_s`` seconds before the start), each step's times, the progress deadline
    the rollout runs with and where it came from (``deadline_source``: ``plan``, or
    ``estimate`` for a plan that leaves it to the estimate), and whether an operator started
    it against the estimate (``forced``)."""

    rps: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    stable_error_rate: Probability
    measured_s: Seconds
    steps: Annotated[tuple[StepEstimateView, ...], Field(max_length=BASIS_POINTS)] = ()
    deadline_s: Seconds
    deadline_source: Literal["plan", "estimate"]
    forced: bool = False


class CheckProgressView(Contract):
    """One check at the current step: how far its evidence has gone toward passing the
    canary (``toward_pass``: ln e-value for / ln of its bound, 0-1) and toward failing it."""

    check: Name
    toward_pass: Probability
    toward_fail: Probability


class StepProgressView(Contract):
    """The current step's way to its decision: the checks' progress, the canary requests
    it still needs for its sanity floor, and the time left at the current rate (None: not
    known yet: no evidence grows so far, or no traffic)."""

    index: Annotated[int, Field(ge=0, le=BASIS_POINTS)]
    checks: Annotated[tuple[CheckProgressView, ...], Field(max_length=32)] = ()
    canary_requests: Annotated[int, Field(ge=0)] = 0
    min_requests: Annotated[int, Field(ge=0)] = 0
    canary_rps: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    time_left_s: Seconds | None = None


class RolloutSummary(Contract):
    """The rollout the controller drives; ``rollout`` None (and nothing else) when none."""

    rollout: Name | None = None
    model: Name | None = None
    candidate: Name | None = None
    baseline: Name | None = None
    phase: RolloutPhase | None = None
    finished: bool | None = None
    step: Annotated[int, Field(ge=-1, le=BASIS_POINTS)] | None = None  # -1: before the first
    # (a plan has at most one step per basis point of weight)
    step_percent: Annotated[float, Field(ge=0, le=100)] | None = None
    steps: tuple[float, ...] = ()
    weights: WeightsView | None = None
    failed_checks: Annotated[int, Field(ge=0)] | None = None
    reason: Text | None = None
    pending_gate: Name | None = None
    held: HoldView | None = None
    shadow: ShadowView | None = None
    verdicts: tuple[VerdictView, ...] = ()
    events: tuple[RolloutEvent, ...] = ()
    estimate: PlanEstimateView | None = None
    progress: StepProgressView | None = None


class CommandAccepted(RolloutSummary):
    queued: OperatorCommandName


class ReplicaRow(Contract):
    """One replica as ``rollout status`` lists it."""

    replica: Name
    cohort: Role | None
    phase: ReplicaPhase
    desired: Name | None
    desired_revision: Revision | None = None
    actual: Name | None
    actual_revision: Revision | None
    error: Text | None
    age_s: float
    progress: LoadProgress | None = None
    backbone: Name | None = None  # the backbone the serving head runs on
    trust_anchors: Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")] | None = None


class CohortWindowView(Contract):
    requests: Annotated[int, Field(ge=0)]  # whole requests, as the judge counts them
    rps: Annotated[float, Field(ge=0)]
    error_rate: Annotated[float, Field(ge=0, le=1)] | None
    p50_ms: Annotated[float, Field(ge=0)] | None
    p99_ms: Annotated[float, Field(ge=0)] | None


class WindowView(Contract):
    start: WallClock
    end: WallClock
    canary: CohortWindowView | None
    stable: CohortWindowView | None


class ControllerStatus(RolloutSummary):
    """``rollout status``: the rollout, the registry's targets (None: the registry could not
    be read), the replicas' last reports, the last metrics window, alerts and errors."""

    targets: tuple[PublishedTarget, ...] | None = None
    replicas: tuple[ReplicaRow, ...] = ()
    last_window: WindowView | None = None
    alerts: tuple[Text, ...] = ()
    errors: tuple[Text, ...] = ()
    # Instance reports refused where they arrived (invalid, or a heartbeat too far ahead of
    # the controller's clock) since the controller started (rollout.reports.ReportStore).
    reports_refused: Annotated[int, Field(ge=0)] = 0
    # The router's hot standby (None: the app has no fallback, or the router did not answer).
    standby: StandbyView | None = None


class ControllerPing(ControllerSettings):
    """The controller actor is up: its process, ticks so far and the drift it repaired."""

    pid: Annotated[int, Field(ge=0, le=1 << 32)]
    # The Ray node it runs on (hex ID; None: a controller older than this field).
    node_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,128}$")] | None = None
    ticks: Annotated[int, Field(ge=0)]
    repaired: tuple[Text, ...] | None
    # Ray's metrics report interval as the controller's process reads it (None: unread, or a
    # controller older than these fields), and how long after a weight change its first
    # window starts because of it.
    metrics_export_interval_s: Annotated[float, Field(ge=0, le=3600)] | None = None
    window_delay_s: Annotated[float, Field(ge=0, le=7200)] | None = None
