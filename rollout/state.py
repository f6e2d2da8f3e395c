"""The state of one rollout: what a restarted controller needs to carry on, and nothing more.

Pure module. ``RolloutState`` is a plain dataclass that carries its own plan (as Flagger's
Canary keeps its spec), round-trips through JSON (``to_dict`` / ``from_dict``) so the
controller can persist it in the registry after every step and resume from it, and is only
ever changed by ``rollout.machine.advance``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

from app.contracts import BASIS_POINTS
from app.contracts import RolloutPhase as Phase
from rollout.analysis import Outcome
from rollout.plan import RolloutPlan
from rollout.sequential import SequentialEvidence
from rollout.shadow_judge import ShadowEvidence

# 2 added the sequential judge's evidence; a version 1 state (none yet) is read as having none.
# 3 added the shadow phase; a version 2 state (a plan without one) has no shadow fields.
STATE_SCHEMA_VERSION: Final = 3
READABLE_SCHEMA_VERSIONS: Final = (1, 2, 3)
# E-values as records keep them: finite, so they stay valid JSON (PostgreSQL's jsonb refuses
# Infinity); any value this large is far past every bound.
EVIDENCE_CAP: Final = 1e15
VERDICT_HISTORY: Final = 20  # verdicts kept in the state; the audit log keeps them all


@dataclass(frozen=True)
class Weights:
    """The router's split in basis points (10000 = 100%)."""

    stable_bp: int
    canary_bp: int

    def __post_init__(self) -> None:
        if self.stable_bp < 0 or self.canary_bp < 0:
            raise ValueError(f"negative weight in {self}")
        if self.stable_bp + self.canary_bp != BASIS_POINTS:
            raise ValueError(f"weights must add up to {BASIS_POINTS} bp, got {self}")

    @classmethod
    def with_canary(cls, canary_bp: int) -> Weights:
        return cls(stable_bp=BASIS_POINTS - canary_bp, canary_bp=canary_bp)

    @classmethod
    def stable_only(cls) -> Weights:
        return cls.with_canary(0)

    @classmethod
    def canary_only(cls) -> Weights:
        return cls.with_canary(BASIS_POINTS)

    def describe(self) -> str:
        return f"stable {self.stable_bp / 100:g}% / canary {self.canary_bp / 100:g}%"


# Values of RolloutState.pending_gate other than "step:<index>".
GATE_PROMOTION: Final = "promotion"
GATE_OPERATOR: Final = "operator"


def step_gate(index: int) -> str:
    return f"step:{index}"


def gated_step(gate: str | None) -> int | None:
    """The step index a ``step:<index>`` gate holds back, else None."""
    if gate is not None and gate.startswith("step:"):
        return int(gate.removeprefix("step:"))
    return None


@dataclass(frozen=True)
class EvidenceRecord:
    """One check's e-values after a window (sequential judge): against the canary and for it,
    with the bounds they are held to: ``fail_at`` rolls back, ``pass_at`` passes, ``hold_at``
    holds (the sample-ratio guard, which neither fails nor passes a canary)."""

    check: str
    against: float
    supporting: float | None
    fail_at: float | None
    pass_at: float | None
    hold_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def capped(value: float) -> float:
    return min(value, EVIDENCE_CAP)


@dataclass(frozen=True)
class VerdictRecord:
    """A judged window as kept in the state (the full check list goes to the audit log)."""

    window_end: float
    step_index: int
    canary_bp: int
    outcome: Outcome
    reasons: tuple[str, ...]
    evidence: tuple[EvidenceRecord, ...] = ()


@dataclass
class RolloutState:
    """One rollout. Timestamps are the controller's clock (``now`` passed to ``advance``).

    - ``weights`` are the last weights *set*; ``weights_live_at`` is when the router was first
      observed applying them (None until then). Windows are only judged from that time on.
    - ``canary_target`` / ``stable_target`` / ``canary_replicas`` are the last values this
      rollout set (``canary_replicas`` None: the pool was never scaled by it), so a restarted
      controller knows what it already asked for.
    - ``failed_checks`` counts *consecutive* failed windows; a passing window resets it.
      ``inconclusive_windows`` counts the current step's inconclusive windows.
    - ``step_entered_at`` starts the progress deadline of a step; a resume restarts it.
    - ``finished`` turns True when ``Finish`` has been emitted: the canary pool has been
      cleaned up after the router confirmed stable 100%. A terminal phase that is not yet
      finished still needs ticks.
    - ``audit_seq`` numbers the audit records, so a replay after a crash produces the same
      keys and the registry can drop the duplicates.
    - ``evidence`` is the sequential judge's evidence so far (None until its first window, and
      always with the threshold judge): it carries across steps and across restarts.
    - Shadow phase: ``shadow_bp`` is the mirrored fraction last set on the router (0: off),
      ``shadow_live_at`` when the router was first observed applying it; ``shadow_expected``
      the candidate's recorded expectation when it applies to this baseline (the engine
      decides at the start; ``shadow_basis_note`` says why not otherwise);
      ``shadow_evidence`` what the gate has seen so far.
    - ``withdrawn_canary_bp`` / ``withdrawn_shadow_bp``: the canary weight and the mirrored
      fraction taken back after Serve's config was changed behind the controller's back (a
      re-applied old config: the canary pool may be reloading), to be set again once every
      canary replica reports the candidate ready (None: nothing withdrawn).
    """

    plan: RolloutPlan
    rollout_id: str
    model: str
    candidate_artifact_id: str
    baseline_artifact_id: str
    created_at: float
    phase: Phase = Phase.PENDING
    step_index: int = -1
    weights: Weights = field(default_factory=Weights.stable_only)
    weights_live_at: float | None = None
    canary_target: str | None = None
    stable_target: str | None = None
    canary_replicas: int | None = None
    promotion_strategy: str | None = None
    failed_checks: int = 0
    inconclusive_windows: int = 0
    phase_entered_at: float = 0.0
    step_entered_at: float | None = None
    last_analysis_at: float | None = None
    verdicts: list[VerdictRecord] = field(default_factory=list)
    reason: str | None = None
    pending_gate: str | None = None
    finished: bool = False
    audit_seq: int = 0
    evidence: SequentialEvidence | None = None
    shadow_bp: int = 0
    shadow_live_at: float | None = None
    shadow_expected: dict[str, Any] | None = None
    shadow_basis_note: str = ""
    shadow_evidence: ShadowEvidence | None = None
    withdrawn_canary_bp: int | None = None
    withdrawn_shadow_bp: int | None = None

    @classmethod
    def new(
        cls,
        plan: RolloutPlan,
        *,
        rollout_id: str,
        model: str,
        candidate_artifact_id: str,
        baseline_artifact_id: str,
        now: float,
        shadow_expected: dict[str, Any] | None = None,
        shadow_basis_note: str = "",
    ) -> RolloutState:
        if candidate_artifact_id == baseline_artifact_id:
            raise ValueError(
                f"candidate {candidate_artifact_id!r} is already the baseline; nothing to roll out"
            )
        return cls(
            plan=plan,
            rollout_id=rollout_id,
            model=model,
            candidate_artifact_id=candidate_artifact_id,
            baseline_artifact_id=baseline_artifact_id,
            created_at=now,
            phase_entered_at=now,
            stable_target=baseline_artifact_id,
            shadow_expected=shadow_expected,
            shadow_basis_note=shadow_basis_note,
        )

    @property
    def is_active(self) -> bool:
        """True until the rollout has finished, cleanup included."""
        return not self.finished

    @property
    def step_percent(self) -> float | None:
        return self.plan.steps[self.step_index] if self.step_index >= 0 else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema_version"] = STATE_SCHEMA_VERSION
        data["plan"] = self.plan.model_dump(mode="json")
        data["phase"] = self.phase.value
        data["verdicts"] = [
            {
                **asdict(v),
                "outcome": v.outcome.value,
                "reasons": list(v.reasons),
                "evidence": [e.to_dict() for e in v.evidence],
            }
            for v in self.verdicts
        ]
        data["evidence"] = self.evidence.to_dict() if self.evidence is not None else None
        data["shadow_evidence"] = (
            self.shadow_evidence.to_dict() if self.shadow_evidence is not None else None
        )
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutState:
        data = dict(data)
        version = data.pop("schema_version", None)
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"rollout state schema_version {version!r} is not one of "
                f"{list(READABLE_SCHEMA_VERSIONS)}"
            )
        plan = dict(data["plan"])
        if version == 1:
            # Started before there was a choice of judge: it carries on with the one it had.
            plan.setdefault("judge", "threshold")
        data["plan"] = RolloutPlan.model_validate(plan)
        data["phase"] = Phase(data["phase"])
        data["weights"] = Weights(**data["weights"])
        data["verdicts"] = [
            VerdictRecord(
                window_end=v["window_end"],
                step_index=v["step_index"],
                canary_bp=v["canary_bp"],
                outcome=Outcome(v["outcome"]),
                reasons=tuple(v["reasons"]),
                evidence=tuple(EvidenceRecord(**e) for e in v.get("evidence", ())),
            )
            for v in data["verdicts"]
        ]
        evidence = data.pop("evidence", None)
        data["evidence"] = SequentialEvidence.from_dict(evidence) if evidence else None
        shadow = data.pop("shadow_evidence", None)
        data["shadow_evidence"] = ShadowEvidence.from_dict(shadow) if shadow else None
        return cls(**data)
