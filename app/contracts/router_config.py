"""The router's ``user_config`` (``RouterConfig``): traffic weights and admission bounds,
the hot standby's breakers (``StandbyConfig``) and the shadow phase's mirroring
(``ShadowRouting``). Changed live through ``reconfigure``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from app.contracts.vocabulary import (
    MAX_BYTES,
    MAX_DURATION_S,
    MAX_REQUEST_BODY_BYTES,
    BasisPoints,
    Contract,
    Name,
)

StandbyPolicy = Literal["auto", "always", "never"]


class StandbyConfig(Contract):
    """When the router answers from the ``fallback`` deployment (when the app has one).

    Each primary cohort (stable, canary) has a breaker (``app.standby``). It opens after
    ``trip_after_failures`` handle calls in a row failed or timed out (requests coalesced
    into one call count once), or ``trip_after_probes`` status probes in a row found no
    replica answering: one slow request never trips it. While no primary cohort can take a
    request, the fallback answers it.

    Failing back: once probes find an open cohort serving again, and it has been open at
    least ``min_open_s`` (a cohort whose probes answer while its calls fail must not flap
    every probe interval), it takes
    ``half_open_share`` of its traffic (half-open); after ``fail_back_after_s`` of that
    without a failure its share ramps linearly to all of it over ``ramp_s``. A failure in
    either phase opens the breaker again and the window starts over. Which users come back
    first is decided by a hash of their key, so a user does not flip between models. The
    shares hold back traffic only while the fallback can answer and no primary cohort is
    fully available: beside a healthy primary, or with a refused or cold fallback, a
    recovering cohort takes all its traffic.

    ``policy``: ``auto`` uses the fallback only while its offline evaluation (the
    ``accuracy_metric`` of its manifest's ``offline_evaluation``) is worse than stable's by
    at most ``accuracy_margin`` times the size of stable's number, in the metric's direction;
    otherwise requests get 503 + Retry-After rather than a noticeably worse model. The
    direction is ``accuracy_higher_is_better`` when set, else the known metrics' table
    (``app.standby.METRIC_HIGHER_IS_BETTER``); a metric in neither refuses the fallback. The
    guard trusts the numbers the manifests declare: it does not measure them. ``always`` and
    ``never`` are an operator's override either way.

    A fallback that is not serving (cold: no replica up yet, or still loading) makes requests
    wait for it, at most ``cold_queue_max`` at once and each at most ``cold_wait_s``; beyond
    either, 503 + Retry-After."""

    policy: StandbyPolicy = "auto"
    trip_after_failures: Annotated[int, Field(ge=1, le=10_000)] = 5
    trip_after_probes: Annotated[int, Field(ge=1, le=10_000)] = 3
    min_open_s: Annotated[float, Field(ge=0, le=MAX_DURATION_S)] = 5.0
    fail_back_after_s: Annotated[float, Field(ge=0, le=MAX_DURATION_S)] = 120.0
    half_open_share: Annotated[float, Field(gt=0, le=1)] = 0.05
    ramp_s: Annotated[float, Field(ge=0, le=MAX_DURATION_S)] = 30.0
    accuracy_metric: Name = "ndcg_at_10"
    accuracy_margin: Annotated[float, Field(ge=0, le=1)] = 0.05
    # None: the direction comes from the table of known metrics (unknown: refused).
    accuracy_higher_is_better: bool | None = None
    cold_queue_max: Annotated[int, Field(ge=0, le=100_000)] = 64
    cold_wait_s: Annotated[float, Field(ge=0, le=3600)] = 10.0


class ShadowRouting(Contract):
    """Mirroring of stable's requests to the canary (a rollout's shadow phase).

    ``fraction_bp`` of the requests that stable answers are sent again to the canary once the
    client has its answer (users sampled by a hash of their key, as bucketing does, so a user
    is mirrored on every request or on none); the copy's answer goes to nobody and is only
    compared with stable's (``app.divergence``). At most ``max_in_flight`` copies are in
    flight at once: a copy that finds them all busy is dropped and counted, so a slow canary
    costs the client nothing. The bound is per router replica: the canary sees up to
    ``router_replicas x max_in_flight`` copies. ``top_k`` and ``rbo_p`` are the comparison's
    parameters."""

    fraction_bp: BasisPoints = 0
    max_in_flight: Annotated[int, Field(ge=1, le=10_000)] = 16
    top_k: Annotated[int, Field(ge=1, le=2048)] = 10
    rbo_p: Annotated[float, Field(gt=0, lt=1)] = 0.9

    @property
    def enabled(self) -> bool:
        return self.fraction_bp > 0


class RouterConfig(Contract):
    """The router's ``user_config``: changed live through ``reconfigure`` (no restart)."""

    canary_bp: BasisPoints = 0
    salt: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "ranker"
    allow_cohort_header: bool = False
    # Whether an answer names the cohort that gave it (X-Model-Cohort, model.cohort). Off in
    # production: a client that knows its cohort can aim slow or bad requests at the canary,
    # the cohort being judged. Tests, the demo and tools behind the gateway turn it on.
    reveal_cohort: bool = False
    failover: bool = True
    draining: bool = False
    # Admitted work: requests whose body was read and parsed, until they are answered.
    max_in_flight: Annotated[int, Field(ge=1, le=1_000_000)] = 512
    # Bodies are read before admission, under bounds of their own (app.body_reads): a
    # deadline for the whole body (408), how many are read at once and the bytes they hold
    # together (503); the latter at least one body of the largest size (MAX_REQUEST_BODY_BYTES).
    body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    max_body_reads: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    max_body_read_bytes: Annotated[int, Field(ge=MAX_REQUEST_BODY_BYTES, le=MAX_BYTES)] = 256 << 20
    retry_after_s: Annotated[int, Field(ge=1, le=3600)] = 1
    request_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # Coalescing: at most this many handle calls in flight per replica of a cohort (replicas
    # as seen by the router's probes); requests that arrive meanwhile ride together in the
    # next call (up to coalesce_max_batch of them). A replica computes one batch at a time,
    # so a second call in flight mostly splits the next batch in two.
    coalesce_calls_per_replica: Annotated[int, Field(ge=1, le=64)] = 1
    coalesce_max_batch: Annotated[int, Field(ge=1, le=1024)] = 64
    probe_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # Only used when the app has a fallback deployment (AppArgs.fallback).
    standby: StandbyConfig = StandbyConfig()
    # Off unless a rollout's shadow phase turns it on.
    shadow: ShadowRouting = ShadowRouting()
    # False for a canary pool Serve autoscales down to no replica between rollouts: once found
    # holding no model (or gone) at weight 0 with no mirroring, the router stops probing it,
    # since a probe is a request and would start a replica (nor is it then a failover
    # destination, until it gets weight or copies again).
    probe_idle_canary: bool = True

    @classmethod
    def from_user_config(cls, raw: Mapping[str, Any] | RouterConfig) -> RouterConfig:
        return cls.parse(raw, where="user_config")
