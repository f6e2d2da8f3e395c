"""The rollout the controller drives, as it persists it in the registry after every step.

``LiveRollout`` is the machine's state plus what the controller keeps beside it: the registry
record's version (its compare-and-set counter), the event log that ``rollout status`` and
``rollout history`` show, and the target revisions the rollout last knew. ``persist`` writes
all of it in one compare-and-set; ``from_record`` reads it back after a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ValidationError

from app.contracts import CANARY, MAX_TEXT, STABLE, RolloutEvent, clip_text
from app.registry import Registry, RolloutRecord
from rollout.state import RolloutState, Weights

log = logging.getLogger(__name__)

EVENT_HISTORY: Final = 200  # events kept in the persisted state


@dataclass
class LiveRollout:
    state: RolloutState
    version: int
    events: list[RolloutEvent] = field(default_factory=list)
    # The revision of each cohort's target as this rollout last knew it: its compare-and-set
    # writes expect exactly that, and a registry that moved past it was moved by another
    # writer (or by this rollout just before a crash, which the state tells apart).
    known: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: RolloutRecord) -> LiveRollout:
        saved = record.state
        return cls(
            RolloutState.from_dict(saved["machine"]),
            record.version,
            _load_events(saved.get("events", [])),
            {k: int(v) for k, v in (saved.get("known") or {}).items()},
        )

    def ours(self) -> dict[str, str | None]:
        """What this rollout last set each cohort's target to."""
        return {STABLE: self.state.stable_target, CANARY: self.state.canary_target}

    def record(
        self,
        event: str,
        message: str,
        *,
        at: float,
        key: str | None = None,
        canary_bp: int | None = None,
    ) -> bool:
        """Append an event; False for an audit record already there (a replay after a crash
        produces the same keys)."""
        if key is not None and any(e.key == key for e in self.events):
            return False
        fields: dict[str, Any] = {
            "key": key,
            "event": event,
            "message": clip_text(message),
            "at": at,
        }
        if canary_bp is not None:
            fields["canary_bp"] = canary_bp  # only weight events carry it
        self.events.append(RolloutEvent(**fields))
        del self.events[:-EVENT_HISTORY]
        return True

    def persist(self, registry: Registry) -> None:
        """Compare-and-set the registry's record to this state (RevisionConflict when another
        process moved it on, RegistryUnavailable when it cannot be reached)."""
        state = self.state
        record = registry.update_rollout(
            state.rollout_id,
            expected_version=self.version,
            phase=persisted_phase(state),
            step=state.step_index + 1,  # 1-based step in progress; 0 before the first
            weights=weights_dict(state.weights),
            verdicts=[
                {
                    "window_end": v.window_end,
                    "step": v.step_index,
                    "canary_bp": v.canary_bp,
                    "outcome": v.outcome.value,
                    "reasons": list(v.reasons),
                    "evidence": [e.to_dict() for e in v.evidence],
                }
                for v in state.verdicts
            ],
            state={
                "machine": state.to_dict(),
                "events": [e.model_dump(mode="json", exclude_unset=True) for e in self.events],
                "known": self.known,
            },
            reason=state.reason,
        )
        self.version = record.version


def weights_dict(weights: Weights) -> dict[str, int]:
    return {"stable_bp": weights.stable_bp, "canary_bp": weights.canary_bp}


def persisted_phase(state: RolloutState) -> str:
    # The registry finishes a rollout when it is given a terminal phase. The machine's phase
    # turns terminal before the canary pool is cleaned up, so until ``finished`` the record
    # says e.g. "rolled_back-cleanup" and the rollout still blocks a new one.
    if state.phase.is_terminal and not state.finished:
        return f"{state.phase.value}-cleanup"
    return state.phase.value


def _load_events(raw: Sequence[Mapping[str, Any]]) -> list[RolloutEvent]:
    """A persisted event log; an entry that does not read as an event is left out."""
    events = []
    for entry in raw:
        try:
            events.append(RolloutEvent.model_validate(entry))
        except ValidationError as exc:
            log.warning("persisted event left out: %s", str(exc).splitlines()[0][:MAX_TEXT])
    return events
