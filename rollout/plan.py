"""The rollout plan: how a candidate is brought from 0% to serving everything, declaratively.

Pure module: pydantic models, frozen, with every default in this file (``configs/rollout.yaml``
mirrors them). Only ``load_plan`` touches the filesystem. A plan is validated when it is built,
so the state machine never has to second-guess one; an invalid plan is refused with the
offending field named (``pydantic.ValidationError`` from the constructor, ``ConfigError`` from
``load_plan`` / ``plan_from_mapping``).

Weights are canary percentages here (what an operator writes); the machine turns them into
basis points for the router (``percent_to_bp``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.errors import ConfigError

# Defaults, in one place. configs/rollout.yaml repeats them and a unit test keeps the two equal.
DEFAULT_STEPS: Final = (5.0, 25.0, 50.0, 100.0)
DEFAULT_INTERVAL_S: Final = 60.0
DEFAULT_MIN_REQUESTS: Final = 100
# Three failed windows in a row roll back: one bad window is as likely noise as a regression.
DEFAULT_THRESHOLD: Final = 3
DEFAULT_PROGRESS_DEADLINE_S: Final = 600.0
DEFAULT_SUCCESS_RATE_MIN: Final = 0.98
DEFAULT_P99_MAX_MS: Final = 250.0
# The canary may fail up to 3x as often as stable in the same window (see the floor below).
DEFAULT_ERROR_RATE_MAX_RATIO: Final = 3.0
DEFAULT_ERROR_RATE_FLOOR: Final = 0.01
# The canary's p99 may be up to 1.5x stable's in the same window (plus the slack below).
DEFAULT_P99_MAX_RATIO: Final = 1.5
DEFAULT_P99_SLACK_MS: Final = 5.0

# The sequential judge's error levels: a canary that meets every hypothesis is rolled back by
# the judge in at most ALPHA of rollouts; one that misses a hypothesis passes a step in at most
# BETA of them.
DEFAULT_JUDGE: Final = "sequential"
DEFAULT_ALPHA: Final = 0.01
DEFAULT_BETA: Final = 0.05
# The canary's share of requests may depart from its weight by this much (relative) before the
# sample-ratio guard holds the rollout: bucketing by user makes the share vary with which users
# fall under the weight.
DEFAULT_SAMPLE_RATIO_TOLERANCE: Final = 0.5

# The shadow phase (off unless a plan has a ``shadow`` block): see ShadowPlan.
DEFAULT_SHADOW_FRACTION: Final = 0.1
DEFAULT_SHADOW_MAX_IN_FLIGHT: Final = 16
DEFAULT_SHADOW_MIN_COMPARED: Final = 200
DEFAULT_SHADOW_TOP_K: Final = 10
DEFAULT_SHADOW_RBO_P: Final = 0.9
DEFAULT_SHADOW_RBO_MEAN_MIN: Final = 0.9
DEFAULT_SHADOW_TOP1_CHANGE_MAX: Final = 0.1
DEFAULT_SHADOW_TOLERANCE: Final = 0.05

PromotionStrategy = Literal["shift", "in_place"]
HeadSwap = Literal["prefer", "require", "never"]
JudgeName = Literal["sequential", "threshold"]


def percent_to_bp(percent: float) -> int:
    """Canary percent -> basis points; plans only hold percents that convert exactly."""
    return round(percent * 100)


class AnalysisChecks(BaseModel):
    """The hypotheses a canary must satisfy. A check set to ``None`` is switched off.

    The threshold judge tests them on each window alone; the sequential judge decides them
    with evidence accumulated over the rollout (rollout/sequential.py), reading ``p99 <= x`` as
    "at most 1% of requests slower than x".

    Relative checks compare the canary with the stable cohort *in the same window*:
    - error rate: ``canary <= max(error_rate_max_ratio x stable, error_rate_floor)``; the floor
      keeps one error from being fatal when the baseline happens to have none;
    - p99: ``canary <= max(p99_max_ratio x stable, stable + p99_slack_ms)``; the slack keeps a
      millisecond of jitter on a very fast baseline from reading as a 1.5x regression.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    success_rate_min: float | None = Field(default=DEFAULT_SUCCESS_RATE_MIN, gt=0.0, le=1.0)
    p99_max_ms: float | None = Field(default=DEFAULT_P99_MAX_MS, gt=0.0)
    error_rate_max_ratio: float | None = Field(default=DEFAULT_ERROR_RATE_MAX_RATIO, ge=1.0)
    error_rate_floor: float = Field(default=DEFAULT_ERROR_RATE_FLOOR, ge=0.0, le=1.0)
    p99_max_ratio: float | None = Field(default=DEFAULT_P99_MAX_RATIO, ge=1.0)
    p99_slack_ms: float = Field(default=DEFAULT_P99_SLACK_MS, ge=0.0)

    @property
    def needs_baseline(self) -> bool:
        return self.error_rate_max_ratio is not None or self.p99_max_ratio is not None

    @model_validator(mode="after")
    def _at_least_one_check(self) -> AnalysisChecks:
        if all(
            value is None
            for value in (
                self.success_rate_min,
                self.p99_max_ms,
                self.error_rate_max_ratio,
                self.p99_max_ratio,
            )
        ):
            raise ValueError("at least one check must be enabled (all are null)")
        return self


class ShadowPlan(BaseModel):
    """The shadow phase: after the canary is ready and before its first live step, it gets
    no user traffic while the router copies ``fraction`` of stable's requests to it (users
    sampled by key, off the client's path, at most ``max_in_flight`` copies at once: the
    rest are dropped and counted) and compares the two rankings (``top_k`` overlap,
    rank-biased overlap with ``rbo_p``, top-1 change).

    The gate, decided with the same anytime-valid evidence as the live checks
    (rollout/shadow_judge.py):
    - with the candidate's ``metadata.expected_divergence`` recorded against this rollout's
      baseline (same ``top_k`` and ``rbo_p``): mean RBO and the top-1 change rate must lie
      within ``tolerance`` of what was recorded, on either side (a candidate that suddenly
      ranks like the baseline is as wrong as one that ranks like nothing);
    - otherwise: mean RBO >= ``rbo_mean_min`` and top-1 change rate <= ``top1_change_max``.
    The phase passes once every bound is shown with at least ``min_compared`` copies
    compared, and fails as soon as the evidence against one crosses; only the progress
    deadline bounds waiting (a canary too busy to answer copies cannot pass)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: float = Field(default=DEFAULT_SHADOW_FRACTION, gt=0.0, le=1.0)
    max_in_flight: int = Field(default=DEFAULT_SHADOW_MAX_IN_FLIGHT, ge=1, le=10_000)
    min_compared: int = Field(default=DEFAULT_SHADOW_MIN_COMPARED, ge=1)
    top_k: int = Field(default=DEFAULT_SHADOW_TOP_K, ge=1, le=2048)
    rbo_p: float = Field(default=DEFAULT_SHADOW_RBO_P, gt=0.0, lt=1.0)
    rbo_mean_min: float = Field(default=DEFAULT_SHADOW_RBO_MEAN_MIN, gt=0.0, lt=1.0)
    top1_change_max: float = Field(default=DEFAULT_SHADOW_TOP1_CHANGE_MAX, gt=0.0, lt=1.0)
    tolerance: float = Field(default=DEFAULT_SHADOW_TOLERANCE, gt=0.0, lt=1.0)

    @field_validator("fraction")
    @classmethod
    def _whole_basis_points(cls, fraction: float) -> float:
        if abs(fraction * 10_000 - round(fraction * 10_000)) > 1e-6 or round(fraction * 10_000) < 1:
            raise ValueError(f"{fraction} is not a whole number of basis points (0.0001)")
        return fraction

    @property
    def fraction_bp(self) -> int:
        return round(self.fraction * 10_000)


# The placeholders a custom check's query may hold: the cohort it is asked for, the Serve
# application, and the range of the window (PromQL duration, e.g. ``5000ms``).
QUERY_PLACEHOLDERS: Final = ("cohort", "app", "window")
_PLACEHOLDER = re.compile(r"\{\{\s*([^}]*?)\s*\}\}")
BUILT_IN_CHECKS: Final = (
    "success_rate",
    "p99_ceiling",
    "error_rate_vs_stable",
    "p99_vs_stable",
    "sample_ratio",
    "sample_size",
)


class CustomCheck(BaseModel):
    """A check of the team's own signal (a business KPI, GPU memory, a queue's depth), read
    from a Prometheus server with one PromQL query per cohort. Two kinds:

    - counts (``events``, ``trials``, ``max_rate``): the canary's rate of events per trial
      (failed checkouts per checkout) is at most ``max_rate``. The queries give each cohort's
      counts over a window (``increase(...[{{window}}])``); the sequential judge decides it
      with the same evidence as its own checks, sharing ``alpha`` with them;
    - level (``query``, ``max`` and/or ``min``): the canary's value (GPU memory in use, a queue
      length) at each evaluation; a gate: the step does not pass while it is out of bounds, and
      ``failure_limit`` evaluations out of bounds in a row roll back.

    ``advisory: true``: evaluated, shown and exported, never acting (neither failing nor
    holding the canary): a new check watched before it may roll back. Queries may hold
    ``{{cohort}}`` (``canary`` or ``stable``), ``{{app}}`` (the Serve application) and
    ``{{window}}`` (the window's range); nothing else between double braces."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,62}$")
    events: str | None = Field(default=None, min_length=1, max_length=4000)
    trials: str | None = Field(default=None, min_length=1, max_length=4000)
    max_rate: float | None = Field(default=None, gt=0.0, lt=1.0)
    query: str | None = Field(default=None, min_length=1, max_length=4000)
    max: float | None = None
    min: float | None = None
    failure_limit: int = Field(default=3, ge=1, le=100)
    advisory: bool = False

    @property
    def counts(self) -> bool:
        return self.events is not None

    @field_validator("events", "trials", "query")
    @classmethod
    def _known_placeholders(cls, template: str | None) -> str | None:
        if template is None:
            return None
        for found in _PLACEHOLDER.findall(template):
            if found not in QUERY_PLACEHOLDERS:
                raise ValueError(
                    f"{{{{{found}}}}} is not a placeholder: use {{{{cohort}}}}, {{{{app}}}} "
                    "or {{window}}"
                )
        return template

    @model_validator(mode="after")
    def _one_kind(self) -> CustomCheck:
        counts = (self.events, self.trials, self.max_rate)
        level = self.query is not None or self.max is not None or self.min is not None
        if any(v is not None for v in counts):
            if any(v is None for v in counts) or level:
                raise ValueError(
                    f"{self.name}: a counts check has events, trials and max_rate (and no "
                    "query, max or min)"
                )
        elif self.query is None or (self.max is None and self.min is None):
            raise ValueError(
                f"{self.name}: a check has events, trials and max_rate, or a query with max "
                "and/or min"
            )
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"{self.name}: min {self.min:g} is above max {self.max:g}")
        if self.name in BUILT_IN_CHECKS:
            raise ValueError(f"{self.name}: the name of a built-in check")
        return self


class Gates(BaseModel):
    """Manual gates: the rollout pauses there until an operator resumes or promotes.

    ``pause_before_steps`` names steps by their canary percent (each must be one of ``steps``);
    pausing before a step holds the canary at the previous step's weight (0% before the first).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pause_before_promotion: bool = False
    pause_before_steps: tuple[float, ...] = ()


class CanaryScaling(BaseModel):
    """Canary pool size follows its weight: ``ceil(max_replicas x percent / 100)`` clamped to
    ``[min_replicas, max_replicas]``. ``idle_replicas`` is the pool size once the rollout ends
    (its target is cleared, so the pool holds no model). For a canary deployment Serve
    autoscales, the size set is the autoscaler's floor (``min_replicas``): the autoscaler may
    add replicas for load, and only replicas that report ready count. ``idle_replicas`` 0
    releases the pool's GPUs between rollouts; it needs an autoscaled canary (Serve's
    ``num_replicas`` refuses 0, its ``autoscaling_config.min_replicas`` does not): a rollout
    with it is refused at its start otherwise."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=2, ge=1)
    idle_replicas: int = Field(default=1, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> CanaryScaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas: {self.max_replicas} is below min_replicas ({self.min_replicas})"
            )
        return self

    def replicas_for(self, percent: float) -> int:
        wanted = math.ceil(self.max_replicas * percent / 100 - 1e-9)
        return max(self.min_replicas, min(self.max_replicas, wanted))


class RolloutPlan(BaseModel):
    """How one rollout proceeds (Flagger's ``CanaryAnalysis``, Argo's canary steps).

    - ``judge``: ``sequential`` (the default: evidence accumulated over the rollout, valid
      however often it is looked at; a window fails the canary as soon as the evidence
      against it crosses ``checks / alpha``, a step passes when every check shows the canary
      within its hypothesis at ``1 / beta``) or ``threshold`` (each window judged alone;
      ``threshold`` consecutive failed windows roll back).
    - ``alpha`` / ``beta``: the sequential judge's error levels (see above);
      ``sample_ratio_tolerance``: how far (relative) the canary's share of requests may depart
      from its weight before the sample-ratio guard holds the rollout.
    - ``steps``: canary weights in percent, strictly increasing, each in (0, 100] and a whole
      number of basis points. Ending at 100 is allowed but not required: promotion always
      follows the last step, and a ``shift`` promotion moves the canary to 100% itself. A step
      at 100% leaves no stable traffic to compare with, so it is judged on the absolute
      checks only.
    - ``interval_s``: length of one analysis window; one window is judged per interval.
    - ``min_requests``: requests each cohort must serve in a window for it to count; fewer is
      inconclusive (hold), never a failure. The sequential judge keeps it as a sanity floor:
      a thinner window's evidence still counts, but a step never passes on it.
    - ``threshold``: (threshold judge) consecutive failed windows that roll back; a passing
      window resets the count.
    - ``progress_deadline_s``: longest time a phase or step may wait for progress (replicas
      ready, a conclusive passing window, promotion complete); past it the rollout is withdrawn.
      Left out (None), the sequential judge's start-time estimate sets it: the time by which
      99.5% of healthy canaries pass the slowest step at the traffic measured before the start
      (rollout/estimate.py), never under 600 s (``deadline_s``). A plan that sets it is held to
      it: ``rollout start`` refuses it when a step does not fit (``--force`` starts it anyway).
    - ``shadow``: a shadow phase before the first step (``ShadowPlan``); None: none.
    - ``custom_checks``: checks of the team's own signals from Prometheus (``CustomCheck``);
      they need the controller's ``prometheus_url`` and the sequential judge.
    - ``promotion``: ``shift`` (canary carries 100% while stable loads the candidate with no
      traffic, then traffic returns to stable) or ``in_place`` (stable hot-swaps while serving;
      used only when the memory budget is observed to allow it, otherwise ``shift``).
    - ``head_swap``: when only a head changes (the canary's candidate and every stable
      replica run on one backbone), ``prefer`` promotes in place whatever ``promotion``
      says, if the budget allows it (a head beside a shared backbone usually fits);
      ``require`` does too and fails the rollout at promotion when the budget does not
      (never a shift); ``never`` leaves the choice to ``promotion``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    judge: JudgeName = DEFAULT_JUDGE
    # Below 1e-6 the bounds (checks / alpha) would pass what status views can show (1e15).
    alpha: float = Field(default=DEFAULT_ALPHA, ge=1e-6, le=0.5)
    beta: float = Field(default=DEFAULT_BETA, ge=1e-6, le=0.5)
    sample_ratio_tolerance: float = Field(default=DEFAULT_SAMPLE_RATIO_TOLERANCE, gt=0.0, lt=1.0)
    steps: tuple[float, ...] = Field(default=DEFAULT_STEPS, min_length=1)
    interval_s: float = Field(default=DEFAULT_INTERVAL_S, gt=0.0)
    min_requests: int = Field(default=DEFAULT_MIN_REQUESTS, ge=1)
    checks: AnalysisChecks = Field(default_factory=AnalysisChecks)
    threshold: int = Field(default=DEFAULT_THRESHOLD, ge=1)
    progress_deadline_s: float | None = Field(default=None, gt=0.0)
    promotion: PromotionStrategy = "shift"
    head_swap: HeadSwap = "prefer"
    gates: Gates = Field(default_factory=Gates)
    canary_scaling: CanaryScaling = Field(default_factory=CanaryScaling)
    shadow: ShadowPlan | None = None
    custom_checks: tuple[CustomCheck, ...] = Field(default=(), max_length=16)

    @field_validator("steps")
    @classmethod
    def _valid_steps(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        for index, percent in enumerate(steps):
            if not 0 < percent <= 100:
                raise ValueError(f"step {index} is {percent}: each step must be in (0, 100]")
            if abs(percent * 100 - percent_to_bp(percent)) > 1e-6:
                raise ValueError(f"step {index} is {percent}: weights are whole basis points")
            if index and percent <= steps[index - 1]:
                raise ValueError(
                    f"step {index} is {percent}: steps must be strictly increasing "
                    f"(previous {steps[index - 1]})"
                )
        return steps

    @model_validator(mode="after")
    def _consistent(self) -> RolloutPlan:
        # Messages of this validator start with the field they are about; _field_of reads it.
        names = [c.name for c in self.custom_checks]
        if len(set(names)) != len(names):
            raise ValueError(f"custom_checks: names must differ ({names})")
        if self.custom_checks and self.judge != "sequential":
            raise ValueError(
                "custom_checks: judged by the sequential judge only (judge: sequential)"
            )
        for percent in self.gates.pause_before_steps:
            if percent not in self.steps:
                raise ValueError(
                    f"gates.pause_before_steps: {percent} is not one of steps {list(self.steps)}"
                )
        # A deadline shorter than two windows would withdraw a healthy canary whose first
        # window straddled a weight change.
        if self.progress_deadline_s is not None and self.progress_deadline_s < 2 * self.interval_s:
            raise ValueError(
                f"progress_deadline_s: {self.progress_deadline_s} must be at least twice "
                f"interval_s ({self.interval_s})"
            )
        return self

    @property
    def deadline_s(self) -> float:
        """The progress deadline: the plan's, or, where it leaves it to the estimate and none
        was made (no traffic measured, the threshold judge), the default (at least two
        windows)."""
        if self.progress_deadline_s is not None:
            return self.progress_deadline_s
        return max(DEFAULT_PROGRESS_DEADLINE_S, 2 * self.interval_s)

    def step_bp(self, index: int) -> int:
        return percent_to_bp(self.steps[index])

    def gate_before_step(self, index: int) -> bool:
        return self.steps[index] in self.gates.pause_before_steps


_LEADING_FIELD = re.compile(r"^([a-z_][a-z0-9_.]*): ")


def _field_of(exc: ValidationError) -> tuple[str, str]:
    """The dotted field path and message of the first error. A cross-field (model) validator
    reports at its model's location, so its message leads with the field it is about."""
    first = exc.errors()[0]
    parts = [str(part) for part in first["loc"]]
    message = str(first["msg"]).removeprefix("Value error, ")
    leading = _LEADING_FIELD.match(message)
    if leading:
        parts.append(leading.group(1))
        message = message[leading.end() :]
    return ".".join(parts) or "<root>", message


def plan_from_mapping(data: Any, *, source: str = "plan") -> RolloutPlan:
    """Validate a plan given as plain data (YAML/JSON); ConfigError names the field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a rollout plan is a mapping, got {type(data).__name__}")
    try:
        return RolloutPlan.model_validate(data)
    except ValidationError as exc:
        where, message = _field_of(exc)
        raise ConfigError(
            f"{source}: invalid rollout plan: {where}: {message}", field=where
        ) from exc


def load_plan(path: str | Path) -> RolloutPlan:
    """Read a plan from a YAML file whose top level holds the plan's fields."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read rollout plan: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte {exc.start}): a rollout plan is YAML"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return plan_from_mapping(data, source=str(path))
