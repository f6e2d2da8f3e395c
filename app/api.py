"""HTTP models of the ranking API (pydantic, at the boundary with the service's clients).

The router validates a request exactly once, here; what travels on to the replicas is the
compact ``WireRequest`` (ids, a float32 feature matrix, context, top_n), which the replicas do
not validate again.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from app.contracts import ErrorInfo, ReplicaPhase, WireRequest
from app.features import (
    CONTEXT_FIELDS,
    MAX_CANDIDATE_ID_CHARS,
    MAX_CANDIDATES,
    NUM_FEATURES,
    encode_context,
)

DEFAULT_TOP_N: Final = 10
MAX_BODY_BYTES: Final = 8 << 20

Feature = Annotated[float, Field(allow_inf_nan=False)]


class CandidateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(min_length=1, max_length=MAX_CANDIDATE_ID_CHARS)]
    features: Annotated[
        list[Feature | None], Field(min_length=NUM_FEATURES, max_length=NUM_FEATURES)
    ]


class RankBody(BaseModel):
    """``POST /v1/rank``. ``null`` marks a missing feature; NaN and infinities are refused."""

    model_config = ConfigDict(extra="forbid")

    user_id: Annotated[str, Field(max_length=256)] | None = None
    session_id: Annotated[str, Field(max_length=256)] | None = None
    context: dict[str, str | int | float] = Field(default_factory=dict)
    candidates: Annotated[list[CandidateIn], Field(min_length=1, max_length=MAX_CANDIDATES)]
    top_n: Annotated[int, Field(ge=1, le=MAX_CANDIDATES)] = DEFAULT_TOP_N

    @field_validator("context")
    @classmethod
    def _known_context(cls, value: dict[str, str | int | float]) -> dict[str, str | int | float]:
        for name in value:
            if name not in CONTEXT_FIELDS:
                known = ", ".join(CONTEXT_FIELDS)
                raise ValueError(f"context.{name}: unknown context field (known: {known})")
        encode_context(value)  # ValueError "context.<name>: ..." for a bad value
        return value

    @model_validator(mode="after")
    def _unique_ids(self) -> RankBody:
        seen: set[str] = set()
        for i, cand in enumerate(self.candidates):
            if cand.id in seen:
                raise ValueError(f"candidates[{i}].id: duplicate id {cand.id!r}")
            seen.add(cand.id)
        return self


class RequestInvalid(ValueError):
    """A client mistake: answered 422 naming ``field``."""

    category = "invalid_request"

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


def _field_name(loc: tuple[Any, ...]) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name or "body"


def parse_rank_body(raw: bytes) -> RankBody:
    """Parse and validate a request body; RequestInvalid names the first bad field."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestInvalid("body", f"{len(raw)} bytes is over the limit of {MAX_BODY_BYTES}")
    if not raw:
        raise RequestInvalid("body", "empty body; expected a JSON object")
    try:
        return RankBody.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        msg = str(first.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        field = _field_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            field = "body"
        # Our validators' messages start with the precise field ("context.surface: ...").
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head and (field == "body" or head.startswith(field)):
            field, msg = head, rest
        raise RequestInvalid(field, msg) from None


def to_wire(body: RankBody) -> WireRequest:
    ids = tuple(c.id for c in body.candidates)
    # None -> NaN (missing); the model's preprocessing fills it. Finite values were checked.
    features = np.asarray([c.features for c in body.candidates], dtype=np.float32)
    return WireRequest(ids, features, body.context, body.top_n)


class ReplicaView(BaseModel):
    replica: str
    cohort: str
    phase: ReplicaPhase
    desired_revision: int | None
    desired_artifact: str | None
    actual_revision: int | None
    actual_artifact: str | None
    last_error: ErrorInfo | None = None
    seen_s_ago: float

    @field_serializer("last_error")
    def _error_json(self, error: ErrorInfo | None) -> dict[str, Any] | None:
        # ``field`` appears only where there is one (a config error), as it always has.
        if error is None:
            return None
        return error.model_dump(mode="json", exclude={"field"} if error.field is None else None)


class CohortView(BaseModel):
    cohort: str
    weight_bp: int
    serving: bool | None
    breaker_open: bool
    replicas: list[ReplicaView]


class StatusResponse(BaseModel):
    draining: bool
    in_flight: int
    canary_bp: int
    cohorts: list[CohortView]
