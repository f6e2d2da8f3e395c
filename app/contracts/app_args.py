"""What the service's processes are started with: the Serve application's ``args``
(``AppArgs``, one ``CohortArgs`` per ranker deployment) and the controller actor's
``ControllerSettings``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.contracts.replica_config import (
    BatchingConfig,
    ControllerRef,
    FaultInjection,
    LoadingConfig,
    MemoryConfig,
    RetryConfig,
    SignatureTrust,
)
from app.contracts.router_config import RouterConfig
from app.contracts.targets import Target
from app.contracts.vocabulary import (
    DEFAULT_FAMILIES,
    MAX_BYTES,
    Contract,
    ModelFamilies,
    Name,
    PathText,
    Revision,
    Uri,
)


class CohortArgs(Contract):
    """One ranker deployment (stable, canary or fallback). Serve's ``autoscaling_config``
    for it goes in the Serve config's ``deployments`` list, where Serve changes it in place
    (docs/deploying.md, "Autoscaling"); ``num_replicas`` is then ignored."""

    num_replicas: Annotated[int, Field(ge=0, le=10_000)] = 1
    num_cpus: Annotated[float, Field(ge=0, le=1024)] = 0.25
    num_gpus: Annotated[float, Field(ge=0, le=64)] = 0.0
    memory_bytes: Annotated[int, Field(gt=0, le=MAX_BYTES)] | None = None
    target: Target | None = None
    # Local configs only: name a demo artifact (e.g. "ranker-v41") instead of a target; it is
    # created under ``demo_artifacts_dir`` when missing and served as ``demo_revision``.
    demo_artifact: Name | None = None
    demo_revision: Revision = 1
    max_ongoing_requests: Annotated[int, Field(ge=1, le=100_000)] = 256
    # Health checks do not run while reconfigure runs, and the startup load happens in
    # reconfigure, so these only need to catch faults of a running replica.
    health_check_period_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    health_check_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    graceful_shutdown_wait_loop_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    graceful_shutdown_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 20.0
    faults: FaultInjection | None = None  # tests only; see FaultInjection


class AppArgs(Contract):
    """The Serve application's ``args`` (``deployments.app:build_app``)."""

    # The model families the replicas can build, by import path (each module's ``FAMILY``,
    # an ``app.model_family.ModelFamily``); a manifest's ``architecture.name`` selects one.
    models: ModelFamilies = list(DEFAULT_FAMILIES)
    # The request schema the HTTP route speaks (one of the families'); None: the first
    # family's. Every cohort serves it: a target made for another schema is refused.
    feature_schema: Name | None = None
    stable: CohortArgs = CohortArgs()
    canary: CohortArgs = CohortArgs(num_replicas=1)
    # The hot standby (RouterConfig.standby says when it answers): typically a smaller model
    # on cheaper capacity. None: no fallback deployment.
    fallback: CohortArgs | None = None
    router: RouterConfig = RouterConfig()
    router_replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    router_num_cpus: Annotated[float, Field(ge=0, le=1024)] = 0.25
    router_max_ongoing_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    # Shared replica settings.
    cache_dir: PathText = "var/cache"
    cache_byte_budget: Annotated[int, Field(gt=0, le=MAX_BYTES)] | None = None
    batching: BatchingConfig = BatchingConfig()
    memory: MemoryConfig = MemoryConfig()
    loading: LoadingConfig = LoadingConfig()
    retry: RetryConfig = RetryConfig()
    trust_key: PathText | None = None  # see ReplicaConfig.trust_key
    trust: SignatureTrust = SignatureTrust()
    controller: ControllerRef | None = None
    report_interval_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    demo_artifacts_dir: PathText | None = None  # local only; see CohortArgs.demo_artifact
    # "router": the full graph. "ranker_only": one stable ranker deployment serving HTTP
    # itself, no router (the benchmark's baseline for the cost of the router hop).
    mode: Literal["router", "ranker_only"] = "router"
    # Serve's per-call access log line costs CPU on every request and every router probe.
    access_log: bool = False


class ControllerSettings(Contract):
    """Where the controller actor finds everything (given to the actor when it is created)."""

    registry_url: Uri
    dashboard_url: Uri
    model: Name = "ranker"
    environment: Name = "default"
    app_name: Name = "ranker"
    router_deployment: Name = "router"
    stable_deployment: Name = "stable"
    canary_deployment: Name = "canary"
    tick_interval_s: Annotated[float, Field(gt=0, le=300)] = 1.0
    # Reports older than this do not count as a replica's state.
    report_stale_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # The router hands its counts to Ray within 0.25 s and Ray exports them once per report
    # interval (``metrics_report_interval_ms``): the first window after a weight change starts
    # at least this long after the weights went live, so that no request answered under the
    # previous weights is counted in it. The controller raises it to what the interval it
    # observes in its cluster needs (rollout.engine.window_delay_s).
    metrics_delay_s: Annotated[float, Field(ge=0, le=600)] = 2.0
    # Empty: discover every node's metrics endpoint through Ray.
    metrics_endpoints: Annotated[tuple[Uri, ...], Field(max_length=10_000)] = ()
    prometheus_url: Uri | None = None  # set: use PromQL instead of scraping
    # How often the sequential judge adds evidence (it acts as soon as a bound is crossed).
    # None: at every metrics export when the controller scrapes Ray's endpoints (their values
    # move once per report interval), else once per plan interval; with ``prometheus_url``,
    # Prometheus' scrape interval or a multiple of it (a shorter range holds no increase).
    evidence_interval_s: Annotated[float, Field(gt=0, le=600)] | None = None
    actor: Name = "rollout-controller"  # who the audit log says moved a target
