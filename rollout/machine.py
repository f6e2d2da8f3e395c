"""The rollout state machine: ``advance(state, observations, now) -> (state, actions)``.

Pure: no clock, no Ray, no registry, no I/O. The controller actor owns the timer; on each tick
it gathers ``Observations`` (replica reports, the router's live weights, the latest metrics
window, operator commands, the memory budget), calls ``advance``, carries out the returned
actions in order, and persists the new state. Tests call ``advance`` directly, one call per
tick, with a fake ``now``.

Phases (see ``rollout.state.Phase``)::

    pending -> preparing -> [shadowing] -> progressing(step 0..n-1) -> promoting -> finalising
                  |              |              |    ^                     |       -> succeeded
                  |              |            paused (gates, operator)     |
                  +--------------+--------------+----------+---------------+--> rolled_back |
                                                                               failed | aborted

Invariants:
- Every exit other than success (rollback, failure, abort) emits ``SetWeights`` to stable 100%
  as its FIRST action, before any target change or bookkeeping. The canary pool is only
  cleaned up (scaled to idle, target cleared) once the router is observed at stable 100%.
- Capacity before traffic: the canary pool is scaled for a step's weight and its replicas
  report the candidate ready before the router is given that weight.
- Windows are judged only while the router is observed applying the current weights, only
  from that moment on, and never twice (a window must start at or after the end of the last
  judged one). The sequential judge takes a window per metrics export (``window_length_s``),
  the threshold judge one per ``interval_s``; one verdict per ``interval_s`` is recorded, and
  every decision. Fewer than ``min_requests`` (in the window for the threshold judge, at the
  step for the sequential one) is inconclusive: the rollout holds, and only the progress
  deadline bounds holding.
- Time the controller could not act (registry or Serve out of reach) is not progress time:
  ``held`` moves the deadlines on by it; serving goes on meanwhile on verified models.
- Threshold judge: consecutive failed windows reaching ``plan.threshold`` roll back; a passing
  window resets the count and completes the step. Sequential judge: a failed window rolls back
  at once (its evidence already spans every window so far), a passing one completes the
  step, and the evidence carries on into the next step. A sample-ratio mismatch holds the
  rollout and raises one alert.
- Shadow phase (a plan with ``shadow``): the canary carries no user traffic; the router is
  told to mirror a fraction of stable's requests to it, and windows of comparisons are judged
  only once the router is observed mirroring (``shadow_live_at``). A failed shadow gate rolls
  back before any user is answered by the candidate; mirroring is turned off before the first
  live step and on every exit.
- Drift (Serve's config changed by someone else, e.g. KubeRay resubmitting an old
  ``serveConfigV2``): ``after_drift`` takes the canary weight and mirroring back to 0 and
  keeps what they were; they are set again, capacity before traffic, once every canary
  replica reports the candidate ready. Windows restart from the moment the router is seen
  applying them again.
- Actions are declarative (desired values, not deltas) and ``advance`` is deterministic, so a
  controller that crashes after acting but before persisting re-runs ``advance`` from the old
  state and repeats the same actions harmlessly; re-running it on the new state with the same
  observations emits nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from app.contracts import ExpectedDivergence, ReplicaPhase
from rollout import judging
from rollout.analysis import Outcome, Verdict, WindowStats
from rollout.sequential import SAMPLE_RATIO
from rollout.shadow_judge import new_shadow_evidence
from rollout.state import (
    GATE_OPERATOR,
    GATE_PROMOTION,
    VERDICT_HISTORY,
    Phase,
    RolloutState,
    VerdictRecord,
    Weights,
    gated_step,
    step_gate,
)

# --------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class ReplicaObservation:
    """What one replica last reported about itself, as far as the machine cares.

    Only READY counts as ready and only FAILED as failed: a replica in BACKOFF (waiting to
    retry after a transient failure) is still working on its target, as one LOADING is."""

    replica_id: str
    desired_artifact_id: str | None
    actual_artifact_id: str | None
    phase: ReplicaPhase
    error: str | None = None
    actual_backbone_id: str | None = None  # the backbone a serving head runs on


@dataclass(frozen=True)
class PoolView:
    """One deployment's replicas. ``expected`` is the replica count Serve is configured for."""

    replicas: tuple[ReplicaObservation, ...] = ()
    expected: int = 0

    def ready_on(self, artifact_id: str) -> int:
        return sum(
            1
            for r in self.replicas
            if r.phase is ReplicaPhase.READY
            and r.desired_artifact_id == artifact_id
            and r.actual_artifact_id == artifact_id
        )

    def all_ready_on(self, artifact_id: str, at_least: int = 1) -> bool:
        return self.ready_on(artifact_id) >= max(at_least, self.expected, 1)

    def backbones_on(self, artifact_id: str | None = None) -> set[str | None]:
        """The backbones the replicas serving ``artifact_id`` (None: any artifact) run on
        (None in the set: a whole model)."""
        return {
            r.actual_backbone_id
            for r in self.replicas
            if r.actual_artifact_id is not None
            and (artifact_id is None or r.actual_artifact_id == artifact_id)
        }

    def failures_on(self, artifact_id: str) -> list[ReplicaObservation]:
        return [
            r
            for r in self.replicas
            if r.phase is ReplicaPhase.FAILED and r.desired_artifact_id == artifact_id
        ]


@dataclass(frozen=True)
class Pause:
    reason: str = ""


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class Promote:
    """Skip the remaining steps (and gates) and promote now."""


@dataclass(frozen=True)
class Abort:
    reason: str = "aborted by operator"


@dataclass(frozen=True)
class Rollback:
    """The fast path: weights to stable first, no analysis."""

    reason: str = "rollback requested by operator"


OperatorCommand = Pause | Resume | Promote | Abort | Rollback


@dataclass(frozen=True)
class Observations:
    """The world as the controller saw it just before this tick.

    - ``router_weights``: the weights the router currently applies (None: unknown).
    - ``window``: the latest metrics window; ignored unless it is a fresh, full window of the
      current weights (see ``next_window``).
    - ``commands``: operator commands received since the last tick, in order.
    - ``in_place_fits``: whether the memory budget allows the stable pool to hold the baseline
      and the candidate at once (None: unknown, treated as no).
    - ``router_shadow_bp``: the mirrored fraction the router applies (None: unknown).
    - ``evidence_interval_s``: how often the metrics move (the cluster's export interval);
      the sequential judge adds evidence at that cadence (see ``window_length_s``). None: once
      per ``plan.interval_s``, as the threshold judge does.
    """

    canary: PoolView = PoolView()
    stable: PoolView = PoolView()
    router_weights: Weights | None = None
    window: WindowStats | None = None
    commands: tuple[OperatorCommand, ...] = ()
    in_place_fits: bool | None = None
    router_shadow_bp: int | None = None
    evidence_interval_s: float | None = None


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SetCanaryTarget:
    """Publish the canary pool's target; None clears it (an idle pool holds no model)."""

    artifact_id: str | None


@dataclass(frozen=True)
class SetStableTarget:
    artifact_id: str


@dataclass(frozen=True)
class SetWeights:
    stable_bp: int
    canary_bp: int

    @property
    def weights(self) -> Weights:
        return Weights(self.stable_bp, self.canary_bp)


@dataclass(frozen=True)
class SetShadow:
    """Mirror ``fraction_bp`` of stable's requests to the canary (0: stop mirroring)."""

    fraction_bp: int
    max_in_flight: int = 16
    top_k: int = 10
    rbo_p: float = 0.9


SHADOW_OFF = SetShadow(0)


@dataclass(frozen=True)
class ScaleCanary:
    replicas: int


@dataclass(frozen=True)
class RecordAudit:
    """An audit row. ``key`` is unique per rollout and stable across replays."""

    key: str
    event: str
    message: str


@dataclass(frozen=True)
class Alert:
    severity: Literal["info", "warning", "critical"]
    message: str


@dataclass(frozen=True)
class Finish:
    """The rollout is over and cleaned up; release the model for the next rollout."""

    phase: Phase
    reason: str


Action = (
    SetCanaryTarget
    | SetStableTarget
    | SetWeights
    | SetShadow
    | ScaleCanary
    | RecordAudit
    | Alert
    | Finish
)


# --------------------------------------------------------------------------- helpers


def set_weights(weights: Weights) -> SetWeights:
    return SetWeights(stable_bp=weights.stable_bp, canary_bp=weights.canary_bp)


def step_weights(state: RolloutState, index: int) -> Weights:
    return Weights.with_canary(state.plan.step_bp(index))


def canary_replicas_for(state: RolloutState, canary_bp: int) -> int:
    return state.plan.canary_scaling.replicas_for(canary_bp / 100)


def window_length_s(state: RolloutState, evidence_interval_s: float | None) -> float:
    """The shortest window judged. The sequential judge's evidence stays valid however often
    it is looked at, so it takes each metrics export as it comes (``evidence_interval_s``) and
    acts as soon as a bound is crossed; ``plan.interval_s`` remains the window of display
    (one verdict recorded per interval) and the threshold judge's (and the shadow gate's)
    unit of judgement."""
    interval = state.plan.interval_s
    if (
        state.plan.judge != "sequential"
        or state.phase is Phase.SHADOWING
        or not evidence_interval_s
    ):
        return interval
    return min(interval, evidence_interval_s)


def next_window(
    state: RolloutState, now: float, evidence_interval_s: float | None = None
) -> tuple[float, float] | None:
    """The window the controller should measure now, or None when none is due: it starts
    when the router began applying the current weights (in the shadow phase: mirroring), or at
    the end of the last judged window if later, and must be at least ``window_length_s``
    long."""
    live_at = _live_since(state)
    if live_at is None:
        return None
    start = live_at
    if state.last_analysis_at is not None:
        start = max(start, state.last_analysis_at)
    if now - start < window_length_s(state, evidence_interval_s):
        return None
    return start, now


def held(state: RolloutState, seconds: float) -> RolloutState:
    """``state`` after the controller could not act for ``seconds`` (registry or Serve out of
    reach): the rollout held, so that time does not count against its progress deadlines.
    Windows are untouched: serving went on, and what it measured is still comparable."""
    if seconds <= 0:
        return state
    return dataclasses.replace(
        state,
        verdicts=list(state.verdicts),
        phase_entered_at=state.phase_entered_at + seconds,
        step_entered_at=None if state.step_entered_at is None else state.step_entered_at + seconds,
    )


def after_drift(state: RolloutState) -> RolloutState:
    """``state`` once the controller found Serve's config changed behind its back (the
    canary's target, the pool's size, the router's weight or mirroring: KubeRay resubmitting
    its cached ``serveConfigV2``, an old ``serve deploy``). The canary replicas may be loading
    again, so the router must not send them users or copies until they report ready: the
    canary weight and the mirrored fraction go to 0 (the engine's repair writes that) and are
    kept to be restored then. Windows started under the drifted config are not judged: the
    router has to be seen applying the restored weights first."""
    if state.phase.is_terminal or state.finished:
        return state  # the repair alone puts back stable 100% and the cleaned-up pool
    s = dataclasses.replace(state, verdicts=list(state.verdicts))
    if s.weights.canary_bp > 0:
        s.withdrawn_canary_bp = s.weights.canary_bp
        s.weights = Weights.stable_only()
    s.weights_live_at = None
    if s.shadow_bp > 0:
        s.withdrawn_shadow_bp = s.shadow_bp
        s.shadow_bp = 0
    s.shadow_live_at = None
    return s


def follows_weight_change(state: RolloutState, start: float) -> bool:
    """Whether a window starting at ``start`` begins where the router began applying the
    current weights (or mirroring), rather than where the last judged window ended."""
    live_at = _live_since(state)
    return live_at is not None and start <= live_at


def _live_since(state: RolloutState) -> float | None:
    """Since when the router applies what the current phase measures (None: not yet, or
    nothing to measure)."""
    if state.phase is Phase.SHADOWING:
        return state.shadow_live_at if state.shadow_bp > 0 else None
    if state.phase not in (Phase.PROGRESSING, Phase.PAUSED) or state.weights.canary_bp == 0:
        return None
    return state.weights_live_at


def _is_fresh(
    state: RolloutState, window: WindowStats | None, evidence_interval_s: float | None
) -> bool:
    live_at = _live_since(state)
    if window is None or live_at is None:
        return False
    if window.start < live_at:
        return False  # part of it was measured under other weights (or without mirroring)
    if state.last_analysis_at is not None and window.start < state.last_analysis_at:
        return False  # already judged (a replay) or overlapping the last one
    return window.duration_s >= window_length_s(state, evidence_interval_s)


# --------------------------------------------------------------------------- the tick


class _Tick:
    """One call of ``advance``: a private copy of the state plus the actions so far."""

    def __init__(self, state: RolloutState, obs: Observations, now: float) -> None:
        self.s = dataclasses.replace(state, verdicts=list(state.verdicts))
        self.obs = obs
        self.now = now
        self.actions: list[Action] = []

    # ---- small effects -------------------------------------------------------------------

    def emit(self, action: Action) -> None:
        self.actions.append(action)

    def audit(self, event: str, message: str) -> None:
        self.s.audit_seq += 1
        self.emit(RecordAudit(f"{self.s.rollout_id}/{self.s.audit_seq}", event, message))

    def set_weights(self, weights: Weights) -> None:
        # Weights decided now replace any that a drift withdrew (e.g. promotion finalising).
        self.s.withdrawn_canary_bp = None
        if weights != self.s.weights:
            self.emit(set_weights(weights))
            self.s.weights = weights
            self.s.weights_live_at = None

    def set_shadow(self, action: SetShadow) -> None:
        self.s.withdrawn_shadow_bp = None
        if action.fraction_bp != self.s.shadow_bp:
            self.emit(action)
            self.s.shadow_bp = action.fraction_bp
            self.s.shadow_live_at = None

    def scale_canary(self, replicas: int) -> None:
        if replicas != self.s.canary_replicas:
            self.emit(ScaleCanary(replicas))
            self.s.canary_replicas = replicas

    def enter(self, phase: Phase) -> None:
        self.s.phase = phase
        self.s.phase_entered_at = self.now

    def note_router(self) -> None:
        if self.s.weights_live_at is None and self.obs.router_weights == self.s.weights:
            self.s.weights_live_at = self.now
        if (
            self.s.shadow_bp > 0
            and self.s.shadow_live_at is None
            and self.obs.router_shadow_bp == self.s.shadow_bp
        ):
            self.s.shadow_live_at = self.now

    def overdue(self, since: float | None) -> bool:
        return since is not None and self.now - since > self.s.plan.deadline_s

    def where(self) -> str:
        if self.s.step_index < 0:
            return self.s.phase.value
        # One-based, as `rollout status` shows it ("step 1/4"): events and views must agree.
        steps = len(self.s.plan.steps)
        return f"step {self.s.step_index + 1}/{steps} ({self.s.step_percent:g}%)"

    def restore_after_drift(self) -> None:
        """Set back what ``after_drift`` withdrew, once every canary replica serves the
        candidate again (capacity before traffic)."""
        s = self.s
        if s.withdrawn_canary_bp is None and s.withdrawn_shadow_bp is None:
            return
        if not self.obs.canary.all_ready_on(
            s.candidate_artifact_id, at_least=s.canary_replicas or 1
        ):
            return
        restored = []
        if s.withdrawn_canary_bp is not None:
            self.set_weights(Weights.with_canary(s.withdrawn_canary_bp))
            restored.append(s.weights.describe())
        shadow, bp = s.plan.shadow, s.withdrawn_shadow_bp
        if bp is not None and shadow is not None:
            self.set_shadow(
                SetShadow(
                    bp, max_in_flight=shadow.max_in_flight, top_k=shadow.top_k, rbo_p=shadow.rbo_p
                )
            )
            restored.append(f"mirroring {bp / 100:g}% of stable's requests")
        s.withdrawn_shadow_bp = None
        self.audit(
            "drift_restored",
            f"every canary replica serves {s.candidate_artifact_id} again: "
            + ", ".join(restored or ["nothing to restore"]),
        )

    # ---- withdrawal and cleanup ----------------------------------------------------------

    def withdraw(self, phase: Phase, reason: str) -> None:
        """Every unsuccessful end: stable 100% first, then targets, then bookkeeping."""
        self.emit(set_weights(Weights.stable_only()))
        self.s.weights = Weights.stable_only()
        self.s.weights_live_at = None
        self.s.withdrawn_canary_bp = None
        self.set_shadow(SHADOW_OFF)
        if self.s.stable_target != self.s.baseline_artifact_id:
            self.emit(SetStableTarget(self.s.baseline_artifact_id))
            self.s.stable_target = self.s.baseline_artifact_id
        self.enter(phase)
        self.s.reason = reason
        self.s.pending_gate = None
        self.audit(phase.value, reason)
        severity: Literal["warning", "critical"] = (
            "warning" if phase is Phase.ABORTED else "critical"
        )
        self.emit(Alert(severity, f"rollout {self.s.rollout_id} {phase.value}: {reason}"))

    def cleanup_when_drained(self) -> None:
        """Scale the canary pool down and clear its target once the router routes nothing
        to it, user traffic or mirrored copies (observed before this tick's actions), then
        finish."""
        if self.s.finished or self.obs.router_weights != Weights.stable_only():
            return
        if (self.obs.router_shadow_bp or 0) > 0:
            return  # still mirroring to the canary: copies in flight would hit a cleared pool
        if self.s.weights_live_at is None:
            self.s.weights_live_at = self.now
        if self.s.canary_replicas is not None:  # only a pool this rollout scaled
            self.scale_canary(self.s.plan.canary_scaling.idle_replicas)
        if self.s.canary_target is not None:
            self.emit(SetCanaryTarget(None))
            self.s.canary_target = None
        reason = self.s.reason or self.s.phase.value
        self.audit("finished", f"{self.s.phase.value}: {reason}")
        self.emit(Finish(self.s.phase, reason))
        self.s.finished = True

    # ---- operator commands ---------------------------------------------------------------

    def command(self, cmd: OperatorCommand) -> None:
        phase = self.s.phase
        match cmd:
            case Abort(reason=reason):
                self.withdraw(Phase.ABORTED, reason)
            case Rollback(reason=reason):
                self.withdraw(Phase.ROLLED_BACK, reason)
            case Pause(reason=reason) if phase is Phase.PROGRESSING:
                self.enter(Phase.PAUSED)
                self.s.pending_gate = GATE_OPERATOR
                because = f": {reason}" if reason else ""
                self.audit("paused", f"paused by operator at {self.where()}{because}")
            case Pause() if phase is Phase.PAUSED:
                pass  # already paused: a repeated pause changes nothing
            case Resume() if phase is Phase.PAUSED:
                self.resume()
            case Promote() if phase in (Phase.PROGRESSING, Phase.PAUSED, Phase.SHADOWING):
                self.audit("promote", f"promotion requested by operator at {self.where()}")
                self.start_promotion()
            case _:
                name = type(cmd).__name__.lower()
                self.audit("command_ignored", f"{name} ignored: rollout is {phase.value}")

    def resume(self) -> None:
        gate = self.s.pending_gate
        self.s.pending_gate = None
        self.audit("resumed", f"resumed at {self.where()} (gate {gate})")
        if gate == GATE_PROMOTION:
            self.start_promotion()
            return
        step = gated_step(gate)
        if step is not None:
            self.enter_step(step)
            return
        # An operator pause: back to the same step, with a fresh deadline.
        self.enter(Phase.PROGRESSING)
        self.s.step_entered_at = self.now

    # ---- phases --------------------------------------------------------------------------

    def pending(self) -> None:
        s = self.s
        self.enter(Phase.PREPARING)
        self.audit(
            "started",
            f"rolling out {s.candidate_artifact_id} over {s.baseline_artifact_id} "
            f"for {s.model}, steps {list(s.plan.steps)}",
        )
        self.emit(SetCanaryTarget(s.candidate_artifact_id))
        s.canary_target = s.candidate_artifact_id
        self.scale_canary(canary_replicas_for(s, 0))

    def preparing(self) -> None:
        s = self.s
        failures = self.obs.canary.failures_on(s.candidate_artifact_id)
        if failures:
            first = failures[0]
            self.withdraw(
                Phase.FAILED,
                f"candidate {s.candidate_artifact_id} failed to load on canary replica "
                f"{first.replica_id}: {first.error or 'no error given'}",
            )
            return
        if self.obs.canary.all_ready_on(s.candidate_artifact_id, at_least=s.canary_replicas or 1):
            self.audit("canary_ready", f"every canary replica serves {s.candidate_artifact_id}")
            if s.plan.shadow is not None:
                self.enter_shadow()
            else:
                self.after_step(-1)
            return
        if self.overdue(s.phase_entered_at):
            ready = self.obs.canary.ready_on(s.candidate_artifact_id)
            self.withdraw(
                Phase.FAILED,
                f"canary not ready within the progress deadline "
                f"({s.plan.deadline_s:g}s): {ready} of {s.canary_replicas} replicas "
                f"serve {s.candidate_artifact_id}",
            )

    # ---- the shadow phase ----------------------------------------------------------------

    def enter_shadow(self) -> None:
        s = self.s
        shadow = s.plan.shadow
        assert shadow is not None
        self.enter(Phase.SHADOWING)
        expected = None
        if s.shadow_expected is not None:
            expected = ExpectedDivergence.model_validate(s.shadow_expected)
        s.shadow_evidence = new_shadow_evidence(shadow, expected, s.shadow_basis_note)
        self.set_shadow(
            SetShadow(
                shadow.fraction_bp,
                max_in_flight=shadow.max_in_flight,
                top_k=shadow.top_k,
                rbo_p=shadow.rbo_p,
            )
        )
        self.audit(
            "shadow",
            f"mirroring {shadow.fraction * 100:g}% of stable's requests to the canary "
            f"(no user traffic); gate: {s.shadow_evidence.basis}",
        )

    def shadowing(self) -> None:
        s = self.s
        if self.canary_failed():
            return
        verdict = self.judge_window()
        if s.phase is not Phase.SHADOWING:
            return  # the judge withdrew the rollout
        if verdict is not None and verdict.outcome is Outcome.PASS:
            self.set_shadow(SHADOW_OFF)
            self.audit("shadow_passed", f"shadow: {verdict.summary()}")
            self.after_step(-1)
            return
        if self.overdue(s.phase_entered_at):
            ev = s.shadow_evidence
            seen = (
                f"{ev.compared} copies compared, {ev.dropped} dropped, {ev.errors} unanswered"
                if ev is not None
                else "nothing compared"
            )
            self.withdraw(
                Phase.ROLLED_BACK,
                f"shadow comparison not conclusive within the progress deadline "
                f"({s.plan.deadline_s:g}s): {seen}; router "
                f"{'confirmed' if s.shadow_live_at is not None else 'not confirmed'} mirroring",
            )

    def after_step(self, index: int) -> None:
        """Step ``index`` is done (-1: preparation): next step, a gate, or promotion."""
        plan = self.s.plan
        following = index + 1
        if following < len(plan.steps):
            if plan.gate_before_step(following):
                self.pause_at_gate(
                    step_gate(following), f"before step {following + 1}/{len(plan.steps)}"
                )
            else:
                self.enter_step(following)
        elif plan.gates.pause_before_promotion:
            self.pause_at_gate(GATE_PROMOTION, "before promotion")
        else:
            self.start_promotion()

    def pause_at_gate(self, gate: str, where: str) -> None:
        self.enter(Phase.PAUSED)
        self.s.pending_gate = gate
        self.audit("paused", f"paused at the gate {where}; {self.s.weights.describe()}")

    def enter_step(self, index: int) -> None:
        s = self.s
        self.enter(Phase.PROGRESSING)
        s.step_index = index
        s.step_entered_at = self.now
        s.inconclusive_windows = 0
        self.audit("step", f"entering {self.where()}")

    def progressing(self) -> None:
        s = self.s
        if self.canary_failed():
            return
        wanted = step_weights(s, s.step_index)
        if s.weights != wanted:
            self.converge_canary_to(wanted)
        elif s.weights_live_at is not None:
            verdict = self.judge_window()
            if verdict is not None and verdict.outcome is Outcome.PASS:
                self.after_step(s.step_index)
                return
        if s.phase is Phase.PROGRESSING and self.overdue(s.step_entered_at):
            self.withdraw(
                Phase.ROLLED_BACK,
                f"no progress at {self.where()} within the progress deadline "
                f"({s.plan.deadline_s:g}s): {s.inconclusive_windows} inconclusive "
                f"windows, {s.failed_checks} failed checks, "
                f"router {'confirmed' if s.weights_live_at is not None else 'not confirmed'} "
                f"{s.weights.describe()}",
            )

    def paused(self) -> None:
        # Windows are still judged: a failing canary is rolled back even while held.
        if self.canary_failed():
            return
        self.judge_window()

    def converge_canary_to(self, wanted: Weights) -> bool:
        """Scale the canary pool for ``wanted`` and, once its replicas are ready, set the
        weights. True when the weights have been set."""
        s = self.s
        needed = max(s.canary_replicas or 0, canary_replicas_for(s, wanted.canary_bp))
        self.scale_canary(needed)
        if not self.obs.canary.all_ready_on(s.candidate_artifact_id, at_least=needed):
            return False
        self.set_weights(wanted)
        return True

    def canary_failed(self) -> bool:
        failures = self.obs.canary.failures_on(self.s.candidate_artifact_id)
        if not failures:
            return False
        first = failures[0]
        self.withdraw(
            Phase.ROLLED_BACK,
            f"canary replica {first.replica_id} failed on {self.s.candidate_artifact_id} at "
            f"{self.where()}: {first.error or 'no error given'}",
        )
        return True

    def judge_window(self) -> Verdict | None:
        s = self.s
        window = self.obs.window
        if not _is_fresh(s, window, self.obs.evidence_interval_s):
            return None
        assert window is not None
        judged = judging.judge_window(s, window)
        verdict, s.evidence, s.shadow_evidence = judged.verdict, judged.sequential, judged.shadow
        s.last_analysis_at = window.end
        if s.display_since is None:
            s.display_since = window.start
        # Evidence may come at every metrics export; the record and the audit log show one
        # verdict per plan interval, and every decision at once.
        shown = (
            verdict.outcome is not Outcome.INCONCLUSIVE
            or window.end - s.display_since >= s.plan.interval_s
        )
        if shown:
            s.display_since = None
            s.verdicts.append(
                VerdictRecord(
                    window_end=window.end,
                    step_index=s.step_index,
                    canary_bp=s.weights.canary_bp,
                    outcome=verdict.outcome,
                    reasons=verdict.reasons,
                    evidence=judged.evidence,
                )
            )
            del s.verdicts[:-VERDICT_HISTORY]
            self.audit("analysis", f"{self.where()}: {verdict.summary()}")
        if s.evidence is not None and not s.evidence.mismatch_alerted:
            mismatch = next((c for c in verdict.checks if c.name == SAMPLE_RATIO), None)
            if mismatch is not None:
                s.evidence.mismatch_alerted = True
                self.audit("sample_ratio_mismatch", f"{self.where()}: {mismatch.reason}")
                self.emit(Alert("warning", f"rollout {s.rollout_id}: {mismatch.reason}"))
        if verdict.outcome is Outcome.PASS:
            s.failed_checks = 0
        elif verdict.outcome is Outcome.INCONCLUSIVE and shown:
            s.inconclusive_windows += 1
        elif verdict.outcome is Outcome.FAIL:
            s.failed_checks += 1
            reason = judging.rollback_reason(s, verdict, self.where())
            if reason is not None:
                self.withdraw(Phase.ROLLED_BACK, reason)
        return verdict

    def start_promotion(self) -> None:
        s = self.s
        self.set_shadow(SHADOW_OFF)  # an operator's promote during the shadow phase
        self.enter(Phase.PROMOTING)
        s.pending_gate = None
        strategy = s.plan.promotion
        backbone = self.shared_backbone()
        if backbone is not None and s.plan.head_swap != "never":
            if self.obs.in_place_fits is True:
                strategy = "in_place"
                self.audit(
                    "promotion_strategy",
                    f"only the head changes (both run on backbone {backbone}) and the memory "
                    "budget allows it: swapping the head in place",
                )
            elif s.plan.head_swap == "require":
                self.withdraw(
                    Phase.FAILED,
                    f"the plan requires an in-place head swap (head_swap: require) and the "
                    f"memory budget does not allow one (observed {self.obs.in_place_fits})",
                )
                return
        if strategy == "in_place" and self.obs.in_place_fits is not True:
            strategy = "shift"
            self.audit(
                "promotion_strategy",
                "in-place swap not allowed by the memory budget "
                f"(observed {self.obs.in_place_fits}); promoting by shift",
            )
        s.promotion_strategy = strategy
        self.audit("promoting", f"promoting {s.candidate_artifact_id} by {strategy}")

    def shared_backbone(self) -> str | None:
        """The backbone of a head-only change: every canary replica serving the candidate
        and every stable replica run on this one backbone (None: not such a change, or not
        observed)."""
        candidate = self.obs.canary.backbones_on(self.s.candidate_artifact_id)
        stable = self.obs.stable.backbones_on()
        if len(candidate) != 1 or candidate != stable:
            return None
        return next(iter(candidate))

    def promoting(self) -> None:
        s = self.s
        candidate = s.candidate_artifact_id
        if s.promotion_strategy == "shift":
            if s.weights != Weights.canary_only():
                self.converge_canary_to(Weights.canary_only())
                self.promotion_deadline()
                return
            if s.weights_live_at is None:
                self.promotion_deadline()
                return
        if s.stable_target != candidate:
            self.emit(SetStableTarget(candidate))
            s.stable_target = candidate
            return
        failures = self.obs.stable.failures_on(candidate)
        if failures:
            first = failures[0]
            self.withdraw(
                Phase.FAILED,
                f"promotion failed: stable replica {first.replica_id} could not load "
                f"{candidate}: {first.error or 'no error given'}",
            )
            return
        if self.obs.stable.all_ready_on(candidate):
            self.enter(Phase.FINALISING)
            self.audit("finalising", f"every stable replica serves {candidate}")
            self.set_weights(Weights.stable_only())
            return
        self.promotion_deadline()

    def promotion_deadline(self) -> None:
        s = self.s
        if self.overdue(s.phase_entered_at):
            self.withdraw(
                Phase.FAILED,
                f"promotion ({s.promotion_strategy}) not complete within the progress deadline "
                f"({s.plan.deadline_s:g}s): "
                f"{self.obs.stable.ready_on(s.candidate_artifact_id)} stable replicas serve "
                f"{s.candidate_artifact_id}; {s.weights.describe()}",
            )

    def finalising(self) -> None:
        s = self.s
        if s.weights_live_at is not None:
            self.enter(Phase.SUCCEEDED)
            s.reason = f"{s.candidate_artifact_id} promoted to stable"
            self.cleanup_when_drained()

    # ---- the tick ------------------------------------------------------------------------

    def run(self) -> None:
        s = self.s
        if s.finished:
            return
        if not s.phase.is_terminal:
            for cmd in self.obs.commands:
                self.command(cmd)
                if s.phase.is_terminal:
                    break
        if not s.phase.is_terminal:
            self.restore_after_drift()
            self.note_router()
        handlers = {
            Phase.PENDING: self.pending,
            Phase.PREPARING: self.preparing,
            Phase.SHADOWING: self.shadowing,
            Phase.PROGRESSING: self.progressing,
            Phase.PAUSED: self.paused,
            Phase.PROMOTING: self.promoting,
            Phase.FINALISING: self.finalising,
        }
        # Run to quiescence: a handler that moves the rollout on (ready -> step 0, a passing
        # window -> next step, last step -> promotion) hands over to the next handler in the
        # same tick. Each handler runs at most once per position, so this terminates.
        for _ in range(len(handlers) + len(s.plan.steps) + 1):
            if s.phase.is_terminal:
                break
            position = (s.phase, s.step_index, s.pending_gate)
            handlers[s.phase]()
            if (s.phase, s.step_index, s.pending_gate) == position:
                break
        if s.phase.is_terminal:
            self.cleanup_when_drained()


def advance(
    state: RolloutState, observations: Observations, now: float
) -> tuple[RolloutState, list[Action]]:
    """One tick: the next state and the actions to carry out, in order. ``state`` is not
    modified."""
    tick = _Tick(state, observations, now)
    tick.run()
    return tick.s, tick.actions


__all__ = [
    "Abort",
    "Action",
    "Alert",
    "Finish",
    "Observations",
    "OperatorCommand",
    "Pause",
    "PoolView",
    "Promote",
    "RecordAudit",
    "ReplicaObservation",
    "Resume",
    "Rollback",
    "ScaleCanary",
    "SetCanaryTarget",
    "SetShadow",
    "SetStableTarget",
    "SetWeights",
    "advance",
    "after_drift",
    "canary_replicas_for",
    "next_window",
    "step_weights",
]
