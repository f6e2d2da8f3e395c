"""HTTP models of the ranking API (pydantic, at the boundary with the service's clients).

The router validates a request exactly once, with the request schema of the family the app
serves (``app.model_family.RequestSchema``, built on ``parse_body`` here); what travels on to
the replicas is the compact ``WireRequest`` (ids, a float32 feature matrix, context, top_n,
and the family's per-request ``query`` features where it has them), which the replicas do
not validate again.

The answer to ``/v1/rank`` is ``RankResponse``, built here and only here: by the router, by
the ranker's direct route (the benchmark's baseline) and read back by ``app.client``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Sequence
from typing import Annotated, Any, Final, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_serializer,
)

from app.contracts import MAX_REQUEST_BODY_BYTES, ErrorInfo, ModelMeta, ReplicaPhase, StandbyView
from app.errors import BodyTooLarge, RequestInvalid

DEFAULT_TOP_N: Final = 10
# Limits of one request, whatever its family: the batch forward pads nothing, but a single
# request with an unbounded candidate list would still monopolise a replica.
MAX_CANDIDATES: Final = 2048
MAX_CANDIDATE_ID_CHARS: Final = 256
MAX_BODY_BYTES: Final = MAX_REQUEST_BODY_BYTES
# The model computes in float32: a float64 from this magnitude on rounds to an infinity there
# (float32's largest finite value plus half a step: below it, values round to that value).
FLOAT32_OVERFLOW: Final = (2.0 - 2.0**-24) * 2.0**127
FLOAT32_MAX: Final = float(np.finfo(np.float32).max)

# A JSON number only (the request models are strict: never a string or a boolean), finite,
# and finite once in float32. The bounds are checked in pydantic's core, not in Python (up to
# 160k values a request); parse_body words their error.
Feature = Annotated[float, Field(allow_inf_nan=False, gt=-FLOAT32_OVERFLOW, lt=FLOAT32_OVERFLOW)]
ContextValue = str | int | float
BodyT = TypeVar("BodyT", bound=BaseModel)


async def read_body(
    content_length: str | None, chunks: AsyncIterable[bytes], limit: int = MAX_BODY_BYTES
) -> bytes:
    """The request body, read no further than ``limit`` bytes.

    A ``Content-Length`` over the limit is refused before a byte is read; a body without
    one (chunked) is read chunk by chunk and refused as soon as it passes the limit, so a
    client cannot make the service hold more than ``limit`` bytes of one request (the
    proxy in front still buffers what the client sends meanwhile: see docs/security.md).
    """
    if content_length is not None:
        declared = content_length.strip()
        if not declared.isdigit():
            raise RequestInvalid("content-length", f"{content_length[:40]!r} is not a length")
        if int(declared) > limit:
            raise BodyTooLarge(
                f"Content-Length {int(declared)} is over the limit of {limit} bytes", limit
            )
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body passed the limit of {limit} bytes; not read on", limit)
        parts.append(chunk)
    return b"".join(parts)


def _field_name(loc: tuple[Any, ...]) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name or "body"


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """Parse and validate a request body into a family's body ``model``; RequestInvalid
    names the first bad field (the family's validators word theirs "field.path: why")."""
    if len(raw) > MAX_BODY_BYTES:
        raise BodyTooLarge(
            f"{len(raw)} bytes is over the limit of {MAX_BODY_BYTES} bytes", MAX_BODY_BYTES
        )
    if not raw:
        raise RequestInvalid("body", "empty body; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        msg = str(first.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        loc = tuple(first.get("loc", ()))
        field = _field_name(loc)
        if first.get("type") == "json_invalid":
            field = "body"
        if first.get("type") in ("less_than", "greater_than") and any(
            isinstance(part, str) and part.endswith("features") for part in loc
        ):
            msg = f"outside float32's finite range (|x| <= {FLOAT32_MAX:g})"
        # Our validators' messages start with the precise field ("context.surface: ...").
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head and (field == "body" or head.startswith(field)):
            field, msg = head, rest
        raise RequestInvalid(field, msg) from None


# --------------------------------------------------------------------------- the answer


class RankedCandidate(BaseModel):
    """One candidate of a ranking, best first."""

    id: str
    score: float
    label: str


class AnsweringModel(BaseModel):
    """Which model answered; the ``X-Model-*`` headers say the same."""

    artifact_id: str
    revision: int
    runtime_build: str
    replica: str
    # The backbone artifact a head runs on (None for a model without one); always present.
    backbone_artifact_id: str | None = None
    # Only where the router's ``reveal_cohort`` is on (local.yaml, tests): left out of the
    # answer, not null, when hidden, so clients cannot tell a cohort from its absence.
    cohort: str | None = None


class RankResponse(BaseModel):
    """The answer to ``POST /v1/rank``."""

    ranking: list[RankedCandidate]
    model: AnsweringModel
    failover: bool = False  # answered by another cohort than the one the request was meant for

    @staticmethod
    def encode(
        meta: ModelMeta,
        ranking: Sequence[tuple[str, float, str]],
        *,
        failover: bool,
        reveal_cohort: bool,
    ) -> tuple[str, dict[str, str]]:
        """The answer's JSON text and headers, straight from a replica's answer.

        The path every request pays for: the dict is written directly with this model's
        keys, in its field order (``model.cohort`` only where revealed), and dumped with
        ``json.dumps`` as the service always has; building the models first cost three times
        as much. tests/unit/test_api.py holds it equal to ``from_answer(...).body()``."""
        model: dict[str, Any] = {
            "artifact_id": meta.artifact_id,
            "revision": meta.revision,
            "runtime_build": meta.runtime_build,
            "replica": meta.replica,
            "backbone_artifact_id": meta.backbone,
        }
        headers = {"X-Model-Artifact": meta.artifact_id, "X-Model-Revision": str(meta.revision)}
        if reveal_cohort:
            model["cohort"] = meta.cohort
            headers["X-Model-Cohort"] = meta.cohort
        if meta.backbone is not None:
            headers["X-Model-Backbone"] = meta.backbone
        payload = {
            "ranking": [{"id": i, "score": s, "label": lb} for i, s, lb in ranking],
            "model": model,
            "failover": failover,
        }
        return json.dumps(payload), headers

    @classmethod
    def from_answer(
        cls,
        meta: ModelMeta,
        ranking: Sequence[tuple[str, float, str]],
        *,
        failover: bool,
        reveal_cohort: bool,
    ) -> RankResponse:
        """The model of the answer ``encode`` writes (tests, clients)."""
        body, _ = cls.encode(meta, ranking, failover=failover, reveal_cohort=reveal_cohort)
        return cls.model_validate_json(body)

    def payload(self) -> dict[str, Any]:
        """The JSON object of the answer (``model.cohort`` only where revealed)."""
        hidden = {"model": {"cohort"}} if self.model.cohort is None else None
        return self.model_dump(exclude=hidden)

    def body(self) -> str:
        """The answer's text as the service writes it (``json.dumps``)."""
        return json.dumps(self.payload())

    def headers(self) -> dict[str, str]:
        model = self.model
        headers = {"X-Model-Artifact": model.artifact_id, "X-Model-Revision": str(model.revision)}
        if model.cohort is not None:
            headers["X-Model-Cohort"] = model.cohort
        if model.backbone_artifact_id is not None:
            headers["X-Model-Backbone"] = model.backbone_artifact_id
        return headers


# --------------------------------------------------------------------------- the status


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


class LoopView(BaseModel):
    """A background loop of the router (probing): how often it died and was restarted."""

    restarts: int = 0
    last_error: str | None = None  # the last death: "ExceptionType: message"
    last_error_s_ago: float | None = None


class StatusResponse(BaseModel):
    draining: bool
    in_flight: int
    canary_bp: int
    cohorts: list[CohortView]
    # The router's last refused user_config (category "config", the field path and why); the
    # config before it stays in force. None once a valid config arrives.
    config_error: ErrorInfo | None = None
    probe_loop: LoopView = LoopView()
    # The hot standby (None: the app has no fallback deployment).
    standby: StandbyView | None = None
    # Mirroring to the canary (a rollout's shadow phase): the share of stable's requests
    # copied (bp) and the copies in flight now.
    shadow_bp: int = 0
    shadow_in_flight: int = 0
