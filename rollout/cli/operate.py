"""The ``rollout`` commands that operate the running cluster's rollouts: ``controller``
(``start``, ``keep``, ``status``, ``stop``), ``start``, ``status``, the operator commands
(``pause``, ``resume``, ``promote``, ``abort``), ``rollback``, ``standby``, and ``history``
(which reads the registry, not the cluster).

Only ``rollout controller start`` and ``rollout start`` create the controller; every other
command that talks to the cluster needs one running (exit 5) and gives up after ``--timeout``
seconds (exit 7). Ray is imported by the commands that attach to the cluster: the CLI starts
without it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import click

from app.contracts import (
    CommandAccepted,
    ControllerPing,
    ControllerSettings,
    ControllerStatus,
    OperatorCommandName,
    PublishedTarget,
    RolloutSummary,
    StandbyView,
)
from app.errors import ConfigError, NotFound
from app.safe_text import redact_uri, terminal_safe
from rollout.cli.exit_codes import (
    EXIT_ROLLOUT_ABORTED,
    EXIT_ROLLOUT_FAILED,
    EXIT_ROLLOUT_ROLLED_BACK,
    exit_code_for_phase,
)
from rollout.cli.options import LIST_LIMIT, Seconds, actor_option, reason_option
from rollout.cli.render import emit
from rollout.cluster import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S

# How soon `controller keep` looks again after it found the controller dying.
DEAD_ACTOR_RECHECK_S: Final = 0.5


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
        click.option(
            "--timeout",
            "timeout_s",
            type=Seconds(min=0.1, max=MAX_TIMEOUT_S),
            default=DEFAULT_TIMEOUT_S,
            show_default=True,
            help="Seconds to wait for the cluster and for each answer of the controller "
            "(exit 7 past it).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _running_controller(address: str | None, timeout_s: float) -> Any:
    """The cluster's controller, which must already run: never created here (exit 5)."""
    from rollout.cluster import connect, running_controller

    connect(address, timeout_s)
    return running_controller(timeout_s=timeout_s)


def _controller(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float
) -> Any:
    """Attach to the cluster and return its controller, creating it if absent (only
    `rollout controller start` and `rollout start` do)."""
    from app.registry import default_registry_url
    from rollout.actor import absolute_registry_url, ensure_controller
    from rollout.cluster import connect, find_controller

    cluster_dashboard = connect(address, timeout_s)
    existing = find_controller(timeout_s=timeout_s)
    if existing is not None:
        return existing
    dashboard = dashboard or cluster_dashboard
    if not dashboard:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    settings = ControllerSettings(
        registry_url=absolute_registry_url(db_url or default_registry_url()),
        dashboard_url=dashboard,
    )
    return ensure_controller(settings, timeout_s=timeout_s)


def _call(handle_method: Any, *args: Any, timeout_s: float) -> Any:
    from rollout.cluster import call

    return call(handle_method, *args, timeout_s=timeout_s)


def _show(payload: dict[str, Any], as_json: bool, view: type[RolloutSummary]) -> None:
    """A controller's answer: as it came (``--json``), or rendered from its ``view`` model."""
    if as_json:
        emit(payload)
    else:
        from rollout.cli.render import render_status

        click.echo(render_status(view.model_validate(payload)))


@click.group()
def controller() -> None:
    """The detached rollout controller actor of the running cluster."""


def _show_ping(answer: dict[str, Any]) -> None:
    """The controller's settings, with the credentials of its URLs masked."""
    ping = ControllerPing.model_validate(answer)
    shown = dict(answer)
    shown["registry_url"] = redact_uri(ping.registry_url)
    shown["dashboard_url"] = redact_uri(ping.dashboard_url)
    if ping.prometheus_url:
        shown["prometheus_url"] = redact_uri(ping.prometheus_url)
    emit(shown)


@controller.command("start")
@_cluster_options
def controller_start(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Create the controller if absent (it resumes any active rollout and repairs drift)."""
    handle = _controller(address, db_url, dashboard, timeout_s)
    _show_ping(_call(handle.ping, timeout_s=timeout_s))


@controller.command("keep")
@click.option(
    "--every",
    "every_s",
    type=Seconds(min=1, max=3600),
    default=15.0,
    show_default=True,
    help="Seconds between checks that the controller runs.",
)
@_cluster_options
def controller_keep(
    every_s: float, address: str | None, db_url: str | None, dashboard: str | None,
    timeout_s: float, as_json: bool,
) -> None:  # fmt: skip
    """Keep a controller running: create it whenever it is absent, checking every --every
    seconds, until stopped (SIGTERM or SIGINT: exit 0). A line whenever the controller it finds
    is not the one it saw last. For a process beside the head (the RayService's
    rollout-controller container): a new head without GCS fault tolerance starts with no
    controller, and one created here resumes the active rollout from the registry. Losing the
    cluster ends it with that error (its supervisor starts it again)."""
    import signal
    import threading

    import ray

    from app.registry import default_registry_url
    from rollout.actor import absolute_registry_url, ensure_controller
    from rollout.cluster import connect, find_controller

    stop = threading.Event()

    def stopping(_signum: int, _frame: Any) -> None:
        stop.set()

    cluster_dashboard = connect(address, timeout_s)
    # After attaching: Ray's driver puts in handlers of its own that exit with the signal.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping)
    dashboard = dashboard or cluster_dashboard
    if not dashboard:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    settings = ControllerSettings(
        registry_url=absolute_registry_url(db_url or default_registry_url()),
        dashboard_url=dashboard,
    )
    seen: int | None = None
    while not stop.is_set():
        handle = find_controller(timeout_s=timeout_s)
        created = handle is None
        if handle is None:
            handle = ensure_controller(settings, timeout_s=timeout_s)
        try:
            answer = _call(handle.ping, timeout_s=timeout_s)
        except ray.exceptions.ActorDiedError:
            # `ray.kill` returns before the name is released: a lookup in between finds the
            # dying actor. It is gone, so look again soon rather than end the keeper.
            stop.wait(min(every_s, DEAD_ACTOR_RECHECK_S))
            continue
        ping = ControllerPing.model_validate(answer)
        if created or ping.pid != seen:
            emit(
                {
                    "controller": "created" if created else "found",
                    "pid": ping.pid,
                    "node_id": ping.node_id,
                    "ticks": ping.ticks,
                }
            )
            seen = ping.pid
        stop.wait(every_s)


@controller.command("status")
@_cluster_options
def controller_status(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Is the controller running, and with which settings (exit 5 if not running)."""
    _show_ping(_call(_running_controller(address, timeout_s).ping, timeout_s=timeout_s))


@controller.command("stop")
@_cluster_options
def controller_stop(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Stop the controller; an active rollout holds where it is until one starts again."""
    import ray

    ray.kill(_running_controller(address, timeout_s), no_restart=True)
    emit({"stopped": True})


@click.command("start")
@click.argument("model")
@click.argument("artifact_id")
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Rollout plan YAML (default: configs/rollout.yaml's defaults).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Start even where the estimate says a step does not fit its progress deadline at "
    "the traffic measured now (exit 6 without it).",
)
@actor_option
@_cluster_options
def start_command(
    model: str,
    artifact_id: str,
    plan_file: Path | None,
    force: bool,
    actor: str,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Roll ARTIFACT_ID of MODEL out: canary, weighted steps, analysis, promotion (creates the
    controller if the cluster has none). Prints what each step will take at the traffic of
    the last minutes; refuses (exit 6) a plan whose step does not fit its deadline."""
    from rollout.plan import RolloutPlan, load_plan

    plan = load_plan(plan_file) if plan_file else RolloutPlan()
    handle = _controller(address, db_url, dashboard, timeout_s)
    settings = ControllerPing.model_validate(_call(handle.ping, timeout_s=timeout_s))
    if settings.model != model:
        raise ConfigError(f"MODEL: this cluster's controller manages {settings.model!r}")
    summary = _call(
        handle.start_rollout, artifact_id, plan.model_dump(mode="json"), actor, force,
        timeout_s=timeout_s,
    )  # fmt: skip
    _show(summary, as_json, RolloutSummary)


@click.command("status")
@click.option(
    "--watch",
    is_flag=True,
    help="Refresh until the rollout finishes (Ctrl-C stops); exits "
    f"{EXIT_ROLLOUT_FAILED} failed, {EXIT_ROLLOUT_ROLLED_BACK} rolled back, "
    f"{EXIT_ROLLOUT_ABORTED} aborted.",
)
@click.option(
    "--interval",
    type=Seconds(min=0.2, max=3600),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes of --watch.",
)
@_cluster_options
def status_command(
    watch: bool,
    interval: float,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Phase, step, weights, per-cohort traffic, verdicts, replicas, events."""
    from rollout.cli.render import render_status

    handle = _running_controller(address, timeout_s)
    # Clearing the screen is for a person at a terminal; a log or a pipe gets each view in
    # turn, separated by a blank line.
    on_terminal = click.get_text_stream("stdout").isatty()
    first = True
    while True:
        answer = _call(handle.status, timeout_s=timeout_s)
        view = ControllerStatus.model_validate(answer)
        if as_json:
            emit(answer)
        else:
            if watch and on_terminal:
                click.echo("\x1b[2J\x1b[H", nl=False)
            elif watch and not first:
                click.echo("")
            click.echo(render_status(view, now=time.time()))
        first = False
        if not watch or not view.rollout or view.finished:
            break
        time.sleep(interval)
    if watch:
        # CI gates on the outcome of the rollout it watched.
        raise click.exceptions.Exit(exit_code_for_phase(view.phase))


def _operator_command(name: OperatorCommandName, doc: str) -> click.Command:
    """``rollout <name>``: one of the controller's operator commands, on the active rollout."""

    @click.command(name, help=doc)
    @reason_option(help_text="Why (recorded in the rollout's events).")
    @actor_option
    @_cluster_options
    def command(
        reason: str | None,
        actor: str,
        address: str | None,
        db_url: str | None,
        dashboard: str | None,
        timeout_s: float,
        as_json: bool,
    ) -> None:
        handle = _running_controller(address, timeout_s)
        answer = _call(handle.command, name, reason or "", actor, timeout_s=timeout_s)
        _show(answer, as_json, CommandAccepted)

    return command


OPERATOR_COMMANDS: Final = (
    _operator_command("pause", "Hold the rollout at its current weights."),
    _operator_command("resume", "Go on from a gate or a pause."),
    _operator_command("promote", "Skip the remaining steps (and gates) and promote now."),
    _operator_command("abort", "Stop the rollout: stable 100% first, then clean up."),
)


@click.command("rollback")
@click.option(
    "--to",
    "to_artifact",
    default=None,
    help="With no rollout in progress: the artifact stable goes back to "
    "(default: the one before the current).",
)
@reason_option()
@actor_option
@_cluster_options
def rollback_command(
    to_artifact: str | None,
    reason: str | None,
    actor: str,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Fast path: weights to stable first, no analysis. With no rollout in progress, point
    stable back at an earlier artifact at a higher revision."""
    handle = _running_controller(address, timeout_s)
    view = ControllerStatus.model_validate(_call(handle.status, timeout_s=timeout_s))
    if view.rollout and not view.finished:
        if to_artifact is not None and to_artifact != view.baseline:
            raise ConfigError(
                f"--to: a rollout is in progress; its rollback returns to {view.baseline}"
            )
        answer = _call(handle.command, "rollback", reason or "", actor, timeout_s=timeout_s)
        _show(answer, as_json, CommandAccepted)
        return
    answer = _call(
        handle.rollback_stable, to_artifact, actor, reason or "rollback", timeout_s=timeout_s
    )
    target = PublishedTarget.model_validate(answer)
    emit({"stable": target.artifact_id, "revision": target.revision})


def _status_url(details: dict[str, Any], app_name: str, dashboard: str) -> str:
    """The app's ``/v1/status`` on Serve's HTTP ingress, from Serve's own details: the proxy's
    host (the dashboard's host when it listens on every address) and port, the app's route
    prefix."""
    from urllib.parse import urlsplit

    http = details.get("http_options") or {}
    host = str(http.get("host") or "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = urlsplit(dashboard).hostname or "127.0.0.1"
    port = int(http.get("port") or 8000)
    app = (details.get("applications") or {}).get(app_name) or {}
    prefix = str(app.get("route_prefix") or "/").rstrip("/")
    return f"http://{host}:{port}{prefix}/v1/status"


def _standby_view(url: str, app_name: str, timeout_s: float) -> StandbyView:
    """The router's standby view, asked as a client asks it: over Serve's HTTP ingress (no
    Serve handle in this short-lived process: its background polling outlives the command)."""
    import httpx

    from app.errors import ClusterUnreachable

    try:
        answer = httpx.get(url, timeout=max(0.1, timeout_s))
        answer.raise_for_status()
        standby = answer.json().get("standby")
    except (httpx.HTTPError, ValueError) as exc:
        raise ClusterUnreachable(
            f"the router of application {app_name!r} did not answer at {url}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if standby is None:
        raise NotFound(f"--app {app_name}: the application has no fallback deployment")
    return StandbyView.model_validate(standby)


def _set_standby_policy(
    dashboard: str, app_name: str, router: str, policy: str, timeout_s: float
) -> None:
    """Through the app's controller when one runs (its write goes between the engine's, so
    it cannot undo a weight the engine just set); else straight to Serve's config."""
    from rollout.actor import with_standby_policy
    from rollout.cluster import find_controller
    from rollout.serve_control import ServeControl

    controller = find_controller(timeout_s=timeout_s)
    if controller is not None:
        settings = ControllerPing.model_validate(_call(controller.ping, timeout_s=timeout_s))
        if settings.app_name == app_name:
            _call(controller.set_standby_policy, policy, router, timeout_s=timeout_s)
            return
    control = ServeControl(dashboard)
    try:
        control.update_user_configs(
            app_name, {router: lambda cfg: with_standby_policy(cfg, policy)}
        )
    finally:
        control.close()


@click.command("standby")
@click.option("--app", "app_name", default="ranker", show_default=True,
              help="The Serve application.")  # fmt: skip
@click.option("--router", default="router", show_default=True,
              help="The application's router deployment.")  # fmt: skip
@click.option(
    "--policy",
    type=click.Choice(["auto", "always", "never"]),
    default=None,
    help="Set the router's standby policy: auto (the accuracy guard decides), always or never "
    "(the operator overrides it). A live change of the router's user_config.",
)
@_cluster_options
def standby_command(
    app_name: str,
    router: str,
    policy: str | None,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """The router's hot standby: where traffic goes, each breaker, the accuracy guard."""
    from app.errors import ClusterUnreachable
    from rollout.cluster import connect
    from rollout.serve_control import ServeControl

    deadline = time.monotonic() + timeout_s
    # Attached for the dashboard URL and the controller; the router is asked over HTTP.
    cluster_dashboard = connect(address, timeout_s)
    url = dashboard or cluster_dashboard
    if not url:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    control = ServeControl(url)
    try:
        details = control.details()
    finally:
        control.close()
    if app_name not in (details.get("applications") or {}):
        raise NotFound(f"--app {app_name}: no such Serve application")
    status_url = _status_url(details, app_name, url)
    # Before any write: an app without a fallback is refused, its config left alone.
    view = _standby_view(status_url, app_name, deadline - time.monotonic())
    if policy is not None and view.policy != policy:
        _set_standby_policy(url, app_name, router, policy, timeout_s)
        while (view := _standby_view(status_url, app_name, deadline - time.monotonic())).policy != (
            policy
        ):
            if time.monotonic() > deadline:
                raise ClusterUnreachable(
                    f"the router still has policy {view.policy!r} after {timeout_s:g} s (its "
                    "config_error in /v1/status says why if it refused the change)"
                )
            time.sleep(0.2)
    if as_json:
        emit(view.model_dump(mode="json"))
    else:
        from rollout.cli.render import standby_lines

        click.echo("\n".join(terminal_safe(line) for line in standby_lines(view)))


@click.command("history")
@click.option("--db", "db_url", envvar="ROLLOUT_DB", default=None)
@click.option("--model", default="ranker", show_default=True)
@click.option("--env", "env", default="default", show_default=True)
@click.option("--limit", type=LIST_LIMIT, default=20, show_default=True)
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
            terminal_safe(
                f"{r.created_at:%Y-%m-%d %H:%M:%S} {r.id}: {r.candidate_artifact_id} over "
                f"{r.baseline_artifact_id}: {r.phase}" + (f" ({r.reason})" if r.reason else "")
            )
        )
        for event in events[-3:]:
            at = datetime.fromtimestamp(float(event.get("at") or 0), UTC)
            click.echo(terminal_safe(f"    {at:%H:%M:%S} {event['event']}: {event['message']}"))


# What main.py adds to the ``rollout`` group.
COMMANDS: Final[tuple[click.Command, ...]] = (
    controller,
    start_command,
    status_command,
    *OPERATOR_COMMANDS,
    rollback_command,
    standby_command,
    history_command,
)
