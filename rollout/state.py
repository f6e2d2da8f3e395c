"""The state of one rollout: what a restarted controller needs to carry on, and nothing more.

Pure module. ``RolloutState`` is a plain dataclass that carries its own plan (as Flagger's
Canary keeps its spec), round-trips through JSON (``to_dict`` / ``from_dict``) so the
controller can persist it in the registry after every step and resume from it, and is only
ever changed by ``rollout.machine.advance``.

The state and the dataclasses it holds (the judges' evidence included) are written and read
by one pydantic ``TypeAdapter`` of ``RolloutState`` (``rollout.persisted``); what the JSON
cannot say as it stands (the schema version, a ruled-out alternative's -inf, ``for`` as a
key) is declared beside the field it concerns. A state of an older schema version is upgraded
to the current shape before it is validated (``RolloutState._upgraded``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Final

from pydantic import ConfigDict, computed_field, model_validator

from app.contracts import BASIS_POINTS, PlanEstimateView
from app.contracts import RolloutPhase as Phase
from rollout.analysis import Outcome
from rollout.persisted import read, written
from rollout.plan import RolloutPlan
from rollout.sequential import SequentialEvidence
from rollout.shadow_judge import ShadowEvidence

# 2 added the sequential judge's evidence; a version 1 state (none yet) is read as having none.
# 3 added the shadow phase; a version 2 state (a plan without one) has no shadow fields.
# 4 added evidence at every metrics export: the window being shown (``display_since``) and the
# step's own counts in the sequential evidence, and the start-time estimate; a version 3 state
# has none of them.
STATE_SCHEMA_VERSION: Final = 4
READABLE_SCHEMA_VERSIONS: Final = (1, 2, 3, 4)
# E-values as records keep them: finite, so they stay valid JSON (PostgreSQL's jsonb refuses
# Infinity); any value this large is far past every bound.
EVIDENCE_CAP: Final = 1e15
VERDICT_HISTORY: Final = 20  # verdicts kept in the state; the audit log keeps them all


@dataclass(frozen=True)
class Weights:
    """The router's split in basis points (10000 = 100%)."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

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

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

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
      ``inconclusive_windows`` counts the current step's inconclusive windows (windows of
      display: the sequential judge may judge every metrics export, a verdict is recorded
      once per ``plan.interval_s``; ``display_since`` is where the window being shown began,
      None when the last judged window was recorded).
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
    - ``estimate``: what the start-time estimate said (None: none was made), shown by status
      beside the step's progress.
    """

    # A stored state with a field this code does not know is refused, not half read.
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

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
    display_since: float | None = None
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
    estimate: PlanEstimateView | None = None

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
        """The state as the registry stores it: JSON-ready, with its schema version."""
        return written(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutState:
        """A stored state of any readable schema version; ValueError (a pydantic
        ValidationError) naming what does not read."""
        return read(cls, data)

    # Written with the state; a stored state's is read by ``_upgraded``. (A computed field,
    # not a serializer wrapping the dump: that would dump the dump again untyped, and an
    # untyped float inf turns null where the typed dump hands it to the JSON writer as is.)
    @computed_field
    @property
    def schema_version(self) -> int:
        """The schema version this code writes a state in."""
        return STATE_SCHEMA_VERSION

    @model_validator(mode="before")
    @classmethod
    def _upgraded(cls, data: Any) -> Any:
        """A stored state of any readable version, in the current version's shape: the fields
        a version added are left out of an older state and take their defaults (version 1:
        no sequential evidence; version 2: no shadow phase), but for the plan's judge."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        version = data.pop("schema_version", None)
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"rollout state schema_version {version!r} is not one of "
                f"{list(READABLE_SCHEMA_VERSIONS)}"
            )
        if version == 1 and isinstance(data.get("plan"), Mapping):
            # Started before there was a choice of judge: it carries on with the one it had.
            data["plan"] = {"judge": "threshold", **data["plan"]}
        for evidence in ("evidence", "shadow_evidence"):
            # None, or stored empty: nothing judged yet.
            data[evidence] = data.get(evidence) or None
        return data
