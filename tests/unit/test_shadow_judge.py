"""The shadow phase's gate (rollout/shadow_judge.py) and its place in the state machine.

The gate's e-processes are tested by simulation (seeded, fast): candidates within their bounds
are almost never failed, candidates outside them are failed in a few windows, and the
recorded band is two-sided. The machine tests step the shadow phase tick by tick.
"""

from __future__ import annotations

import json
import random

import pytest

from app.contracts import ExpectedDivergence, ReplicaPhase
from rollout.analysis import CohortStats, Outcome, ShadowStats, WindowStats
from rollout.machine import (
    Observations,
    PoolView,
    RecordAudit,
    ReplicaObservation,
    SetShadow,
    SetWeights,
    advance,
)
from rollout.persisted import written
from rollout.plan import RolloutPlan, ShadowPlan
from rollout.shadow_judge import (
    SHADOW_RBO,
    SHADOW_TOP1,
    expectation_applies,
    judge_shadow,
    new_shadow_evidence,
)
from rollout.state import Phase, RolloutState, Weights

V41, V43 = "ranker-v41", "ranker-v43"
SHADOW = ShadowPlan(fraction=0.2, min_compared=100, tolerance=0.05)
PLAN = RolloutPlan(steps=(10, 50), interval_s=10, progress_deadline_s=120, shadow=SHADOW)
EXPECTED = ExpectedDivergence(
    baseline_artifact_id=V41,
    baseline_manifest_sha256="a" * 64,
    requests=2000,
    top_k=10,
    rbo_p=0.9,
    rbo_mean=0.8,
    overlap_mean=0.85,
    top1_change_rate=0.3,
    max_score_diff_p99=0.2,
    source="generated: 2000 requests, seed 7",
)


def copies(rng: random.Random, n: int, rbo_mean: float, top1_rate: float) -> ShadowStats:
    """``n`` compared copies whose RBO is spread around ``rbo_mean`` (a Beta with that
    mean) and whose top-1 changes with probability ``top1_rate``."""
    if rbo_mean >= 1.0:
        rbos = [1.0] * n
    else:
        k = 8.0
        rbos = [rng.betavariate(rbo_mean * k, (1 - rbo_mean) * k) for _ in range(n)]
    changed = sum(rng.random() < top1_rate for _ in range(n))
    return ShadowStats(compared=n, rbo_sum=sum(rbos), overlap_sum=sum(rbos), top1_changed=changed)


def run_phase(
    seed: int,
    rbo_mean: float,
    top1_rate: float,
    *,
    expected: ExpectedDivergence | None = None,
    windows: int = 30,
    per_window: int = 60,
) -> tuple[Outcome, int, str]:
    rng = random.Random(seed)
    evidence = new_shadow_evidence(SHADOW, expected)
    for index in range(1, windows + 1):
        verdict, evidence = judge_shadow(
            copies(rng, per_window, rbo_mean, top1_rate), evidence, PLAN
        )
        if verdict.outcome in (Outcome.PASS, Outcome.FAIL):
            return verdict.outcome, index, verdict.summary()
    return Outcome.INCONCLUSIVE, windows, verdict.summary()


def test_a_candidate_within_the_absolute_limits_passes_and_is_almost_never_failed() -> None:
    outcomes = [run_phase(seed, rbo_mean=0.97, top1_rate=0.03)[0] for seed in range(300)]
    failed = outcomes.count(Outcome.FAIL) / len(outcomes)
    assert failed <= PLAN.alpha * 2, failed
    assert outcomes.count(Outcome.PASS) / len(outcomes) >= 0.95


def test_at_the_limit_the_gate_fails_in_at_most_alpha_of_phases() -> None:
    """The null's edge: mean divergence exactly at the limit (RBO 0.9, top-1 10%)."""
    outcomes = [run_phase(seed, rbo_mean=0.9, top1_rate=0.1)[0] for seed in range(300)]
    assert outcomes.count(Outcome.FAIL) / len(outcomes) <= PLAN.alpha * 2


@pytest.mark.parametrize(
    ("rbo_mean", "top1", "measure"),
    [(0.5, 0.05, "mean RBO"), (0.97, 0.6, "top-1 change rate")],
    ids=["ranks-wrong", "top-changes"],
)
def test_a_diverging_candidate_fails_within_a_few_windows_naming_the_measure(
    rbo_mean: float, top1: float, measure: str
) -> None:
    results = [run_phase(seed, rbo_mean, top1) for seed in range(50)]
    assert all(outcome is Outcome.FAIL for outcome, _, _ in results), results[:3]
    assert max(windows for _, windows, _ in results) <= 3
    summary = results[0][2]
    assert "shadow divergence" in summary and measure in summary, summary
    assert "absolute limits" in summary


def test_the_recorded_band_passes_its_candidate_and_fails_both_sides_of_it() -> None:
    # As recorded: passes (it would fail the absolute limits: RBO 0.8 < 0.9, top-1 30% > 10%).
    within = [run_phase(s, 0.8, 0.3, expected=EXPECTED, windows=60) for s in range(50)]
    assert sum(o is Outcome.PASS for o, _, _ in within) >= 47, within[:3]
    assert not any(o is Outcome.FAIL for o, _, _ in within)
    assert run_phase(1, 0.8, 0.3)[0] is Outcome.FAIL  # the same without its expectation
    # Far worse than recorded (a normalization from another run): fails.
    assert all(run_phase(s, 0.4, 0.7, expected=EXPECTED)[0] is Outcome.FAIL for s in range(20))
    # Ranking exactly like the baseline while a change was recorded (the old weights packed
    # as the new model): fails too, on the lower side of the band.
    outcome, _, summary = run_phase(3, 1.0, 0.0, expected=EXPECTED)
    assert outcome is Outcome.FAIL
    assert "expected vs ranker-v41" in summary


def test_no_pass_before_min_compared_and_no_copies_is_inconclusive() -> None:
    evidence = new_shadow_evidence(SHADOW, None)
    verdict, evidence = judge_shadow(None, evidence, PLAN)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    # Identical answers: overwhelming evidence for the canary, but only 50 copies so far.
    same = ShadowStats(compared=50, rbo_sum=50.0, overlap_sum=50.0, top1_changed=0, dropped=7)
    verdict, evidence = judge_shadow(same, evidence, PLAN)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert any("50 copies compared, 100 needed (7 dropped" in r for r in verdict.reasons)
    verdict, evidence = judge_shadow(same, evidence, PLAN)
    assert verdict.outcome is Outcome.PASS
    assert evidence.compared == 100 and evidence.dropped == 14
    # The input evidence is never changed in place.
    fresh = new_shadow_evidence(SHADOW, None)
    judge_shadow(same, fresh, PLAN)
    assert fresh.compared == 0


def test_an_expectation_applies_only_to_the_comparison_it_was_recorded_for() -> None:
    kwargs = {"baseline_artifact_id": V41, "baseline_manifest_sha256": "A" * 64}
    assert expectation_applies(EXPECTED, SHADOW, **kwargs)[0]
    ok, why = expectation_applies(None, SHADOW, **kwargs)
    assert not ok and "no expected_divergence" in why
    ok, why = expectation_applies(EXPECTED, SHADOW, baseline_artifact_id="ranker-v40",
                                  baseline_manifest_sha256=None)  # fmt: skip
    assert not ok and "recorded against ranker-v41, not this rollout's baseline" in why
    ok, why = expectation_applies(EXPECTED, SHADOW, baseline_artifact_id=V41,
                                  baseline_manifest_sha256="b" * 64)  # fmt: skip
    assert not ok and "the registry's is" in why
    ok, why = expectation_applies(EXPECTED, ShadowPlan(top_k=5), **kwargs)
    assert not ok and "top_k 10" in why


def test_band_bounds_drop_the_side_that_reaches_the_end_of_the_range() -> None:
    near_same = EXPECTED.model_copy(update={"rbo_mean": 0.99, "top1_change_rate": 0.01})
    bounds = new_shadow_evidence(SHADOW, near_same).bounds
    sides = {(b.measure, b.side) for b in bounds}
    # Divergence 0.01 +/- 0.05: only its upper side bounds anything.
    assert sides == {(SHADOW_RBO, "upper"), (SHADOW_TOP1, "upper")}
    both = {(b.measure, b.side) for b in new_shadow_evidence(SHADOW, EXPECTED).bounds}
    assert both == {(m, s) for m in (SHADOW_RBO, SHADOW_TOP1) for s in ("upper", "lower")}


def test_window_stats_give_the_candidate_its_comparisons_and_the_window_its_drops() -> None:
    w = WindowStats(
        0,
        10,
        None,
        CohortStats(100),
        shadow={V43: ShadowStats(compared=5, rbo_sum=4.5), "other": ShadowStats(compared=9)},
        shadow_outcomes={"compared": 14, "dropped": 3, "error": 1},
    )
    mine = w.shadow_of(V43)
    assert mine is not None and (mine.compared, mine.dropped, mine.errors) == (5, 3, 1)
    assert WindowStats(0, 10, None, None).shadow_of(V43) is None


# ---------------------------------------------------------------------------- the machine


def ready_pool(artifact: str) -> PoolView:
    return PoolView((ReplicaObservation("c0", artifact, artifact, ReplicaPhase.READY),), 1)


def shadow_window(start: float, end: float, rbo_mean: float, n: int = 400) -> WindowStats:
    return WindowStats(
        start,
        end,
        None,
        CohortStats(2000),
        shadow={V43: ShadowStats(compared=n, rbo_sum=rbo_mean * n, overlap_sum=rbo_mean * n)},
    )


def start(plan: RolloutPlan = PLAN, expected: ExpectedDivergence | None = None) -> RolloutState:
    return RolloutState.new(
        plan,
        rollout_id="ro-s",
        model="ranker",
        candidate_artifact_id=V43,
        baseline_artifact_id=V41,
        now=0.0,
        shadow_expected=None if expected is None else expected.model_dump(mode="json"),
    )


def to_shadow(state: RolloutState) -> RolloutState:
    state, _ = advance(state, Observations(), 0.0)
    state, actions = advance(
        state,
        Observations(canary=ready_pool(V43), router_weights=Weights.stable_only()),
        1.0,
    )
    assert state.phase is Phase.SHADOWING
    shadows = [a for a in actions if isinstance(a, SetShadow)]
    assert shadows == [SetShadow(2000, max_in_flight=16, top_k=10, rbo_p=0.9)]
    assert not any(isinstance(a, SetWeights) for a in actions), "no user traffic in shadow"
    return state


def obs(router_shadow_bp: int | None, window: WindowStats | None = None) -> Observations:
    return Observations(
        canary=ready_pool(V43),
        router_weights=Weights.stable_only(),
        router_shadow_bp=router_shadow_bp,
        window=window,
    )


def test_shadow_windows_count_only_once_the_router_mirrors_then_a_pass_goes_live() -> None:
    state = to_shadow(start())
    # The router does not mirror yet: a window is neither asked for nor judged.
    state, actions = advance(state, obs(0, shadow_window(0, 20, 1.0)), 20.0)
    assert state.phase is Phase.SHADOWING and state.shadow_live_at is None
    assert not any(isinstance(a, RecordAudit) and a.event == "analysis" for a in actions)
    state, _ = advance(state, obs(2000), 21.0)
    assert state.shadow_live_at == 21.0
    # A window that began before mirroring was confirmed is not judged either.
    state, _ = advance(state, obs(2000, shadow_window(15, 31, 1.0)), 31.0)
    assert state.verdicts == []
    state, actions = advance(state, obs(2000, shadow_window(21, 31.5, 1.0)), 31.5)
    assert state.verdicts[-1].outcome is Outcome.PASS and state.verdicts[-1].step_index == -1
    assert {e.check for e in state.verdicts[-1].evidence} == {SHADOW_RBO, SHADOW_TOP1}
    # Mirroring off, then the first step.
    assert actions.index(SetShadow(0)) < len(actions)
    assert state.phase is Phase.PROGRESSING and state.step_index == 0
    assert state.shadow_bp == 0


def test_a_failed_shadow_gate_rolls_back_with_weights_to_stable_first() -> None:
    state = to_shadow(start())
    state, _ = advance(state, obs(2000), 2.0)
    state, actions = advance(state, obs(2000, shadow_window(2, 12, 0.3)), 12.0)
    assert state.phase is Phase.ROLLED_BACK
    effects = [a for a in actions if not isinstance(a, RecordAudit)]
    assert isinstance(effects[0], SetWeights) and effects[0].canary_bp == 0
    assert effects[1] == SetShadow(0)
    assert "shadow divergence before any user traffic" in (state.reason or "")
    assert "mean RBO 0.300" in (state.reason or "")
    assert state.weights == Weights.stable_only()  # the canary never had user traffic


def test_the_shadow_phase_ends_at_its_deadline_when_nothing_can_be_compared() -> None:
    state = to_shadow(start())
    state, _ = advance(state, obs(2000), 2.0)
    empty = WindowStats(2, 12, None, CohortStats(500), shadow_outcomes={"dropped": 40})
    state, _ = advance(state, obs(2000, empty), 12.0)
    assert state.phase is Phase.SHADOWING
    state, _ = advance(state, obs(2000), 200.0)
    assert state.phase is Phase.ROLLED_BACK
    assert "0 copies compared, 40 dropped" in (state.reason or "")


def test_the_shadow_evidence_survives_a_restart_mid_phase() -> None:
    state = to_shadow(start(expected=EXPECTED))
    state, _ = advance(state, obs(2000), 2.0)
    state, _ = advance(state, obs(2000, shadow_window(2, 12, 0.8, n=60)), 12.0)
    restored = RolloutState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored.shadow_evidence is not None and state.shadow_evidence is not None
    assert written(restored.shadow_evidence) == written(state.shadow_evidence)
    assert restored.shadow_expected == state.shadow_expected
    assert "expected vs ranker-v41" in restored.shadow_evidence.basis
    # A state written before the shadow phase existed reads as having none.
    old = state.to_dict()
    old["schema_version"] = 2
    for key in ("shadow_bp", "shadow_live_at", "shadow_expected", "shadow_basis_note"):
        old.pop(key)
    old.pop("shadow_evidence")
    old["plan"].pop("shadow")
    assert RolloutState.from_dict(old).shadow_evidence is None


def test_copies_the_canary_fails_to_answer_count_against_it() -> None:
    """Identical rankings on the copies it answers, errors on a fifth of them: not a pass."""
    evidence = new_shadow_evidence(SHADOW, None)
    outcome = Outcome.INCONCLUSIVE
    for _ in range(10):
        answered = ShadowStats(compared=80, rbo_sum=80.0, overlap_sum=80.0, errors=20)
        verdict, evidence = judge_shadow(answered, evidence, PLAN)
        outcome = verdict.outcome
        if outcome is not Outcome.INCONCLUSIVE:
            break
    assert outcome is Outcome.FAIL, verdict.summary()
    assert evidence.errors > 0 and evidence.rbo_mean == 1.0  # shown over the answered ones


def test_a_band_that_bounds_nothing_passes_once_enough_copies_are_compared() -> None:
    wide = ShadowPlan(tolerance=0.9, min_compared=50)
    plan = PLAN.model_copy(update={"shadow": wide})
    middle = EXPECTED.model_copy(update={"rbo_mean": 0.5, "top1_change_rate": 0.5})
    evidence = new_shadow_evidence(wide, middle)
    assert evidence.bounds == []
    verdict, evidence = judge_shadow(ShadowStats(compared=30, rbo_sum=10.0), evidence, plan)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    verdict, evidence = judge_shadow(ShadowStats(compared=30, rbo_sum=10.0), evidence, plan)
    assert verdict.outcome is Outcome.PASS


def test_the_canary_pool_is_cleaned_up_only_once_the_router_stopped_mirroring() -> None:
    state = to_shadow(start())
    state, _ = advance(state, obs(2000), 2.0)
    state, actions = advance(state, obs(2000, shadow_window(2, 12, 0.3)), 12.0)
    assert state.phase is Phase.ROLLED_BACK and not state.finished
    assert not any(type(a).__name__ == "SetCanaryTarget" for a in actions)
    # The router still mirrors (its config not applied yet): no cleanup.
    state, actions = advance(state, obs(2000), 13.0)
    assert not state.finished and actions == []
    state, actions = advance(state, obs(0), 14.0)
    assert state.finished
    assert any(type(a).__name__ == "SetCanaryTarget" for a in actions)
