"""The rollout state machine, stepped one tick at a time with a fake clock.

Each scenario is a timeline: ``t=`` is the fake clock passed as ``now``, the observations are
what the controller would have seen just before that tick, and every tick asserts the exact
actions, then the phase and the weights. On a failed assertion the driver's history (every
tick's observations, actions and resulting phase) is part of the message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.contracts import ReplicaPhase
from rollout.analysis import CohortStats, Outcome, WindowStats
from rollout.machine import (
    Abort,
    Action,
    Alert,
    Finish,
    Observations,
    Pause,
    PoolView,
    Promote,
    RecordAudit,
    ReplicaObservation,
    Resume,
    Rollback,
    ScaleCanary,
    SetCanaryTarget,
    SetStableTarget,
    SetWeights,
    advance,
    after_drift,
    held,
    next_window,
)
from rollout.plan import RolloutPlan
from rollout.state import Phase, RolloutState, Weights

V41, V42 = "ranker-v41", "ranker-v42"

# 5% -> 25% -> 50%; the canary pool is 1 replica up to 25%, 2 at 50%, 4 at 100%. The machine's
# own rules are tested with the threshold judge (one window decides a verdict); the sequential
# judge's place in the machine is tested in test_sequential.py.
PLAN = RolloutPlan(
    judge="threshold",
    steps=(5, 25, 50),
    interval_s=60,
    min_requests=100,
    threshold=3,
    progress_deadline_s=300,
    canary_scaling={"min_replicas": 1, "max_replicas": 4, "idle_replicas": 1},
)

STABLE_ONLY = Weights.stable_only()


def w(canary_percent: float) -> Weights:
    return Weights.with_canary(round(canary_percent * 100))


def weights(canary_percent: float) -> SetWeights:
    return SetWeights(10_000 - round(canary_percent * 100), round(canary_percent * 100))


# ---- observations -----------------------------------------------------------------------


def pool(*reports: ReplicaObservation, expected: int | None = None) -> PoolView:
    return PoolView(reports, len(reports) if expected is None else expected)


def ready(artifact: str, n: int, prefix: str = "r") -> PoolView:
    return pool(
        *(
            ReplicaObservation(f"{prefix}{i}", artifact, artifact, ReplicaPhase.READY)
            for i in range(n)
        )
    )


def loading(artifact: str, n: int, serving: str | None = None) -> PoolView:
    return pool(
        *(ReplicaObservation(f"r{i}", artifact, serving, ReplicaPhase.LOADING) for i in range(n))
    )


def healthy(requests: int = 1000, errors: int = 0, p99: float = 40.0) -> CohortStats:
    return CohortStats(requests, {"error": errors} if errors else {}, p50_ms=10.0, p99_ms=p99)


def window(start: float, end: float, canary: CohortStats | None = None) -> WindowStats:
    return WindowStats(start, end, canary or healthy(200), healthy(4000))


def failing_window(start: float, end: float) -> WindowStats:
    # 10% errors against a clean baseline: fails the success-rate and relative checks.
    return window(start, end, healthy(200, errors=20))


def thin_window(start: float, end: float) -> WindowStats:
    return window(start, end, healthy(12))


# ---- matchers for the audit and alert actions (their wording is not the contract) ---------


@dataclass(frozen=True, eq=False)
class Audit:
    event: str
    contains: str = ""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RecordAudit)
            and other.event == self.event
            and self.contains in other.message
        )

    def __hash__(self) -> int:
        return hash(self.event)


@dataclass(frozen=True, eq=False)
class AlertOf:
    severity: str
    contains: str = ""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Alert)
            and other.severity == self.severity
            and self.contains in other.message
        )

    def __hash__(self) -> int:
        return hash(self.severity)


@dataclass(frozen=True, eq=False)
class FinishOf:
    phase: Phase
    contains: str = ""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Finish)
            and other.phase is self.phase
            and self.contains in other.reason
        )

    def __hash__(self) -> int:
        return hash(self.phase)


# ---- the driver -------------------------------------------------------------------------


@dataclass
class Driver:
    state: RolloutState
    history: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, plan: RolloutPlan = PLAN, now: float = 0.0) -> Driver:
        return cls(
            RolloutState.new(
                plan,
                rollout_id="ro-1",
                model="ranker",
                candidate_artifact_id=V42,
                baseline_artifact_id=V41,
                now=now,
            )
        )

    def tick(self, t: float, **observed: Any) -> list[Action]:
        obs = Observations(**observed)
        self.state, actions = advance(self.state, obs, t)
        self.history.append(
            f"t={t}: {obs}\n  -> {actions}\n  => {self.state.phase.value} "
            f"step={self.state.step_index} {self.state.weights.describe()}"
        )
        return actions

    def dump(self) -> str:
        return "\n".join(self.history)

    def expect(
        self,
        actions: Sequence[Action],
        expected: Sequence[object],
        phase: Phase,
        weights: Weights,
        step: int | None = None,
    ) -> None:
        assert list(actions) == list(expected), self.dump()
        assert self.state.phase is phase, self.dump()
        assert self.state.weights == weights, self.dump()
        if step is not None:
            assert self.state.step_index == step, self.dump()


def drive_to_step(d: Driver, step: int) -> float:
    """Happy path up to the router confirming ``step``'s weights; returns the clock."""
    d.tick(0, router_weights=STABLE_ONLY)
    d.tick(20, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    t = 25.0
    d.tick(t, canary=ready(V42, 1), router_weights=w(PLAN.steps[0]))
    for index in range(1, step + 1):
        replicas = PLAN.canary_scaling.replicas_for(PLAN.steps[index])
        before = w(PLAN.steps[index - 1])
        t += 60
        d.tick(t, canary=ready(V42, 1), router_weights=before, window=window(t - 60, t))
        if d.state.weights != w(PLAN.steps[index]):  # the pool had to grow first
            t += 5
            d.tick(t, canary=ready(V42, replicas), router_weights=before)
        t += 5
        d.tick(t, canary=ready(V42, replicas), router_weights=w(PLAN.steps[index]))
    assert d.state.phase is Phase.PROGRESSING and d.state.step_index == step, d.dump()
    assert d.state.weights_live_at == t, d.dump()
    return t


# ---- the happy paths --------------------------------------------------------------------


def test_full_rollout_promoted_by_shift() -> None:
    d = Driver.start()
    # t=0 pending: the canary pool gets the candidate as its target, at its minimum size.
    acts = d.tick(0, router_weights=STABLE_ONLY)
    d.expect(
        acts, [Audit("started"), SetCanaryTarget(V42), ScaleCanary(1)], Phase.PREPARING, STABLE_ONLY
    )
    # t=10 the canary replica is still loading: hold, no traffic.
    acts = d.tick(10, canary=loading(V42, 1), router_weights=STABLE_ONLY)
    d.expect(acts, [], Phase.PREPARING, STABLE_ONLY)
    # t=20 every canary replica serves the candidate: step 1/3, 5% to the canary.
    acts = d.tick(20, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [Audit("canary_ready"), Audit("step", "step 1/3 (5%)"), weights(5)],
        Phase.PROGRESSING,
        w(5),
        step=0,
    )
    assert next_window(d.state, 200) is None  # the router has not confirmed 95/5 yet
    # t=25 the router applies 95/5: windows start now.
    acts = d.tick(25, canary=ready(V42, 1), router_weights=w(5))
    d.expect(acts, [], Phase.PROGRESSING, w(5), step=0)
    assert next_window(d.state, 84) is None
    assert next_window(d.state, 85) == (25, 85)
    # t=85 a full healthy window: step 1, 25% (one replica still enough).
    acts = d.tick(85, canary=ready(V42, 1), router_weights=w(5), window=window(25, 85))
    d.expect(
        acts,
        [Audit("analysis", "pass"), Audit("step", "step 2/3 (25%)"), weights(25)],
        Phase.PROGRESSING,
        w(25),
        step=1,
    )
    assert d.state.verdicts[-1].outcome is Outcome.PASS
    # t=90 router at 75/25.
    acts = d.tick(90, canary=ready(V42, 1), router_weights=w(25))
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=1)
    # t=150 a healthy window: step 3/3 (50%) needs 2 canary replicas BEFORE the weight moves.
    acts = d.tick(150, canary=ready(V42, 1), router_weights=w(25), window=window(90, 150))
    d.expect(
        acts,
        [Audit("analysis", "pass"), Audit("step", "step 3/3 (50%)"), ScaleCanary(2)],
        Phase.PROGRESSING,
        w(25),
        step=2,
    )
    # t=155 the second replica is still loading: the weight stays at 25%.
    acts = d.tick(
        155, canary=pool(*ready(V42, 1).replicas, *loading(V42, 1).replicas), router_weights=w(25)
    )
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=2)
    # t=160 both ready: 50/50.
    acts = d.tick(160, canary=ready(V42, 2), router_weights=w(25))
    d.expect(acts, [weights(50)], Phase.PROGRESSING, w(50), step=2)
    acts = d.tick(165, canary=ready(V42, 2), router_weights=w(50))
    d.expect(acts, [], Phase.PROGRESSING, w(50), step=2)
    # t=225 the last step passes: promotion by shift; the canary pool grows to carry 100%.
    acts = d.tick(225, canary=ready(V42, 2), router_weights=w(50), window=window(165, 225))
    d.expect(
        acts,
        [Audit("analysis", "pass"), Audit("promoting", "shift"), ScaleCanary(4)],
        Phase.PROMOTING,
        w(50),
    )
    # t=235 four canary replicas ready: the canary takes everything.
    acts = d.tick(235, canary=ready(V42, 4), router_weights=w(50))
    d.expect(acts, [weights(100)], Phase.PROMOTING, w(100))
    # t=240 the router confirms 0/100: only now does stable get the candidate (no traffic).
    acts = d.tick(240, canary=ready(V42, 4), stable=ready(V41, 3), router_weights=w(100))
    d.expect(acts, [SetStableTarget(V42)], Phase.PROMOTING, w(100))
    # t=250 stable loading; t=255 two of three ready: hold.
    acts = d.tick(250, canary=ready(V42, 4), stable=loading(V42, 3, V41), router_weights=w(100))
    d.expect(acts, [], Phase.PROMOTING, w(100))
    two_of_three = pool(*ready(V42, 2, "s").replicas, *loading(V42, 1, V41).replicas)
    acts = d.tick(255, canary=ready(V42, 4), stable=two_of_three, router_weights=w(100))
    d.expect(acts, [], Phase.PROMOTING, w(100))
    # t=260 every stable replica serves the candidate: traffic returns to stable.
    acts = d.tick(260, canary=ready(V42, 4), stable=ready(V42, 3), router_weights=w(100))
    d.expect(acts, [Audit("finalising"), weights(0)], Phase.FINALISING, STABLE_ONLY)
    # t=265 the router confirms stable 100%: the canary pool is cleared and scaled to idle.
    acts = d.tick(265, canary=ready(V42, 4), stable=ready(V42, 3), router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [ScaleCanary(1), SetCanaryTarget(None), Audit("finished"), FinishOf(Phase.SUCCEEDED, V42)],
        Phase.SUCCEEDED,
        STABLE_ONLY,
    )
    assert d.state.finished and not d.state.is_active
    assert (d.state.stable_target, d.state.canary_target) == (V42, None)
    # t=300 a finished rollout does nothing more.
    assert d.tick(300, router_weights=STABLE_ONLY) == []


def test_full_rollout_promoted_in_place_when_the_budget_allows() -> None:
    plan = PLAN.model_copy(update={"promotion": "in_place"})
    d = Driver.start(plan)
    t = drive_to_step(d, 2)  # 50/50, router confirmed
    # The last step passes and the budget allows double-buffering: stable hot-swaps while
    # it keeps serving its 50%.
    acts = d.tick(
        t + 60,
        canary=ready(V42, 2),
        router_weights=w(50),
        window=window(t, t + 60),
        in_place_fits=True,
    )
    d.expect(
        acts,
        [Audit("analysis"), Audit("promoting", "in_place"), SetStableTarget(V42)],
        Phase.PROMOTING,
        w(50),
    )
    acts = d.tick(t + 70, stable=loading(V42, 3, V41), router_weights=w(50))
    d.expect(acts, [], Phase.PROMOTING, w(50))
    acts = d.tick(t + 80, stable=ready(V42, 3), router_weights=w(50))
    d.expect(acts, [Audit("finalising"), weights(0)], Phase.FINALISING, STABLE_ONLY)
    acts = d.tick(t + 85, stable=ready(V42, 3), router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [ScaleCanary(1), SetCanaryTarget(None), Audit("finished"), FinishOf(Phase.SUCCEEDED)],
        Phase.SUCCEEDED,
        STABLE_ONLY,
    )


def test_in_place_falls_back_to_shift_when_the_budget_does_not_fit() -> None:
    plan = PLAN.model_copy(update={"promotion": "in_place"})
    d = Driver.start(plan)
    t = drive_to_step(d, 2)
    acts = d.tick(
        t + 60,
        canary=ready(V42, 2),
        router_weights=w(50),
        window=window(t, t + 60),
        in_place_fits=False,
    )
    d.expect(
        acts,
        [
            Audit("analysis"),
            Audit("promotion_strategy"),
            Audit("promoting", "shift"),
            ScaleCanary(4),
        ],
        Phase.PROMOTING,
        w(50),
    )
    assert d.state.promotion_strategy == "shift"


def on_backbone(artifact: str, backbone: str | None, n: int, prefix: str = "r") -> PoolView:
    return pool(
        *(
            ReplicaObservation(
                f"{prefix}{i}", artifact, artifact, ReplicaPhase.READY, actual_backbone_id=backbone
            )
            for i in range(n)
        )
    )


def test_a_head_only_change_is_swapped_in_place_though_the_plan_says_shift() -> None:
    d = Driver.start(PLAN)  # promotion: shift, head_swap: prefer
    t = drive_to_step(d, 2)
    acts = d.tick(
        t + 60,
        canary=on_backbone(V42, "rb-1", 2),
        stable=on_backbone(V41, "rb-1", 3, prefix="s"),
        router_weights=w(50),
        window=window(t, t + 60),
        in_place_fits=True,
    )
    d.expect(
        acts,
        [
            Audit("analysis"),
            Audit("promotion_strategy", "backbone rb-1"),
            Audit("promoting", "in_place"),
            SetStableTarget(V42),
        ],
        Phase.PROMOTING,
        w(50),
    )


@pytest.mark.parametrize(
    "canary_backbone, stable_backbone, head_swap, fits",
    [
        ("rb-2", "rb-1", "prefer", True),  # another backbone: not a head-only change
        (None, None, "prefer", True),  # whole models
        ("rb-1", "rb-1", "never", True),  # the plan leaves it to `promotion`
        ("rb-1", "rb-1", "prefer", False),  # no room: shift as planned
    ],
)
def test_only_a_head_only_change_with_room_overrides_the_planned_shift(
    canary_backbone: str | None, stable_backbone: str | None, head_swap: str, fits: bool
) -> None:
    d = Driver.start(PLAN.model_copy(update={"head_swap": head_swap}))
    t = drive_to_step(d, 2)
    acts = d.tick(
        t + 60,
        canary=on_backbone(V42, canary_backbone, 2),
        stable=on_backbone(V41, stable_backbone, 3, prefix="s"),
        router_weights=w(50),
        window=window(t, t + 60),
        in_place_fits=fits,
    )
    d.expect(
        acts,
        [Audit("analysis"), Audit("promoting", "shift"), ScaleCanary(4)],
        Phase.PROMOTING,
        w(50),
    )


def test_a_required_head_swap_the_budget_refuses_fails_the_rollout_instead_of_shifting() -> None:
    d = Driver.start(PLAN.model_copy(update={"head_swap": "require"}))
    t = drive_to_step(d, 2)
    acts = d.tick(
        t + 60,
        canary=on_backbone(V42, "rb-1", 2),
        stable=on_backbone(V41, "rb-1", 3, prefix="s"),
        router_weights=w(50),
        window=window(t, t + 60),
        in_place_fits=False,
    )
    assert weights(0) in acts, d.dump()
    assert d.state.phase is Phase.FAILED, d.dump()
    assert "head_swap: require" in (d.state.reason or ""), d.dump()
    assert SetStableTarget(V42) not in acts


# ---- gates and operator commands ----------------------------------------------------------


def test_gate_before_a_step_holds_until_resume_and_promote_skips_the_rest() -> None:
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "gates": {"pause_before_steps": [25]}})
    d = Driver.start(plan)
    t = drive_to_step(d, 0)  # 5%, router confirmed at t=25
    # t=85 step 1/3 passes; step 2/3 is gated: paused at 5%.
    acts = d.tick(85, canary=ready(V42, 1), router_weights=w(5), window=window(t, 85))
    d.expect(
        acts,
        [Audit("analysis", "pass"), Audit("paused", "before step 2/3")],
        Phase.PAUSED,
        w(5),
        step=0,
    )
    assert d.state.pending_gate == "step:1"
    # t=145 still judged while paused: a pass changes nothing, time passes without a deadline.
    acts = d.tick(145, canary=ready(V42, 1), router_weights=w(5), window=window(85, 145))
    d.expect(acts, [Audit("analysis", "pass")], Phase.PAUSED, w(5), step=0)
    acts = d.tick(1000, canary=ready(V42, 1), router_weights=w(5))
    d.expect(acts, [], Phase.PAUSED, w(5), step=0)
    # t=1010 a repeated pause is a no-op; resume opens the gate: step 1 at 25%.
    acts = d.tick(1010, canary=ready(V42, 1), router_weights=w(5), commands=(Pause(), Resume()))
    d.expect(
        acts,
        [Audit("resumed"), Audit("step", "step 2/3 (25%)"), weights(25)],
        Phase.PROGRESSING,
        w(25),
        step=1,
    )
    # t=1015 the operator promotes: the remaining step (50%) is skipped.
    acts = d.tick(1015, canary=ready(V42, 1), router_weights=w(25), commands=(Promote(),))
    d.expect(
        acts,
        [Audit("promote"), Audit("promoting", "shift"), ScaleCanary(4)],
        Phase.PROMOTING,
        w(25),
    )


def test_pause_before_promotion_then_resume_promotes() -> None:
    plan = RolloutPlan.model_validate(
        {**PLAN.model_dump(), "gates": {"pause_before_promotion": True}}
    )
    d = Driver.start(plan)
    t = drive_to_step(d, 2)
    acts = d.tick(t + 60, canary=ready(V42, 2), router_weights=w(50), window=window(t, t + 60))
    d.expect(acts, [Audit("analysis"), Audit("paused", "before promotion")], Phase.PAUSED, w(50))
    assert d.state.pending_gate == "promotion"
    acts = d.tick(t + 90, canary=ready(V42, 2), router_weights=w(50), commands=(Resume(),))
    d.expect(acts, [Audit("resumed"), Audit("promoting"), ScaleCanary(4)], Phase.PROMOTING, w(50))


def test_operator_pause_holds_and_resume_restarts_the_deadline() -> None:
    d = Driver.start()
    t = drive_to_step(d, 1)  # 25%, confirmed at t=90
    acts = d.tick(100, canary=ready(V42, 1), router_weights=w(25), commands=(Pause("look"),))
    d.expect(acts, [Audit("paused", "operator")], Phase.PAUSED, w(25), step=1)
    # Far past the deadline while paused: nothing happens.
    acts = d.tick(t + 5000, canary=ready(V42, 1), router_weights=w(25))
    d.expect(acts, [], Phase.PAUSED, w(25), step=1)
    acts = d.tick(t + 5010, canary=ready(V42, 1), router_weights=w(25), commands=(Resume(),))
    d.expect(acts, [Audit("resumed")], Phase.PROGRESSING, w(25), step=1)
    assert d.state.step_entered_at == t + 5010
    # The deadline counts from the resume: 300 s later, not before.
    acts = d.tick(t + 5300, canary=ready(V42, 1), router_weights=w(25))
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=1)
    acts = d.tick(t + 5311, canary=ready(V42, 1), router_weights=w(25))
    d.expect(
        acts,
        [weights(0), Audit("rolled_back", "progress deadline"), AlertOf("critical")],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )


def test_commands_that_do_not_apply_are_audited_and_ignored() -> None:
    d = Driver.start()
    d.tick(0, router_weights=STABLE_ONLY)
    acts = d.tick(
        5,
        canary=loading(V42, 1),
        router_weights=STABLE_ONLY,
        commands=(Promote(), Resume(), Pause()),
    )
    d.expect(
        acts,
        [
            Audit("command_ignored", "promote ignored: rollout is preparing"),
            Audit("command_ignored", "resume"),
            Audit("command_ignored", "pause"),
        ],
        Phase.PREPARING,
        STABLE_ONLY,
    )


# ---- analysis outcomes --------------------------------------------------------------------


def test_inconclusive_windows_hold_then_the_progress_deadline_rolls_back() -> None:
    d = Driver.start()
    drive_to_step(d, 1)  # 25%, step entered at t=85, router confirmed at t=90
    # Too few canary requests in each window: hold at 25%, never a failure.
    for start in (90, 150, 210, 270):
        acts = d.tick(
            start + 60,
            canary=ready(V42, 1),
            router_weights=w(25),
            window=thin_window(start, start + 60),
        )
        d.expect(acts, [Audit("analysis", "inconclusive")], Phase.PROGRESSING, w(25), step=1)
    assert (d.state.inconclusive_windows, d.state.failed_checks) == (4, 0)
    assert "canary served 12 requests, 100 needed" in d.state.verdicts[-1].reasons
    # t=385 = step entered (85) + deadline (300): not yet past it.
    acts = d.tick(385, canary=ready(V42, 1), router_weights=w(25))
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=1)
    # t=386 past the deadline: weights to stable FIRST, then bookkeeping.
    acts = d.tick(386, canary=ready(V42, 1), router_weights=w(25))
    d.expect(
        acts,
        [
            weights(0),
            Audit("rolled_back", "4 inconclusive windows"),
            AlertOf("critical", "progress deadline"),
        ],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )
    assert d.state.is_active  # the canary pool is not cleaned up until the router confirms
    acts = d.tick(390, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [
            SetCanaryTarget(None),
            Audit("finished"),
            FinishOf(Phase.ROLLED_BACK, "progress deadline"),
        ],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )
    assert not d.state.is_active


def test_time_held_without_registry_or_serve_does_not_count_against_the_deadline() -> None:
    d = Driver.start()
    drive_to_step(d, 1)  # step 1 entered at t=85: its deadline would pass at t=385
    before = d.state
    # The controller could not act from t=100 to t=400: the rollout held for 300 s.
    d.state = held(d.state, 300)
    assert d.state.step_entered_at == before.step_entered_at + 300
    assert d.state.phase_entered_at == before.phase_entered_at + 300
    assert d.state.weights_live_at == before.weights_live_at  # serving went on: windows count
    assert before.step_entered_at == 85  # the original is untouched
    acts = d.tick(685, canary=ready(V42, 1), router_weights=w(25))
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=1)
    # The window measured across the hold is judged as any other.
    acts = d.tick(686, canary=ready(V42, 1), router_weights=w(25), window=window(90, 686))
    assert d.state.step_index == 2, d.dump()
    assert held(d.state, 0) is d.state


def test_a_hold_does_not_save_a_rollout_already_past_its_deadline() -> None:
    d = Driver.start()
    drive_to_step(d, 1)
    d.tick(390, canary=ready(V42, 1), router_weights=w(25))  # past 85 + 300
    assert d.state.phase is Phase.ROLLED_BACK, d.dump()
    d.state = held(d.state, 1000)
    acts = d.tick(400, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    assert d.state.phase is Phase.ROLLED_BACK and not d.state.is_active, d.dump()
    assert any(isinstance(a, Finish) for a in acts), d.dump()


def test_failed_checks_below_threshold_hold_and_a_pass_resets_them() -> None:
    # Semantics: threshold counts CONSECUTIVE failed windows; a pass resets the
    # count and completes the step, an inconclusive window leaves the count alone.
    d = Driver.start()
    t = drive_to_step(d, 0)  # 5%, confirmed at t=25
    acts = d.tick(
        t + 60, canary=ready(V42, 1), router_weights=w(5), window=failing_window(t, t + 60)
    )
    d.expect(acts, [Audit("analysis", "fail")], Phase.PROGRESSING, w(5), step=0)
    acts = d.tick(
        t + 120, canary=ready(V42, 1), router_weights=w(5), window=failing_window(t + 60, t + 120)
    )
    d.expect(acts, [Audit("analysis", "fail")], Phase.PROGRESSING, w(5), step=0)
    acts = d.tick(
        t + 180, canary=ready(V42, 1), router_weights=w(5), window=thin_window(t + 120, t + 180)
    )
    d.expect(acts, [Audit("analysis", "inconclusive")], Phase.PROGRESSING, w(5), step=0)
    assert d.state.failed_checks == 2
    acts = d.tick(
        t + 240, canary=ready(V42, 1), router_weights=w(5), window=window(t + 180, t + 240)
    )
    d.expect(
        acts,
        [Audit("analysis", "pass"), Audit("step"), weights(25)],
        Phase.PROGRESSING,
        w(25),
        step=1,
    )
    assert d.state.failed_checks == 0


def test_failed_checks_at_threshold_roll_back_weights_first() -> None:
    d = Driver.start()
    t = drive_to_step(d, 2)  # 50/50, 2 canary replicas
    for i in range(2):
        start = t + 60 * i
        acts = d.tick(
            start + 60,
            canary=ready(V42, 2),
            router_weights=w(50),
            window=failing_window(start, start + 60),
        )
        d.expect(acts, [Audit("analysis", "fail")], Phase.PROGRESSING, w(50), step=2)
    start = t + 120
    acts = d.tick(
        start + 60,
        canary=ready(V42, 2),
        router_weights=w(50),
        window=failing_window(start, start + 60),
    )
    d.expect(
        acts,
        [
            Audit("analysis", "fail"),
            weights(0),
            Audit("rolled_back", "3 consecutive failed checks"),
            AlertOf("critical", "canary success rate 90.00%"),
        ],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )
    # The first action that changes anything is the weight change.
    assert next(a for a in acts if not isinstance(a, RecordAudit)) == weights(0)
    assert "canary error rate 10.00% > allowed 1.00%" in d.state.reason
    acts = d.tick(start + 65, canary=ready(V42, 2), router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [ScaleCanary(1), SetCanaryTarget(None), Audit("finished"), FinishOf(Phase.ROLLED_BACK)],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )


def test_a_failing_canary_is_rolled_back_even_while_paused() -> None:
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "threshold": 1})
    d = Driver.start(plan)
    t = drive_to_step(d, 1)
    d.tick(t + 1, canary=ready(V42, 1), router_weights=w(25), commands=(Pause(),))
    acts = d.tick(
        t + 60, canary=ready(V42, 1), router_weights=w(25), window=failing_window(t, t + 60)
    )
    d.expect(
        acts,
        [Audit("analysis", "fail"), weights(0), Audit("rolled_back"), AlertOf("critical")],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )


def test_windows_not_wholly_under_the_current_weights_are_not_judged() -> None:
    d = Driver.start()
    t = drive_to_step(d, 1)  # 25% confirmed at t=90
    # Began before the router applied 25%: ignored, not even inconclusive.
    acts = d.tick(
        t + 60, canary=ready(V42, 1), router_weights=w(25), window=failing_window(t - 10, t + 50)
    )
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=1)
    # Shorter than the interval: ignored.
    acts = d.tick(
        t + 60, canary=ready(V42, 1), router_weights=w(25), window=failing_window(t, t + 30)
    )
    d.expect(acts, [], Phase.PROGRESSING, w(25), step=1)
    assert d.state.verdicts[-1].step_index == 0 and d.state.failed_checks == 0


def test_a_step_at_100_percent_is_judged_on_absolute_checks_only() -> None:
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "steps": (50, 100)})
    d = Driver.start(plan)
    d.tick(0, router_weights=STABLE_ONLY)
    d.tick(10, canary=ready(V42, 2), router_weights=STABLE_ONLY)
    d.tick(15, canary=ready(V42, 2), router_weights=w(50))
    acts = d.tick(75, canary=ready(V42, 2), router_weights=w(50), window=window(15, 75))
    d.expect(acts, [Audit("analysis"), Audit("step"), ScaleCanary(4)], Phase.PROGRESSING, w(50))
    acts = d.tick(80, canary=ready(V42, 4), router_weights=w(50))
    d.expect(acts, [weights(100)], Phase.PROGRESSING, w(100), step=1)
    d.tick(85, canary=ready(V42, 4), router_weights=w(100))
    no_stable = WindowStats(85, 145, healthy(4000), CohortStats(0))
    acts = d.tick(145, canary=ready(V42, 4), router_weights=w(100), window=no_stable)
    # Canary already at 100%: promotion by shift goes straight to the stable target.
    d.expect(
        acts,
        [Audit("analysis", "pass"), Audit("promoting"), SetStableTarget(V42)],
        Phase.PROMOTING,
        w(100),
    )
    assert any("no stable traffic" in r for r in d.state.verdicts[-1].reasons)


# ---- preparing ----------------------------------------------------------------------------


def test_candidate_load_failure_while_preparing_fails_the_rollout() -> None:
    d = Driver.start()
    d.tick(0, router_weights=STABLE_ONLY)
    broken = pool(
        ReplicaObservation("r0", V42, None, ReplicaPhase.FAILED, "dry_run: NaN in output"),
        ReplicaObservation("r1", V42, None, ReplicaPhase.LOADING),
    )
    # The router never sent the canary anything, so cleanup happens in the same tick.
    acts = d.tick(30, canary=broken, router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [
            weights(0),
            Audit("failed", "dry_run: NaN in output"),
            AlertOf("critical", "failed to load on canary replica r0"),
            SetCanaryTarget(None),
            Audit("finished"),
            FinishOf(Phase.FAILED, "dry_run"),
        ],
        Phase.FAILED,
        STABLE_ONLY,
    )
    assert d.state.finished


def test_a_canary_replica_in_backoff_is_neither_ready_nor_failed() -> None:
    # Backoff: a transient failure, retried later. The rollout waits for it as for a load.
    d = Driver.start()
    d.tick(0, router_weights=STABLE_ONLY)
    retrying = pool(ReplicaObservation("r0", V42, None, ReplicaPhase.BACKOFF, "timeout"))
    assert retrying.ready_on(V42) == 0 and retrying.failures_on(V42) == []
    acts = d.tick(30, canary=retrying, router_weights=STABLE_ONLY)
    d.expect(acts, [], Phase.PREPARING, STABLE_ONLY)
    acts = d.tick(60, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    assert Audit("canary_ready") in acts and d.state.phase is Phase.PROGRESSING


def test_preparing_waits_for_every_canary_replica_then_the_deadline_fails() -> None:
    plan = RolloutPlan.model_validate(
        {**PLAN.model_dump(), "canary_scaling": {"min_replicas": 2, "max_replicas": 4}}
    )
    d = Driver.start(plan)
    acts = d.tick(0, router_weights=STABLE_ONLY)
    assert ScaleCanary(2) in acts
    one_of_two = pool(*ready(V42, 1).replicas, expected=2)
    acts = d.tick(100, canary=one_of_two, router_weights=STABLE_ONLY)
    d.expect(acts, [], Phase.PREPARING, STABLE_ONLY)
    # Serve still reports the old pool size (1): the rollout's own count (2) is what counts.
    acts = d.tick(200, canary=pool(*ready(V42, 1).replicas, expected=1), router_weights=STABLE_ONLY)
    d.expect(acts, [], Phase.PREPARING, STABLE_ONLY)
    acts = d.tick(301, canary=one_of_two, router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [
            weights(0),
            Audit("failed", "1 of 2 replicas"),
            AlertOf("critical"),
            ScaleCanary(1),
            SetCanaryTarget(None),
            Audit("finished"),
            FinishOf(Phase.FAILED),
        ],
        Phase.FAILED,
        STABLE_ONLY,
    )


# ---- abort, fast rollback, promotion failure ------------------------------------------------


def test_abort_mid_step_moves_weights_first() -> None:
    d = Driver.start()
    t = drive_to_step(d, 2)
    acts = d.tick(
        t + 10, canary=ready(V42, 2), router_weights=w(50), commands=(Abort("wrong artifact"),)
    )
    d.expect(
        acts,
        [weights(0), Audit("aborted", "wrong artifact"), AlertOf("warning")],
        Phase.ABORTED,
        STABLE_ONLY,
    )
    acts = d.tick(t + 12, canary=ready(V42, 2), router_weights=STABLE_ONLY)
    d.expect(
        acts,
        [
            ScaleCanary(1),
            SetCanaryTarget(None),
            Audit("finished"),
            FinishOf(Phase.ABORTED, "wrong artifact"),
        ],
        Phase.ABORTED,
        STABLE_ONLY,
    )
    # Commands after the end change nothing.
    assert d.tick(t + 20, router_weights=STABLE_ONLY, commands=(Resume(), Abort())) == []


def test_fast_rollback_skips_analysis_and_moves_weights_first() -> None:
    d = Driver.start()
    t = drive_to_step(d, 1)
    # A perfectly good window arrives in the same tick: it is not even judged.
    acts = d.tick(
        t + 60,
        canary=ready(V42, 1),
        router_weights=w(25),
        window=window(t, t + 60),
        commands=(Rollback(),),
    )
    d.expect(
        acts,
        [weights(0), Audit("rolled_back", "operator"), AlertOf("critical")],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )
    assert d.state.verdicts[-1].step_index == 0


def test_rollback_during_a_shift_promotion_restores_the_stable_target() -> None:
    d = Driver.start()
    t = drive_to_step(d, 2)
    d.tick(t + 60, canary=ready(V42, 2), router_weights=w(50), window=window(t, t + 60))
    d.tick(t + 70, canary=ready(V42, 4), router_weights=w(50))
    d.tick(t + 75, canary=ready(V42, 4), router_weights=w(100))
    assert d.state.stable_target == V42
    acts = d.tick(
        t + 80,
        canary=ready(V42, 4),
        stable=loading(V42, 3, V41),
        router_weights=w(100),
        commands=(Rollback("bad numbers"),),
    )
    d.expect(
        acts,
        [
            weights(0),
            SetStableTarget(V41),
            Audit("rolled_back", "bad numbers"),
            AlertOf("critical"),
        ],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )


def test_stable_rejecting_the_candidate_fails_the_promotion() -> None:
    plan = PLAN.model_copy(update={"promotion": "in_place"})
    d = Driver.start(plan)
    t = drive_to_step(d, 2)
    d.tick(
        t + 60,
        canary=ready(V42, 2),
        router_weights=w(50),
        window=window(t, t + 60),
        in_place_fits=True,
    )
    rejected = pool(
        ReplicaObservation("s0", V42, V41, ReplicaPhase.FAILED, "budget: 9 GiB > 8 GiB")
    )
    acts = d.tick(t + 70, canary=ready(V42, 2), stable=rejected, router_weights=w(50))
    d.expect(
        acts,
        [
            weights(0),
            SetStableTarget(V41),
            Audit("failed", "budget"),
            AlertOf("critical", "promotion failed"),
        ],
        Phase.FAILED,
        STABLE_ONLY,
    )


def test_a_canary_replica_failing_mid_rollout_rolls_back() -> None:
    d = Driver.start()
    t = drive_to_step(d, 1)
    sick = pool(ReplicaObservation("r0", V42, V42, ReplicaPhase.FAILED, "load: shape mismatch"))
    acts = d.tick(t + 5, canary=sick, router_weights=w(25))
    d.expect(
        acts,
        [weights(0), Audit("rolled_back", "r0"), AlertOf("critical")],
        Phase.ROLLED_BACK,
        STABLE_ONLY,
    )


# ---- restarts ----------------------------------------------------------------------------


def test_resume_from_a_json_round_tripped_state_gives_the_same_next_actions() -> None:
    d = Driver.start()
    t = drive_to_step(d, 1)
    d.tick(t + 60, canary=ready(V42, 1), router_weights=w(25), window=failing_window(t, t + 60))
    saved = json.dumps(d.state.to_dict())
    restored = RolloutState.from_dict(json.loads(saved))
    assert restored == d.state
    obs = Observations(canary=ready(V42, 1), router_weights=w(25), window=window(t + 60, t + 120))
    assert advance(restored, obs, t + 120) == advance(d.state, obs, t + 120)
    state, acts = advance(restored, obs, t + 120)
    assert acts == [Audit("analysis", "pass"), Audit("step", "step 3/3"), ScaleCanary(2)]
    assert (state.failed_checks, state.step_index) == (0, 2)


def test_repeated_observations_do_not_act_twice() -> None:
    d = Driver.start()
    t = drive_to_step(d, 0)
    before = d.state
    obs = Observations(canary=ready(V42, 1), router_weights=w(5), window=failing_window(t, t + 60))
    after, acts = advance(before, obs, t + 60)
    assert acts == [Audit("analysis", "fail")] and after.failed_checks == 1
    # A restart that re-runs the tick from the old state repeats the same actions, with the
    # same audit keys (the registry drops duplicates), and does not mutate its input.
    assert advance(before, obs, t + 60) == (after, acts)
    assert before.failed_checks == 0
    # Running the same observations again on the new state does nothing: the window was judged.
    again, acts_again = advance(after, obs, t + 61)
    assert acts_again == [] and again.failed_checks == 1


def test_a_rollout_is_active_until_its_cleanup_is_done() -> None:
    # What the controller keys "one rollout per model at a time" on (the registry enforces
    # the same rule itself).
    d = Driver.start()
    d.tick(0, router_weights=STABLE_ONLY)
    assert d.state.is_active
    d.tick(5, router_weights=STABLE_ONLY, commands=(Abort(),))
    assert d.state.finished
    assert not d.state.is_active  # finished: a new rollout may start


def test_a_rollout_of_the_baseline_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="already the baseline"):
        RolloutState.new(
            PLAN,
            rollout_id="x",
            model="ranker",
            candidate_artifact_id=V41,
            baseline_artifact_id=V41,
            now=0,
        )


# ---- drift: Serve's config changed behind the controller's back --------------------------


def test_after_a_drift_the_canary_weight_waits_for_a_ready_pool_then_windows_restart() -> None:
    d = Driver.start()
    t = drive_to_step(d, 1)  # 75/25, router confirmed, one canary replica
    # KubeRay resubmitted its serveConfigV2: the canary lost its target, the router its weight.
    d.state = after_drift(d.state)
    assert d.state.weights == STABLE_ONLY and d.state.weights_live_at is None, d.dump()
    assert d.state.withdrawn_canary_bp == 2500
    # The replica reloads the candidate: the weight stays withdrawn, no window is judged.
    acts = d.tick(
        t + 5, canary=loading(V42, 1), router_weights=STABLE_ONLY, window=window(t, t + 5)
    )
    d.expect(acts, [], Phase.PROGRESSING, STABLE_ONLY, step=1)
    acts = d.tick(
        t + 70, canary=loading(V42, 1), router_weights=STABLE_ONLY, window=window(t, t + 70)
    )
    d.expect(acts, [], Phase.PROGRESSING, STABLE_ONLY, step=1)
    assert d.state.verdicts[-1].window_end <= t, "a window measured under the drift was judged"
    # Ready again: the step's weight comes back; windows start once the router applies it.
    acts = d.tick(t + 75, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    d.expect(
        acts, [weights(25), Audit("drift_restored", "stable 75% / canary 25%")], Phase.PROGRESSING,
        w(25), step=1,
    )  # fmt: skip
    assert d.state.withdrawn_canary_bp is None
    acts = d.tick(t + 80, canary=ready(V42, 1), router_weights=w(25))
    assert d.state.weights_live_at == t + 80 and next_window(d.state, t + 140) == (t + 80, t + 140)
    # And the rollout goes on from there.
    acts = d.tick(
        t + 140, canary=ready(V42, 1), router_weights=w(25), window=window(t + 80, t + 140)
    )
    assert Audit("step", "step 3/3 (50%)") in acts, d.dump()


def test_a_drift_while_paused_at_a_gate_restores_the_gates_weight_not_the_next_step() -> None:
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "gates": {"pause_before_steps": [50]}})
    d = Driver.start(plan)
    d.tick(0, router_weights=STABLE_ONLY)
    d.tick(20, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    d.tick(25, canary=ready(V42, 1), router_weights=w(5))
    d.tick(85, canary=ready(V42, 1), router_weights=w(5), window=window(25, 85))
    d.tick(90, canary=ready(V42, 1), router_weights=w(25))
    d.tick(150, canary=ready(V42, 1), router_weights=w(25), window=window(90, 150))
    assert d.state.phase is Phase.PAUSED and d.state.weights == w(25), d.dump()
    d.state = after_drift(d.state)
    acts = d.tick(155, canary=loading(V42, 1), router_weights=STABLE_ONLY)
    d.expect(acts, [], Phase.PAUSED, STABLE_ONLY)
    acts = d.tick(160, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    d.expect(acts, [weights(25), Audit("drift_restored")], Phase.PAUSED, w(25))


def test_a_drift_during_the_shadow_phase_stops_mirroring_until_the_canary_is_ready() -> None:
    plan = RolloutPlan.model_validate({**PLAN.model_dump(), "shadow": {"fraction": 0.5}})
    d = Driver.start(plan)
    d.tick(0, router_weights=STABLE_ONLY)
    acts = d.tick(20, canary=ready(V42, 1), router_weights=STABLE_ONLY)
    assert d.state.phase is Phase.SHADOWING and d.state.shadow_bp == 5000, d.dump()
    d.tick(25, canary=ready(V42, 1), router_weights=STABLE_ONLY, router_shadow_bp=5000)
    assert d.state.shadow_live_at == 25
    d.state = after_drift(d.state)
    assert (d.state.shadow_bp, d.state.withdrawn_shadow_bp, d.state.shadow_live_at) == (
        0, 5000, None,
    )  # fmt: skip
    acts = d.tick(30, canary=loading(V42, 1), router_weights=STABLE_ONLY, router_shadow_bp=0)
    d.expect(acts, [], Phase.SHADOWING, STABLE_ONLY)
    acts = d.tick(35, canary=ready(V42, 1), router_weights=STABLE_ONLY, router_shadow_bp=0)
    assert [type(a).__name__ for a in acts] == ["SetShadow", "RecordAudit"], d.dump()
    assert acts[0].fraction_bp == 5000 and d.state.shadow_bp == 5000
    assert d.state.shadow_live_at is None  # windows wait for the router to mirror again


def test_promotion_finalising_is_not_undone_by_a_withdrawn_weight() -> None:
    plan = PLAN.model_copy(update={"promotion": "in_place"})
    d = Driver.start(plan)
    t = drive_to_step(d, 2)
    d.tick(t + 60, canary=ready(V42, 2), router_weights=w(50), window=window(t, t + 60),
           in_place_fits=True)  # fmt: skip
    assert d.state.phase is Phase.PROMOTING and d.state.stable_target == V42, d.dump()
    d.state = after_drift(d.state)  # the canary reloads while stable swaps in place
    # Every stable replica serves the candidate: finalising decides the weights (stable 100%,
    # which the router already applies), and the rollout ends: 50% is never put back.
    acts = d.tick(t + 70, canary=loading(V42, 2), stable=ready(V42, 3), router_weights=STABLE_ONLY)
    assert Audit("finalising") in acts and not any(isinstance(a, SetWeights) for a in acts)
    assert d.state.phase is Phase.SUCCEEDED and d.state.withdrawn_canary_bp is None, d.dump()
    assert d.tick(t + 75, canary=ready(V42, 2), router_weights=STABLE_ONLY) == []


def test_a_drift_after_the_end_changes_nothing() -> None:
    d = Driver.start()
    t = drive_to_step(d, 0)
    d.tick(t + 1, canary=ready(V42, 1), router_weights=w(5), commands=(Rollback("test"),))
    assert d.state.phase is Phase.ROLLED_BACK
    assert after_drift(d.state) is d.state
