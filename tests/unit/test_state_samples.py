"""The persisted rollout state, checked against stored samples of what the registry holds.

``tests/unit/data/rollout_state_*.json`` are states as the controller wrote them (version 4:
a fresh rollout with a shadow plan, one mid-rollout past its shadow phase with sequential and
shadow evidence, the step's own counts and verdicts, saved with its event log, and one rolled
back and finished), and states as older controllers wrote them (version 3: before evidence at
every metrics export, no window of display nor step counts; version 2: no shadow phase,
evidence saved before its alternatives and per-step restarts were recorded; version 1: no
sequential judge). The version 1-3 samples were written, and ``rollout_state_expected.json``
(what reading each gives, spelt out by ``describe``) computed, by the code that serialized the
state field by field before the state was read and written through a pydantic TypeAdapter;
the version 4 ones are the version 3 ones read and written again, the mid-rollout one given a
window of display and step counts: every later reader must read them alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from app.registry import RolloutRecord
from rollout.live import LiveRollout
from rollout.sequential import CheckEvidence
from rollout.state import STATE_SCHEMA_VERSION, RolloutState

DATA = Path(__file__).parent / "data"
EXPECTED = json.loads((DATA / "rollout_state_expected.json").read_text())
CURRENT = ("fresh", "mid_rollout", "finished")
SAMPLES = {
    "v4_fresh": "rollout_state_v4_fresh.json",
    "v4_mid_rollout": "rollout_record_state_v4_mid_rollout.json",
    "v4_finished": "rollout_state_v4_finished.json",
    "v3_fresh": "rollout_state_v3_fresh.json",
    "v3_mid_rollout": "rollout_record_state_v3_mid_rollout.json",
    "v3_finished": "rollout_state_v3_finished.json",
    "v2_mid_rollout": "rollout_state_v2_mid_rollout.json",
    "v1_finished": "rollout_state_v1_finished.json",
}


def machine_state(sample: str) -> dict[str, Any]:
    """The machine's state in a sample (the mid-rollout one is the record's whole state)."""
    data = json.loads((DATA / SAMPLES[sample]).read_text())
    return data.get("machine", data)


def describe(value: Any) -> Any:
    """``value`` spelt out as JSON with the types it is made of: which dataclass, enum or
    model, tuple or list, and floats (infinities included) apart from ints, so that two
    states described alike are alike in every field and every container."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__name__, "fields": fields}
    if isinstance(value, BaseModel):
        return {"model": type(value).__name__, "json": value.model_dump(mode="json")}
    if isinstance(value, Enum):
        return {"enum": type(value).__name__, "value": value.value}
    if isinstance(value, tuple):
        return {"tuple": [describe(v) for v in value]}
    if isinstance(value, list):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {str(k): describe(v) for k, v in value.items()}}
    if isinstance(value, float):
        return {"float": repr(value) if math.isinf(value) or math.isnan(value) else value}
    if value is None or isinstance(value, bool | int | str):
        return value
    raise TypeError(f"no description of {type(value).__name__}")


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_stored_state_reads_as_it_always_did(sample: str) -> None:
    assert describe(RolloutState.from_dict(machine_state(sample))) == EXPECTED[sample]


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_read_state_is_written_and_read_back_unchanged(sample: str) -> None:
    state = RolloutState.from_dict(machine_state(sample))
    written = json.loads(json.dumps(state.to_dict()))
    assert written["schema_version"] == STATE_SCHEMA_VERSION
    assert describe(RolloutState.from_dict(written)) == describe(state)


@pytest.mark.parametrize("name", CURRENT)
def test_a_current_state_is_written_back_as_it_was_stored(name: str) -> None:
    stored = machine_state(f"v4_{name}")
    assert json.loads(json.dumps(RolloutState.from_dict(stored).to_dict())) == stored


def test_the_mid_rollout_record_resumes_with_its_events() -> None:
    saved = json.loads((DATA / SAMPLES["v4_mid_rollout"]).read_text())
    now = datetime(2026, 1, 1, tzinfo=UTC)
    state = RolloutState.from_dict(saved["machine"])
    record = RolloutRecord(
        id=state.rollout_id,
        model=state.model,
        environment="default",
        candidate_artifact_id=state.candidate_artifact_id,
        baseline_artifact_id=state.baseline_artifact_id,
        plan=saved["machine"]["plan"],
        phase=state.phase.value,
        step=state.step_index + 1,
        weights={},
        verdicts=[],
        state=saved,
        reason=None,
        version=7,
        created_at=now,
        updated_at=now,
        finished_at=None,
    )
    live = LiveRollout.from_record(record)
    assert describe(live.state) == EXPECTED["v4_mid_rollout"]
    assert [e.model_dump(mode="json", exclude_unset=True) for e in live.events] == saved["events"]
    assert live.known == saved["known"] and live.version == 7


def test_alternatives_ruled_out_are_stored_as_null_and_read_back_as_minus_infinity() -> None:
    stored = machine_state("v3_mid_rollout")
    state = RolloutState.from_dict(stored)
    assert state.evidence is not None
    wealth = [
        w
        for check in state.evidence.checks.values()
        for process in check.supporting
        for w in process.log_wealth
    ]
    assert -math.inf in wealth
    written = state.to_dict()["evidence"]["checks"]
    stored_wealth = [w for c in written.values() for p in c["for"] for w in p["log_wealth"]]
    assert None in stored_wealth and "Infinity" not in json.dumps(written)


def test_an_infinite_e_value_is_written_as_the_json_writer_is_given_it() -> None:
    # A step's process past exp's range ends at inf: handed to the registry's JSON writer as
    # the float it is (as the state always was), not turned into null.
    state = RolloutState.from_dict(machine_state("v3_mid_rollout"))
    assert state.evidence is not None
    check: CheckEvidence = next(iter(state.evidence.checks.values()))
    check.ended_in_steps = [math.inf] * len(check.against)
    written = state.to_dict()
    name = next(iter(state.evidence.checks))
    assert written["evidence"]["checks"][name]["ended_in_steps"][0] == math.inf
    again = RolloutState.from_dict(json.loads(json.dumps(written)))
    assert again.evidence is not None and again.evidence.checks[name].ended_in_steps[0] == math.inf


@pytest.mark.parametrize("version", [0, 5, None])
def test_a_state_of_an_unknown_schema_version_is_refused(version: int | None) -> None:
    stored = dict(machine_state("v3_finished"))
    if version is None:
        del stored["schema_version"]
    else:
        stored["schema_version"] = version
    with pytest.raises(ValueError, match="schema_version"):
        RolloutState.from_dict(stored)
