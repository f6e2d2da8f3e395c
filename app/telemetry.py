"""Names of the metrics the router and the replicas export, and of their labels.

One place for the strings that three parties must agree on: the router and the replicas
(which create the metrics with ``ray.serve.metrics``) and the rollout controller's metrics
reader (which finds them in Ray's Prometheus text or through PromQL). No Ray import here.

On export Ray prefixes every name with ``ray_``, adds the ``application``, ``deployment`` and
``replica`` tags, and suffixes counters with ``_total`` (Ray's Prometheus exporter does this,
not us); ``exported_name`` gives the name a reader looks for.

``METRICS`` is the one table of every metric the service exports: its name, kind,
description, labels and (histograms) bucket bounds. The router builds its metrics from it
(``app.ingress.instruments``) and the observability test reads the dashboard against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

# --- label keys -------------------------------------------------------------------------
COHORT: Final = "cohort"  # "stable" | "canary" | "fallback"; on router metrics, the cohort
#                           that answered
OUTCOME: Final = "outcome"  # "ok" | "error" | "diverted", see below
REASON: Final = "reason"  # rejections: "invalid_request" | "body_too_large" | "draining" |
#                           "overloaded" | "unavailable" | "fallback_refused" |
#                           "fallback_not_ready" | "standby_queue_full"; load failures: the
#                           rejection's category
FROM_COHORT: Final = "from_cohort"  # failovers: the cohort that could not answer
STAGE: Final = "stage"  # "download" | "verify" | "load" | "dry_run" | "paced" | "install" |
#                         "total" (app.contracts.LoadTimings' fields, and the whole load)
RESULT: Final = "result"  # load stage result: "ok" | "error"
STATE: Final = "state"  # standby breaker state: "closed" | "open" | "half_open" | "ramping"
ARTIFACT: Final = "artifact"  # shadow comparisons: the canary's artifact id (the candidate)

# --- router -----------------------------------------------------------------------------
# The router adds its request counts up locally and hands them to Ray at least this often
# (one metric call per request costs the hop measurably); Ray exports them with its next
# metrics report. The controller's first window after a weight change waits this plus the
# export interval: a flush is a dozen metric calls (the counts and the gauges), so 4 a
# second are some 50 calls a second beside a router that makes a few per request, and a
# step of a rollout starts its window 0.75 s sooner than at 1 s.
REQUEST_COUNT_FLUSH_S: Final = 0.25
ROUTER_REQUESTS: Final = "ranker_router_requests"  # counter {cohort, outcome}
ROUTER_LATENCY_MS: Final = "ranker_router_latency_ms"  # histogram {cohort, outcome}
ROUTER_BODY_READ_MS: Final = "ranker_router_body_read_ms"  # histogram: uploads, not judged
ROUTER_FAILOVERS: Final = "ranker_router_failovers"  # counter {from_cohort, cohort}
ROUTER_REJECTIONS: Final = "ranker_router_rejections"  # counter {reason}
ROUTER_IN_FLIGHT: Final = "ranker_router_in_flight"  # gauge, sampled every <= 1 s
ROUTER_CANARY_WEIGHT_BP: Final = "ranker_router_canary_weight_bp"  # gauge
ROUTER_BATCH_SIZE: Final = "ranker_router_batch_size"  # histogram {cohort}: coalesced calls
# Hot standby (only an app with a fallback deployment exports these; every <= 1 s):
ROUTER_BREAKER_STATE: Final = "ranker_router_breaker_state"  # gauge {cohort, state}: 1 for
#                                                                the breaker's state, else 0
ROUTER_SERVING_FROM_FALLBACK: Final = "ranker_router_serving_from_fallback"  # gauge: 1 while no
#                                       primary cohort takes all traffic and the fallback answers
ROUTER_PRIMARIES_DOWN: Final = "ranker_router_primaries_down"  # gauge: 1 while no primary
#                                       cohort takes all traffic, fallback or not (alert on it)
ROUTER_FALLBACK_READY: Final = "ranker_router_fallback_ready"  # gauge: 1 while it serves
ROUTER_FALLBACK_ALLOWED: Final = "ranker_router_fallback_allowed"  # gauge: the accuracy guard
ROUTER_FALLBACK_WAITING: Final = "ranker_router_fallback_waiting"  # gauge: requests waiting
#                                                                    for a cold fallback
# Shadow traffic (app.ingress.shadow): copies of stable-answered requests sent to the canary.
ROUTER_SHADOW_REQUESTS: Final = "ranker_router_shadow_requests"  # counter {outcome}: "compared"
#                                   | "dropped" (no room in flight) | "error" (no answer)
ROUTER_SHADOW_RBO: Final = "ranker_router_shadow_rbo"  # histogram {artifact}: rank-biased
#                                   overlap with stable's ranking, per compared copy
ROUTER_SHADOW_OVERLAP: Final = "ranker_router_shadow_topk_overlap"  # histogram {artifact}
ROUTER_SHADOW_SCORE_DIFF: Final = "ranker_router_shadow_max_score_diff"  # histogram {artifact}
ROUTER_SHADOW_TOP1_CHANGED: Final = "ranker_router_shadow_top1_changed"  # counter {artifact}
ROUTER_SHADOW_IN_FLIGHT: Final = "ranker_router_shadow_in_flight"  # gauge, every <= 1 s
ROUTER_SHADOW_FRACTION_BP: Final = "ranker_router_shadow_fraction_bp"  # gauge, every <= 1 s
STANDBY_GAUGES: Final = (
    ROUTER_BREAKER_STATE,
    ROUTER_SERVING_FROM_FALLBACK,
    ROUTER_PRIMARIES_DOWN,
    ROUTER_FALLBACK_READY,
    ROUTER_FALLBACK_ALLOWED,
    ROUTER_FALLBACK_WAITING,
)

# Outcomes: "error": the cohort could not answer (before failover); "diverted": the weights
# chose the cohort but the router sent the request elsewhere at once (breaker open, nothing
# serving), counted without a latency so the judge sees the cohort failing rather than idle.

# Bucket bounds (ms) for latency: steps of at most 1.1x from 1 ms to 10 s (the round values of
# the earlier, coarser grid among them, so a ceiling such as 250 ms stays a bound) and 1.25-1.33x
# above. The sequential judge counts a request as slower than a limit only when its whole
# bucket is (rollout/sequential.py), so the width of the bucket a limit falls in is evidence it
# cannot use (the judge benchmark in docs/benchmarks.md shows what the finer steps bought).
# A quantile read from them is within a few percent. Changing them is a rolling change for
# the judge: it reads every router at the bounds they all export (rollout/metrics.py).
_LATENCY_DECADE: Final = (
    1, 1.1, 1.2, 1.25, 1.4, 1.5, 1.6, 1.75, 1.9, 2, 2.2, 2.4, 2.5, 2.75, 3, 3.25, 3.5, 3.75, 4,
    4.4, 4.8, 5, 5.5, 6, 6.5, 7, 7.5, 8.25, 9,
)  # fmt: skip
LATENCY_BOUNDARIES_MS: Final = (
    *(round(v * 10**k, 6) for k in range(4) for v in _LATENCY_DECADE),
    10000, 12500, 15000, 20000, 25000, 30000,
)  # fmt: skip
BATCH_SIZE_BOUNDARIES: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Shares in [0, 1] (RBO, top-k overlap): finer near 1, where a healthy candidate lies.
SHARE_BOUNDARIES: Final = (
    0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 0.999, 1.0,
)  # fmt: skip
# Score differences (scores are probabilities in [0, 1]).
SCORE_DIFF_BOUNDARIES: Final = (
    1e-6, 1e-5, 1e-4, 1e-3, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0,
)  # fmt: skip

# --- replicas ---------------------------------------------------------------------------
REPLICA_LOAD_STAGE_S: Final = "ranker_replica_load_stage_seconds"  # histogram {cohort, stage,
#                                                                    result}
REPLICA_DESIRED_REVISION: Final = "ranker_replica_desired_revision"  # gauge {cohort}
REPLICA_ACTUAL_REVISION: Final = "ranker_replica_actual_revision"  # gauge {cohort}
REPLICA_LOAD_FAILURES: Final = "ranker_replica_load_failures"  # counter {cohort, reason}
REPLICA_BATCH_SIZE: Final = "ranker_replica_batch_size"  # histogram {cohort}: requests/forward

LOAD_STAGE_BOUNDARIES_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 90, 180, 600)


# --- rollout controller (a Ray actor; ``ray.util.metrics``) ----------------------------------
CHECK: Final = "check"  # a judge check's name (rollout.analysis), or "sample_ratio"
SIDE: Final = "side"  # "against" (the canary) | "for" (it)
MODEL: Final = "model"
ROLLOUT_EVIDENCE: Final = "ranker_rollout_evidence"  # gauge {model, check, side}: e-value
ROLLOUT_EVIDENCE_BOUND: Final = "ranker_rollout_evidence_bound"  # gauge {model, check, side}:
#                                   the e-value at which that side decides (fail / pass / hold)
DRIFT: Final = "drift"  # what drifted in Serve's config: rollout.serve_port's change names
ROLLOUT_DRIFT_REPAIRS: Final = "ranker_rollout_drift_repairs"  # counter {model, drift}: Serve
#                                   config settings the controller found changed and repaired


def exported_name(name: str, *, kind: str) -> str:
    """The series name in Ray's Prometheus output (``kind``: counter, gauge, histogram)."""
    base = f"ray_{name}"
    if kind == "counter":
        return f"{base}_total"
    if kind in ("gauge", "histogram"):
        return base
    raise ValueError(f"unknown metric kind {kind!r}")


# --- the table ---------------------------------------------------------------------------
MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: what creates it passes these to Ray as they are."""

    name: str
    kind: MetricKind
    description: str
    labels: tuple[str, ...] = ()  # tag keys; Ray adds application, deployment and replica
    boundaries: tuple[float, ...] = ()  # histograms only: bucket upper bounds

    @property
    def exported(self) -> str:
        """The series name in Ray's Prometheus output."""
        return exported_name(self.name, kind=self.kind)


METRICS: Final[tuple[MetricSpec, ...]] = (
    # router
    MetricSpec(
        ROUTER_REQUESTS,
        "counter",
        "Rank requests by the cohort asked and the outcome of asking it.",
        (COHORT, OUTCOME),
    ),
    MetricSpec(
        ROUTER_LATENCY_MS,
        "histogram",
        "End-to-end latency of rank requests in the router (ms).",
        (COHORT, OUTCOME),
        LATENCY_BOUNDARIES_MS,
    ),
    MetricSpec(
        ROUTER_FAILOVERS,
        "counter",
        "Requests answered by the other cohort than the one bucketed.",
        (FROM_COHORT, COHORT),
    ),
    MetricSpec(
        ROUTER_BODY_READ_MS,
        "histogram",
        "Time to receive a rank request's body (ms), before its cohort is chosen: "
        "the client's upload, which no judge check reads.",
        (),
        LATENCY_BOUNDARIES_MS,
    ),
    MetricSpec(
        ROUTER_REJECTIONS, "counter", "Rank requests refused by the router, by reason.", (REASON,)
    ),
    MetricSpec(ROUTER_CANARY_WEIGHT_BP, "gauge", "Canary weight in basis points."),
    MetricSpec(
        ROUTER_IN_FLIGHT,
        "gauge",
        "Rank requests admitted and not yet answered (sampled every <= 1 s).",
    ),
    MetricSpec(
        ROUTER_BATCH_SIZE,
        "histogram",
        "Requests per coalesced handle call.",
        (COHORT,),
        BATCH_SIZE_BOUNDARIES,
    ),
    # router: shadow traffic
    MetricSpec(
        ROUTER_SHADOW_REQUESTS,
        "counter",
        "Copies of stable-answered requests for the canary, by outcome.",
        (OUTCOME,),
    ),
    MetricSpec(
        ROUTER_SHADOW_RBO,
        "histogram",
        "Rank-biased overlap of the canary's ranking with stable's, per copy.",
        (ARTIFACT,),
        SHARE_BOUNDARIES,
    ),
    MetricSpec(
        ROUTER_SHADOW_OVERLAP,
        "histogram",
        "Share of stable's top k in the canary's top k, per copy.",
        (ARTIFACT,),
        SHARE_BOUNDARIES,
    ),
    MetricSpec(
        ROUTER_SHADOW_SCORE_DIFF,
        "histogram",
        "Largest score difference of one candidate between the two, per copy.",
        (ARTIFACT,),
        SCORE_DIFF_BOUNDARIES,
    ),
    MetricSpec(
        ROUTER_SHADOW_TOP1_CHANGED,
        "counter",
        "Copies whose first candidate differs from stable's.",
        (ARTIFACT,),
    ),
    MetricSpec(ROUTER_SHADOW_IN_FLIGHT, "gauge", "Copies sent and not answered yet."),
    MetricSpec(
        ROUTER_SHADOW_FRACTION_BP,
        "gauge",
        "Share of stable-answered requests copied to the canary (bp).",
    ),
    # router: hot standby
    MetricSpec(
        ROUTER_BREAKER_STATE,
        "gauge",
        "A primary cohort's standby breaker: 1 for its state, 0 for the others.",
        (COHORT, STATE),
    ),
    MetricSpec(
        ROUTER_SERVING_FROM_FALLBACK,
        "gauge",
        "1 while no primary cohort takes all traffic and the fallback answers.",
    ),
    MetricSpec(
        ROUTER_PRIMARIES_DOWN,
        "gauge",
        "1 while no primary cohort takes all traffic, fallback or not.",
    ),
    MetricSpec(ROUTER_FALLBACK_READY, "gauge", "1 while a fallback replica serves a model."),
    MetricSpec(
        ROUTER_FALLBACK_ALLOWED,
        "gauge",
        "1 while the accuracy guard (or the policy) lets the fallback answer.",
    ),
    MetricSpec(ROUTER_FALLBACK_WAITING, "gauge", "Requests waiting for a cold fallback."),
    # replicas
    MetricSpec(
        REPLICA_LOAD_STAGE_S,
        "histogram",
        "Duration of each stage of loading a model target.",
        (COHORT, STAGE, RESULT),
        LOAD_STAGE_BOUNDARIES_S,
    ),
    MetricSpec(
        REPLICA_DESIRED_REVISION,
        "gauge",
        "Revision of the target this replica should serve.",
        (COHORT,),
    ),
    MetricSpec(
        REPLICA_ACTUAL_REVISION,
        "gauge",
        "Revision of the generation this replica serves.",
        (COHORT,),
    ),
    MetricSpec(
        REPLICA_LOAD_FAILURES,
        "counter",
        "Failed attempts to load a target, by rejection category.",
        (COHORT, REASON),
    ),
    MetricSpec(
        REPLICA_BATCH_SIZE,
        "histogram",
        "Requests per forward pass.",
        (COHORT,),
        BATCH_SIZE_BOUNDARIES,
    ),
    # rollout controller
    MetricSpec(
        ROLLOUT_EVIDENCE,
        "gauge",
        "Sequential judge: e-value against / for the canary, per check",
        (MODEL, CHECK, SIDE),
    ),
    MetricSpec(
        ROLLOUT_EVIDENCE_BOUND,
        "gauge",
        "Sequential judge: the e-value at which a check fails / passes",
        (MODEL, CHECK, SIDE),
    ),
    MetricSpec(
        ROLLOUT_DRIFT_REPAIRS,
        "counter",
        "Serve config settings found changed behind the controller and repaired",
        (MODEL, DRIFT),
    ),
)
METRIC_SPECS: Final[Mapping[str, MetricSpec]] = {spec.name: spec for spec in METRICS}
