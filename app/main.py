"""The application builder: the only place the deployment graph is bound.

``build_app(args)`` takes validated ``AppArgs`` and returns the Serve ``Application``::

    router (ingress) --> stable  (Ranker, cohort "stable")
                     \\-> canary  (Ranker, cohort "canary")

Stable and canary are two ``.options(name=...)`` copies of ONE replica class that differ only
in their ``user_config``. Configs point Serve here with ``import_path: app.main:build_app`` and
pass ``args``; Serve validates them into ``AppArgs`` (typed builder).

Relative paths (cache, demo artifacts) are resolved against the project root, not the
process's working directory: the builder and the replicas run in Ray worker processes whose
working directory is not the one ``serve run`` was started from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from app.api import RouterConfig
from app.errors import ConfigError
from app.replica import (
    BatchingConfig,
    ControllerRef,
    FaultInjection,
    LoadingConfig,
    MemoryConfig,
    ReplicaConfig,
    RetryConfig,
    TargetConfig,
)

PROJECT_ROOT: Final = Path(__file__).resolve().parents[1]


def project_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else PROJECT_ROOT / p


class CohortArgs(BaseModel):
    """One ranker deployment (stable or canary)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: Annotated[int, Field(ge=0)] = 1
    num_cpus: Annotated[float, Field(ge=0)] = 0.25
    num_gpus: Annotated[float, Field(ge=0)] = 0.0
    memory_bytes: Annotated[int, Field(gt=0)] | None = None
    target: TargetConfig | None = None
    # Local configs only: name a demo artifact (e.g. "ranker-v41") instead of a target; it is
    # created under ``demo_artifacts_dir`` when missing and served as ``demo_revision``.
    demo_artifact: str | None = None
    demo_revision: Annotated[int, Field(ge=1)] = 1
    max_ongoing_requests: Annotated[int, Field(ge=1)] = 256
    # Loads can take 90 s; health checks do not run while reconfigure runs (RAY_FACTS.md),
    # but the startup load happens in reconfigure too, so these only need to cover faults.
    health_check_period_s: Annotated[float, Field(gt=0)] = 10.0
    health_check_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    graceful_shutdown_wait_loop_s: Annotated[float, Field(gt=0)] = 2.0
    graceful_shutdown_timeout_s: Annotated[float, Field(gt=0)] = 20.0
    # Tests only: honoured only where the replicas' environment has
    # ROLLOUT_FAULT_INJECTION=allow (see app.replica.FaultInjection).
    faults: FaultInjection | None = None


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stable: CohortArgs = CohortArgs()
    canary: CohortArgs = CohortArgs(num_replicas=1)
    router: RouterConfig = RouterConfig()
    router_replicas: Annotated[int, Field(ge=1)] = 1
    router_num_cpus: Annotated[float, Field(ge=0)] = 0.25
    router_max_ongoing_requests: Annotated[int, Field(ge=1)] = 1024
    # Shared replica settings.
    cache_dir: str = "var/cache"
    cache_byte_budget: Annotated[int, Field(gt=0)] | None = None
    batching: BatchingConfig = BatchingConfig()
    memory: MemoryConfig = MemoryConfig()
    loading: LoadingConfig = LoadingConfig()
    retry: RetryConfig = RetryConfig()
    trust_key: str | None = None
    controller: ControllerRef | None = None
    report_interval_s: Annotated[float, Field(gt=0)] = 10.0
    demo_artifacts_dir: str | None = None  # local only; see CohortArgs.demo_artifact
    # "router": the full graph. "ranker_only": one stable ranker deployment serving HTTP
    # itself, no router (the benchmark's baseline for the cost of the router hop).
    mode: Literal["router", "ranker_only"] = "router"
    # Serve's per-call access log line costs CPU on every request and every router probe.
    access_log: bool = False


def resolve_target(cohort: CohortArgs, args: AppArgs, field: str) -> TargetConfig | None:
    if cohort.target is not None and cohort.demo_artifact is not None:
        raise ConfigError(f"args.{field}: give target or demo_artifact, not both")
    if cohort.demo_artifact is None:
        return cohort.target
    if args.demo_artifacts_dir is None:
        raise ConfigError(f"args.{field}.demo_artifact needs args.demo_artifacts_dir")
    from app.demo_artifacts import make_demo_artifacts  # local configs only (packs torch)

    packed = {p.artifact_id: p for p in make_demo_artifacts(project_path(args.demo_artifacts_dir))}
    found = packed.get(cohort.demo_artifact)
    if found is None:
        raise ConfigError(
            f"args.{field}.demo_artifact: {cohort.demo_artifact!r} is not a demo artifact "
            f"(known: {sorted(packed)})"
        )
    return TargetConfig(
        revision=cohort.demo_revision,
        artifact_id=found.artifact_id,
        manifest_uri=found.manifest_uri,
        manifest_sha256=found.manifest_sha256,
    )


def replica_config(
    args: AppArgs,
    cohort: str,
    target: TargetConfig | None,
    faults: FaultInjection | None = None,
) -> ReplicaConfig:
    return ReplicaConfig(
        cohort=cohort,  # type: ignore[arg-type]
        target=target,
        batching=args.batching,
        memory=args.memory,
        loading=args.loading,
        retry=args.retry,
        trust_key=str(project_path(args.trust_key)) if args.trust_key else None,
        controller=args.controller,
        cache_dir=str(project_path(args.cache_dir)),
        cache_byte_budget=args.cache_byte_budget,
        report_interval_s=args.report_interval_s,
        faults=faults,
    )


def _ranker_options(
    name: str, cohort: CohortArgs, config: ReplicaConfig, access_log: bool
) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": cohort.num_cpus}
    if cohort.num_gpus:
        actor["num_gpus"] = cohort.num_gpus
    if cohort.memory_bytes:
        actor["memory"] = cohort.memory_bytes
    return {
        "name": name,
        "num_replicas": cohort.num_replicas,
        "ray_actor_options": actor,
        "max_ongoing_requests": cohort.max_ongoing_requests,
        "health_check_period_s": cohort.health_check_period_s,
        "health_check_timeout_s": cohort.health_check_timeout_s,
        "graceful_shutdown_wait_loop_s": cohort.graceful_shutdown_wait_loop_s,
        "graceful_shutdown_timeout_s": cohort.graceful_shutdown_timeout_s,
        "user_config": config.model_dump(mode="json"),
        "logging_config": {"enable_access_log": access_log},
    }


def build_app(args: AppArgs) -> Application:
    if isinstance(args, dict):  # called directly with a plain dict
        args = AppArgs.model_validate(args)
    # Imported here so that importing app.main (e.g. for AppArgs) does not pull the shells.
    from deployments.ranker import Ranker
    from deployments.router import Router

    stable_cfg = replica_config(
        args, "stable", resolve_target(args.stable, args, "stable"), args.stable.faults
    )
    if args.mode == "ranker_only":
        return Ranker.options(
            **_ranker_options("stable", args.stable, stable_cfg, args.access_log)
        ).bind()
    canary_cfg = replica_config(
        args, "canary", resolve_target(args.canary, args, "canary"), args.canary.faults
    )
    stable = Ranker.options(
        **_ranker_options("stable", args.stable, stable_cfg, args.access_log)
    ).bind()
    canary = Ranker.options(
        **_ranker_options("canary", args.canary, canary_cfg, args.access_log)
    ).bind()
    return Router.options(
        name="router",
        num_replicas=args.router_replicas,
        ray_actor_options={"num_cpus": args.router_num_cpus},
        max_ongoing_requests=args.router_max_ongoing_requests,
        user_config=args.router.model_dump(mode="json"),
        logging_config={"enable_access_log": args.access_log},
    ).bind(stable, canary)
