"""The application builder: the only place the deployment graph is bound.

``build_app(args)`` takes validated ``AppArgs`` (``app.contracts``) and returns the Serve
``Application``::

    router (ingress) --> stable    (Ranker, cohort "stable")
                     \\-> canary    (Ranker, cohort "canary")
                     \\-> fallback  (Ranker, cohort "fallback"; only with ``args.fallback``)

Stable, canary and the fallback are ``.options(name=...)`` copies of ONE replica class that
differ only in their ``user_config``. Configs point Serve here with
``import_path: deployments.app:build_app`` and pass ``args``; Serve validates them into
``AppArgs`` (typed builder).

Relative paths (cache, trust key, demo artifacts) are resolved against the project root, not
the process's working directory: the builder and the replicas run in Ray worker processes whose
working directory is not the one ``serve run`` was started from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from ray.serve import Application

from app.contracts import (
    FALLBACK,
    AppArgs,
    CohortArgs,
    FaultInjection,
    ReplicaConfig,
    Role,
    SignatureTrust,
    Target,
)
from app.errors import ConfigError
from app.model_family import Families
from deployments.ranker import Ranker
from deployments.router import Router

PROJECT_ROOT: Final = Path(__file__).resolve().parents[1]


def project_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else PROJECT_ROOT / p


def resolve_target(cohort: CohortArgs, args: AppArgs, field: str) -> Target | None:
    if cohort.target is not None and cohort.demo_artifact is not None:
        raise ConfigError(f"args.{field}: give target or demo_artifact, not both")
    if cohort.demo_artifact is None:
        return cohort.target
    if args.demo_artifacts_dir is None:
        raise ConfigError(f"args.{field}.demo_artifact needs args.demo_artifacts_dir")
    # Local configs only (packs with torch).
    from app.demo_artifacts import DEMO_ARTIFACT_IDS, pack_demo_artifact

    found = pack_demo_artifact(project_path(args.demo_artifacts_dir), cohort.demo_artifact)
    if found is None:
        raise ConfigError(
            f"args.{field}.demo_artifact: {cohort.demo_artifact!r} is not a demo artifact "
            f"(known: {sorted(DEMO_ARTIFACT_IDS)})"
        )
    return found.target(cohort.demo_revision)


def _resolved_trust(trust: SignatureTrust) -> SignatureTrust:
    """``trust`` with its files' relative paths resolved against the project root."""

    def resolved(paths: list[str]) -> list[str]:
        return [str(project_path(p)) for p in paths]

    config = trust.sigstore_trust_config
    return trust.model_copy(
        update={
            "keys": resolved(trust.keys),
            "certificate_chains": resolved(trust.certificate_chains),
            "sigstore_trust_config": str(project_path(config)) if config else None,
        }
    )


def replica_config(
    args: AppArgs,
    cohort: Role,
    target: Target | None,
    faults: FaultInjection | None = None,
) -> ReplicaConfig:
    return ReplicaConfig(
        cohort=cohort,
        target=target,
        batching=args.batching,
        memory=args.memory,
        loading=args.loading,
        retry=args.retry,
        trust_key=str(project_path(args.trust_key)) if args.trust_key else None,
        trust=_resolved_trust(args.trust),
        controller=args.controller,
        cache_dir=str(project_path(args.cache_dir)),
        cache_byte_budget=args.cache_byte_budget,
        report_interval_s=args.report_interval_s,
        faults=faults,
        models=args.models,
        feature_schema=served_schema(args),
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


def _ranker(args: AppArgs, cohort: Role) -> Application:
    specs = {"stable": args.stable, "canary": args.canary, FALLBACK: args.fallback}
    spec = specs[cohort]
    assert spec is not None
    target = resolve_target(spec, args, cohort)
    schema = served_schema(args)
    if target is not None and target.feature_schema != schema:
        # Refused here, naming the field, rather than by the replica's first load.
        raise ConfigError(
            f"args.{cohort}.target.feature_schema: {target.feature_schema!r}; the app serves "
            f"{schema!r} (args.feature_schema)",
            field=f"args.{cohort}.target.feature_schema",
        )
    config = replica_config(args, cohort, target, spec.faults)
    return Ranker.options(**_ranker_options(cohort, spec, config, args.access_log)).bind()


def served_schema(args: AppArgs) -> str:
    """The request schema the app serves: ``args.feature_schema``, or the first family's.
    ConfigError naming ``args.models[i]`` (a module that is no family) or
    ``args.feature_schema`` (no family registered has it)."""
    families = Families.from_paths(args.models, where="args.models")
    try:
        return families.schema(args.feature_schema).name
    except ConfigError as exc:
        raise ConfigError(f"args.{exc}", field="args.feature_schema") from None


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    if not isinstance(args, AppArgs):  # called directly with a plain dict
        args = AppArgs.parse(args, where="args")
    schema = served_schema(args)  # before anything is bound: a bad family fails the deploy
    stable = _ranker(args, "stable")
    if args.mode == "ranker_only":
        return stable
    return Router.options(
        name="router",
        num_replicas=args.router_replicas,
        ray_actor_options={"num_cpus": args.router_num_cpus},
        max_ongoing_requests=args.router_max_ongoing_requests,
        user_config=args.router.model_dump(mode="json"),
        logging_config={"enable_access_log": args.access_log},
    ).bind(
        stable,
        _ranker(args, "canary"),
        _ranker(args, FALLBACK) if args.fallback is not None else None,
        models=list(args.models),
        feature_schema=schema,
    )
