"""The vocabulary every contract speaks: cohorts and roles, revisions, the bounded
types and limits fields are declared with, the phases of a replica and of a rollout, and
``Contract``, the base every cross-process model derives from.

Every model refuses unknown fields by name, and every number and string is bounded: a config
or report that would make a process sleep for years, allocate without limit or print
megabytes is refused where it arrives.

The model families an application registers when its args name none live here as well:
the contracts' defaults name them, and ``app.model_family`` (which imports the contracts'
wire types) takes them from here, so the dependency runs one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, Self, overload

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from app.errors import ConfigError

Cohort = Literal["stable", "canary"]
# The request schema of the default model family (``app.models.ranker_mlp``); a test checks
# the two agree.
DEFAULT_FEATURE_SCHEMA: Final = "ranker-features-v3"
STABLE: Final = "stable"
CANARY: Final = "canary"
COHORTS: Final[tuple[Cohort, Cohort]] = (STABLE, CANARY)
# What a ranker deployment is: one of the two primary cohorts, or the hot standby the router
# answers from only while neither primary cohort can (``StandbyConfig``). The fallback has
# no registry target and takes no part in rollouts: its target comes from the Serve config.
Role = Literal["stable", "canary", "fallback"]
FALLBACK: Final = "fallback"
ROLES: Final[tuple[Role, Role, Role]] = (STABLE, CANARY, FALLBACK)

# Weights are in basis points: 10 000 = 100%.
BASIS_POINTS: Final = 10_000

MiB: Final = 1 << 20
GiB: Final = 1 << 30
# Bounds shared by many fields: generous for any real deployment, small enough that a typo
# (an extra zero group, seconds given as milliseconds) is refused rather than obeyed.
MAX_BYTES: Final = 1 << 50  # 1 PiB
MAX_REQUEST_BODY_BYTES: Final = 8 << 20  # one request's body (app.api.MAX_BODY_BYTES)
MAX_REVISION: Final = (1 << 53) - 1  # exact in JSON numbers
MAX_WALL_CLOCK: Final = 4_102_444_800.0  # 2100-01-01 in Unix seconds
MAX_DURATION_S: Final = 7 * 24 * 3600.0


MAX_TEXT: Final = 4000  # characters of a message or reason
MAX_FIELD_PATH: Final = 400  # characters of a config field path ("user_config.batching....")
MAX_REPORTED_REVISIONS: Final = 1000  # discarded revisions in one instance report
MAX_BATCH_SIZE: Final = 1024  # handle calls a replica's @serve.batch may merge into one forward
MAX_EVALUATION_ENTRIES: Final = 64  # numbers of an offline evaluation a report carries


# The model families an application registers when its args name none (``AppArgs.models``,
# ``ReplicaConfig.models``); ``app.model_family`` re-exports it.
DEFAULT_FAMILIES: Final[tuple[str, ...]] = ("app.models.ranker_mlp",)


@overload
def clip_text(text: str, limit: int = ...) -> str: ...
@overload
def clip_text(text: None, limit: int = ...) -> None: ...
def clip_text(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """``text`` cut to fit a bounded field (an exception's message can be any length: a
    state-dict mismatch lists every key), marked with "..." where it was cut."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def _lower(value: str) -> str:
    return value.lower()


Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
PathText = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
# A Python module's dotted import path (a model family: ``app.models.ranker_mlp``).
ImportPath = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
    ),
]
ModelFamilies = Annotated[list[ImportPath], Field(min_length=1, max_length=32)]
Uri = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$"), AfterValidator(_lower)]
Revision = Annotated[int, Field(ge=1, le=MAX_REVISION)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Seconds = Annotated[float, Field(ge=0, le=MAX_DURATION_S)]
WallClock = Annotated[float, Field(ge=0, le=MAX_WALL_CLOCK)]
BasisPoints = Annotated[int, Field(ge=0, le=BASIS_POINTS)]


Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class Contract(BaseModel):
    """Frozen, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | Self, *, where: str) -> Self:
        """Validate ``raw``; ConfigError names the first bad field as ``where.<path>``."""
        if isinstance(raw, cls):
            return raw
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            path = ".".join(str(p) for p in first.get("loc", ()))
            field = f"{where}.{path}" if path else where
            raise ConfigError(f"{field}: {first.get('msg')}", field=field) from None


class ReplicaPhase(StrEnum):
    """Where a replica stands with its desired target."""

    IDLE = "idle"  # no target at all (an idle pool, or the target was cleared)
    LOADING = "loading"  # working on its desired target (may still serve an older model)
    BACKOFF = "backoff"  # waiting to retry after a transient failure
    READY = "ready"  # serving its desired target
    FAILED = "failed"  # gave up on the desired target; the previous generation serves


class RolloutPhase(StrEnum):
    PENDING = "pending"
    """Accepted and persisted; nothing in the cluster has been changed yet."""

    PREPARING = "preparing"
    """The canary pool has been given the candidate as its target and carries no traffic;
    waiting until every canary replica reports the candidate loaded, verified and ready."""

    SHADOWING = "shadowing"
    """(A plan with a shadow phase.) The canary is ready and carries no user traffic; the
    router copies a sample of stable's requests to it, off the clients' path, and compares the
    rankings. One window per interval is judged against the expected divergence until the
    comparison shows the candidate within it (then the first step) or outside it (rolled
    back before any user was answered by it)."""

    PROGRESSING = "progressing"
    """At ``step_index``: the canary pool is scaled for the step, then the router is given the
    step's weights, then one analysis window per interval is judged until one passes."""

    PAUSED = "paused"
    """Held at a manual gate or by an operator's pause; the weights stay where they are and
    windows are still judged (a failing canary is rolled back even while paused), but nothing
    advances until ``resume`` or ``promote``. The progress deadline does not run."""

    PROMOTING = "promoting"
    """The stable pool is moving to the candidate: ``shift`` first puts the canary at 100%
    then gives stable the candidate with no traffic; ``in_place`` gives stable the candidate
    while it serves. Ends when every stable replica reports the candidate ready."""

    FINALISING = "finalising"
    """Stable serves the candidate; traffic is returned to stable 100% and, once the router
    confirms it, the canary pool is cleared and scaled to its idle size."""

    SUCCEEDED = "succeeded"
    """Terminal: the candidate is the stable model and carries all traffic."""

    ROLLED_BACK = "rolled_back"
    """Terminal: the canary had traffic and was withdrawn (failed checks at the threshold, the
    progress deadline, a canary replica failing, or an operator's rollback); stable serves the
    baseline."""

    FAILED = "failed"
    """Terminal: the rollout could not be carried out (the candidate failed to load, replicas
    never became ready, the stable pool could not take the candidate); stable serves the
    baseline."""

    ABORTED = "aborted"
    """Terminal: an operator aborted the rollout; weights went back to stable first."""

    @property
    def is_terminal(self) -> bool:
        return self.value in TERMINAL_ROLLOUT_PHASES


# The registry stores phases as text: these names finish a rollout there.
TERMINAL_ROLLOUT_PHASES: Final[frozenset[str]] = frozenset(
    {"succeeded", "rolled_back", "failed", "aborted"}
)

OperatorCommandName = Literal["pause", "resume", "promote", "abort", "rollback"]
