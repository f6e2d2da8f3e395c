"""The ``rollout`` command.

Exit codes (scripts key on them):
    0 ok, 2 usage, 3 artifact rejected, 4 conflict (compare-and-set lost),
    5 not found or invalid state, 6 configuration error, 1 anything unexpected.
Errors print one line, ``error[<category>]: <message>`` (``rejected: <category>: <detail>`` for
artifacts), never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import click
from pydantic import ValidationError

from app.contracts import (
    CommandAccepted,
    ControllerPing,
    ControllerSettings,
    ControllerStatus,
    PublishedTarget,
    RolloutSummary,
)
from app.errors import (
    ArtifactRejected,
    ConfigError,
    NotFound,
    RolloutSystemError,
)
from app.manifest import Architecture, is_sha256_hex
from rollout.exit_codes import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    error_line,
    exit_code_for,
)
from rollout.status_view import render_status

DEFAULT_CACHE_DIR: Final = "var/cache"


def emit(payload: dict[str, Any]) -> None:
    click.echo(json.dumps(payload, sort_keys=True))


def _sha256_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not is_sha256_hex(value.lower()):
        raise click.BadParameter("must be 64 hex characters")
    return value.lower()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Zero-downtime model rollouts on Ray Serve."""


@cli.command()
@click.argument("src_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--model", required=True, help="Model name, e.g. ranker.")
@click.option("--artifact-id", required=True, help="Immutable id, e.g. ranker-v42.")
@click.option("--feature-schema", required=True, help="e.g. ranker-features-v3.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path))
@click.option(
    "--runtime", type=click.Choice(["safetensors", "pytorch-state-dict"]), default="safetensors"
)
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32")
@click.option(
    "--architecture",
    "architecture_json",
    help="Architecture as JSON ({name, version, params}); default: SRC_DIR/architecture.json.",
)
@click.option("--sign-key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def pack(
    src_dir: Path,
    model: str,
    artifact_id: str,
    feature_schema: str,
    out_dir: Path,
    runtime: str,
    precision: str,
    architecture_json: str | None,
    sign_key: Path | None,
) -> None:
    """Pack SRC_DIR into an immutable artifact directory with a manifest."""
    from app.packing import pack_artifact

    architecture = None
    if architecture_json is not None:
        try:
            architecture = Architecture.model_validate_json(architecture_json)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--architecture") from exc
    result = pack_artifact(
        src_dir,
        out_dir,
        model=model,
        artifact_id=artifact_id,
        feature_schema=feature_schema,
        runtime=runtime,
        precision=precision,
        architecture=architecture,
        sign_key=sign_key,
    )
    emit(result.as_json())


@cli.command()
@click.argument("manifest_uri")
@click.option("--sha256", "manifest_sha256", required=True, callback=_sha256_option)
@click.option("--cache", "cache_dir", default=DEFAULT_CACHE_DIR, show_default=True)
@click.option("--trust-key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--load", is_flag=True, help="Also build, strictly load and dry-run the model.")
@click.option(
    "--memory-budget",
    type=click.IntRange(min=1),
    default=None,
    help="Device memory capacity in bytes for the budget check (default: ask the device).",
)
def verify(
    manifest_uri: str,
    manifest_sha256: str,
    cache_dir: str,
    trust_key: Path | None,
    load: bool,
    memory_budget: int | None,
) -> None:
    """Fetch MANIFEST_URI into the verified cache and check every file and that this service
    can serve it (runtime, feature schema, precision, architecture); ``--load`` also loads."""
    from app.cache import ArtifactCache
    from app.loader import check_compatibility

    started = time.monotonic()
    cache = ArtifactCache(cache_dir, trust_key=trust_key)
    artifact = cache.fetch_verified(manifest_uri, manifest_sha256, recheck="digests")
    # What the manifest says decides whether the service could ever serve it: no weights
    # need loading to refuse an unknown runtime, schema, precision or architecture.
    check_compatibility(artifact.manifest)
    payload: dict[str, Any] = {
        "artifact_id": artifact.manifest.artifact_id,
        "cache_path": str(artifact.path),
        "bytes": artifact.total_bytes,
        "cached": artifact.cached,
    }
    if load:
        from app.loader import load_verified
        from app.memory import MemoryBudget

        budget = MemoryBudget(capacity_bytes=memory_budget) if memory_budget else None
        with cache.lease(manifest_sha256):
            model = load_verified(artifact, budget=budget)
            payload["loaded"] = {
                "device": str(model.device),
                "runtime_build": model.runtime_build,
                "param_bytes": model.param_bytes,
                **{f"{k}_s": round(v, 4) for k, v in model.timings.items()},
            }
            model.close()
    payload["seconds"] = round(time.monotonic() - started, 4)
    emit(payload)


@cli.command("make-demo-artifacts")
@click.argument("out_dir", type=click.Path(path_type=Path))
def make_demo_artifacts_command(out_dir: Path) -> None:
    """Write the demo artifacts ranker-v41 and ranker-v42 (deterministic) into OUT_DIR."""
    from app.demo_artifacts import make_demo_artifacts

    for result in make_demo_artifacts(out_dir):
        emit(result.as_json())


@cli.command()
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("public_key", type=click.Path(dir_okay=False, path_type=Path))
def keygen(private_key: Path, public_key: Path) -> None:
    """Write an ed25519 key pair for signing manifests (PEM)."""
    from app.signing import generate_keypair

    for path in (private_key, public_key):
        if path.exists():
            raise click.BadParameter(f"{path} exists; refusing to overwrite a key")
    generate_keypair(private_key, public_key)
    emit({"private_key": str(private_key), "public_key": str(public_key)})


# ---------------------------------------------------------------------- rollouts


def _cluster_options(func: Any) -> Any:
    """Options of every command that talks to the running cluster's controller."""
    options = [
        click.option(
            "--address",
            envvar="RAY_ADDRESS",
            default=None,
            help="Ray cluster address (env RAY_ADDRESS; default: the local cluster).",
        ),
        click.option(
            "--db",
            "db_url",
            envvar="ROLLOUT_DB",
            default=None,
            help="Registry URL (env ROLLOUT_DB; default: the embedded SQLite of the demo).",
        ),
        click.option(
            "--dashboard",
            envvar="RAY_DASHBOARD_URL",
            default=None,
            help="Ray dashboard URL (default: the connected cluster's).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _attach(address: str | None) -> str | None:
    """Attach to the running cluster; its dashboard URL when Ray tells it."""
    from rollout.actor import connect

    try:
        return connect(address)
    except ConnectionError as exc:
        raise ConfigError(
            f"no Ray cluster to attach to ({exc}); start one or set --address"
        ) from exc


def _running_controller(address: str | None) -> Any:
    """The cluster's controller, which must already run (never created here)."""
    from rollout.actor import get_controller

    _attach(address)
    handle = get_controller()
    if handle is None:
        raise NotFound("no rollout controller is running in this cluster")
    return handle


def _controller(address: str | None, db_url: str | None, dashboard: str | None) -> Any:
    """Attach to the cluster and return its controller, creating it if absent."""
    from app.registry import default_registry_url
    from rollout.actor import absolute_registry_url, ensure_controller, get_controller

    cluster_dashboard = _attach(address)
    existing = get_controller()
    if existing is not None:
        return existing
    dashboard = dashboard or cluster_dashboard
    if not dashboard:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    settings = ControllerSettings(
        registry_url=absolute_registry_url(db_url or default_registry_url()),
        dashboard_url=dashboard,
    )
    return ensure_controller(settings)


def _call(handle_method: Any, *args: Any) -> Any:
    import ray

    return ray.get(handle_method.remote(*args), timeout=120)


def _show(payload: dict[str, Any], as_json: bool, view: type[RolloutSummary]) -> None:
    """A controller's answer: as it came (``--json``), or rendered from its ``view`` model."""
    if as_json:
        emit(payload)
    else:
        click.echo(render_status(view.model_validate(payload)))


@cli.group()
def controller() -> None:
    """The detached rollout controller actor of the running cluster."""


@controller.command("start")
@_cluster_options
def controller_start(
    address: str | None, db_url: str | None, dashboard: str | None, as_json: bool
) -> None:
    """Create the controller if absent (it resumes any active rollout and repairs drift)."""
    handle = _controller(address, db_url, dashboard)
    emit(_call(handle.ping))


@controller.command("status")
@_cluster_options
def controller_status(
    address: str | None, db_url: str | None, dashboard: str | None, as_json: bool
) -> None:
    """Is the controller running, and with which settings."""
    emit(_call(_running_controller(address).ping))


@controller.command("stop")
@_cluster_options
def controller_stop(
    address: str | None, db_url: str | None, dashboard: str | None, as_json: bool
) -> None:
    """Stop the controller; an active rollout holds where it is until one starts again."""
    import ray

    ray.kill(_running_controller(address), no_restart=True)
    emit({"stopped": True})


@cli.command("start")
@click.argument("model")
@click.argument("artifact_id")
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Rollout plan YAML (default: configs/rollout.yaml's defaults).",
)
@click.option("--actor", default=lambda: os.environ.get("ROLLOUT_ACTOR") or "operator")
@_cluster_options
def start_command(
    model: str,
    artifact_id: str,
    plan_file: Path | None,
    actor: str,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    as_json: bool,
) -> None:
    """Roll ARTIFACT_ID of MODEL out: canary, weighted steps, analysis, promotion."""
    from rollout.plan import RolloutPlan, load_plan

    plan = load_plan(plan_file) if plan_file else RolloutPlan()
    handle = _controller(address, db_url, dashboard)
    settings = ControllerPing.model_validate(_call(handle.ping))
    if settings.model != model:
        raise ConfigError(f"MODEL: this cluster's controller manages {settings.model!r}")
    summary = _call(handle.start_rollout, artifact_id, plan.model_dump(mode="json"), actor)
    _show(summary, as_json, RolloutSummary)


@cli.command("status")
@click.option("--watch", is_flag=True, help="Refresh until the rollout finishes (Ctrl-C stops).")
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True)
@_cluster_options
def status_command(
    watch: bool,
    interval: float,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    as_json: bool,
) -> None:
    """Phase, step, weights, per-cohort traffic, verdicts, replicas."""
    handle = _controller(address, db_url, dashboard)
    while True:
        answer = _call(handle.status)
        view = ControllerStatus.model_validate(answer)
        if watch and not as_json:
            click.echo("\x1b[2J\x1b[H", nl=False)
        if as_json:
            emit(answer)
        else:
            click.echo(render_status(view))
        if not watch or not view.rollout or view.finished:
            return
        time.sleep(interval)


def _operator_command(name: str, doc: str) -> None:
    @cli.command(name, help=doc)
    @click.option("--reason", default="", help="Why (recorded in the rollout's events).")
    @_cluster_options
    def command(
        reason: str, address: str | None, db_url: str | None, dashboard: str | None, as_json: bool
    ) -> None:
        handle = _controller(address, db_url, dashboard)
        _show(_call(handle.command, name, reason), as_json, CommandAccepted)


_operator_command("pause", "Hold the rollout at its current weights.")
_operator_command("resume", "Go on from a gate or a pause.")
_operator_command("promote", "Skip the remaining steps (and gates) and promote now.")
_operator_command("abort", "Stop the rollout: stable 100% first, then clean up.")


@cli.command("rollback")
@click.option(
    "--to",
    "to_artifact",
    default=None,
    help="With no rollout in progress: the artifact stable goes back to "
    "(default: the one before the current).",
)
@click.option("--reason", default="", help="Why (recorded).")
@click.option("--actor", default=lambda: os.environ.get("ROLLOUT_ACTOR") or "operator")
@_cluster_options
def rollback_command(
    to_artifact: str | None,
    reason: str,
    actor: str,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    as_json: bool,
) -> None:
    """Fast path: weights to stable first, no analysis. With no rollout in progress, point
    stable back at an earlier artifact at a higher revision."""
    handle = _controller(address, db_url, dashboard)
    view = ControllerStatus.model_validate(_call(handle.status))
    if view.rollout and not view.finished:
        if to_artifact is not None and to_artifact != view.baseline:
            raise ConfigError(
                f"--to: a rollout is in progress; its rollback returns to {view.baseline}"
            )
        _show(_call(handle.command, "rollback", reason), as_json, CommandAccepted)
        return
    answer = _call(handle.rollback_stable, to_artifact, actor, reason or "rollback")
    target = PublishedTarget.model_validate(answer)
    emit({"stable": target.artifact_id, "revision": target.revision})


@cli.command("history")
@click.option("--db", "db_url", envvar="ROLLOUT_DB", default=None)
@click.option("--model", default="ranker", show_default=True)
@click.option("--env", "env", default="default", show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def history_command(db_url: str | None, model: str, env: str, limit: int, as_json: bool) -> None:
    """Past and current rollouts, newest first, from the registry."""
    from app.registry import default_registry_url, open_registry

    with open_registry(db_url or default_registry_url(), access="read") as registry:
        records = registry.list_rollouts(model, env, limit=limit)
    if as_json:
        for record in records:
            emit(record.to_dict())
        return
    if not records:
        click.echo("no rollouts")
    for r in records:
        events = (r.state or {}).get("events") or []
        click.echo(
            f"{r.created_at:%Y-%m-%d %H:%M:%S} {r.id}: {r.candidate_artifact_id} over "
            f"{r.baseline_artifact_id}: {r.phase}" + (f" ({r.reason})" if r.reason else "")
        )
        for event in events[-3:]:
            click.echo(f"    {event['event']}: {event['message']}")


def _register_subcommands() -> None:
    """Command groups that live in their own modules."""
    try:
        from rollout.registry_cli import registry_group
    except ImportError:  # pragma: no cover - during bootstrap only
        return
    cli.add_command(registry_group, "registry")
    from rollout.demo import demo_command

    cli.add_command(demo_command, "demo")


_register_subcommands()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        # Without standalone mode click returns what a command passed to ``ctx.exit`` (the
        # registry commands and the demo end that way) instead of exiting: it is the code.
        code = cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_USAGE
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE
    except ArtifactRejected as exc:
        click.echo(f"rejected: {exc.category}: {exc.detail}", err=True)
        return EXIT_REJECTED
    except RolloutSystemError as exc:
        # Raised inside the controller actor, it arrives as Ray's RayTaskError subclass of
        # the same type, whose str() carries the remote traceback: show the cause's message.
        cause = getattr(exc, "cause", None)
        message = str(cause) if isinstance(cause, RolloutSystemError) else str(exc)
        click.echo(error_line(exc.category, message), err=True)
        return exit_code_for(exc)
    except OSError as exc:
        click.echo(f"error[io]: {exc}", err=True)
        return EXIT_UNEXPECTED
    except ValidationError as exc:
        # An answer of the controller that this CLI's contracts do not read (another version).
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        click.echo(f"error[contract]: {exc.title}.{where}: {first.get('msg')}", err=True)
        return EXIT_UNEXPECTED
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
