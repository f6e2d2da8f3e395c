"""The controller actor: one detached, named Ray actor per cluster around a ``RolloutEngine``.

It ticks the engine on a background thread, answers the CLI, the demo and tests (every answer
a ``wire`` dump of an ``app.contracts`` view, so the callers need not import the engine), and
takes the replicas' reports (``report_instance``, fire and forget). Ray restarts it if its
process dies; a new one resumes the active rollout from the registry.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from app.contracts import (
    ControllerPing,
    ControllerSettings,
    ControllerStatus,
    OperatorCommandName,
    StandbyView,
)
from app.safe_text import redact_uri
from rollout.cluster import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    DEFAULT_TIMEOUT_S,
    HEAD_NODE_RESOURCE,
    call,
    find_controller,
)
from rollout.controller_metrics import ControllerMetrics
from rollout.engine import RolloutEngine
from rollout.machine import Abort, OperatorCommand, Pause, Promote, Resume, Rollback
from rollout.plan import RolloutPlan
from rollout.views import wire

log = logging.getLogger(__name__)

# How often the controller asks the router for its hot standby's state (status shows it), and
# how long it waits for an answer.
STANDBY_POLL_S: Final = 2.0
STANDBY_TIMEOUT_S: Final = 2.0

COMMANDS: Final[dict[OperatorCommandName, Callable[[str], OperatorCommand]]] = {
    "pause": lambda reason: Pause(reason=reason),
    "resume": lambda _reason: Resume(),
    "promote": lambda _reason: Promote(),
    "abort": lambda reason: Abort(reason=reason or "aborted by operator"),
    "rollback": lambda reason: Rollback(reason=reason or "rollback requested by operator"),
}


def absolute_registry_url(url: str) -> str:
    """An SQLite path relative to the caller's directory, made absolute: the actor's worker
    process runs elsewhere."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/"):
        return prefix + os.path.abspath(url[len(prefix) :])
    return url


# ControllerPing's bound on a URI: a masked URL is cut to it (masking lengthens an empty
# query value, "a=" -> "a=***"), so that no URL makes the ping itself invalid.
MAX_SHOWN_URI: Final = 4096


def _shown_uri(uri: str) -> str:
    return redact_uri(uri)[:MAX_SHOWN_URI]


def shown_settings(settings: ControllerSettings) -> dict[str, Any]:
    """The settings as ``ping`` answers them, every URL's credentials masked: any process that
    can reach the cluster can call the named actor, and none of its callers needs them (the
    actor keeps the real ones; a new one gets them from whoever creates it)."""
    shown = settings.model_dump()
    for field in ("registry_url", "dashboard_url", "prometheus_url"):
        if shown[field] is not None:
            shown[field] = _shown_uri(shown[field])
    shown["metrics_endpoints"] = tuple(_shown_uri(uri) for uri in settings.metrics_endpoints)
    return shown


def with_standby_policy(router_config: Mapping[str, Any], policy: str) -> dict[str, Any]:
    """A router ``user_config`` with its standby policy set, everything else as it was."""
    return {
        **router_config,
        "standby": {**(router_config.get("standby") or {}), "policy": policy},
    }


def router_handle(app_name: str, router_deployment: str) -> Any:
    """A Serve handle of the app's router, from a process attached to the cluster. Keep it:
    each new handle sets up its own routing state in Serve."""
    from ray import serve

    return serve.get_deployment_handle(router_deployment, app_name=app_name)


def router_standby(handle: Any, timeout_s: float) -> StandbyView | None:
    """One router replica's hot standby (None: the app has no fallback deployment). Raises if
    the router does not answer within ``timeout_s``."""
    answer = handle.status.remote().result(timeout_s=timeout_s)
    standby = getattr(answer, "standby", None)
    return None if standby is None else StandbyView.model_validate(standby)


def _this_node_id() -> str | None:
    import ray

    # Outside Ray (never the actor itself) the runtime context would start a local cluster.
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def metrics_export_interval_s() -> float | None:
    """Ray's metrics report interval in this process's cluster, in seconds (a worker gets the
    cluster's system config); None where Ray's config cannot be read."""
    try:
        from ray._raylet import Config

        return Config.metrics_report_interval_ms() / 1000.0
    except Exception as exc:  # a private API: a Ray without it leaves the configured delay
        log.warning("Ray's metrics report interval not read: %s", exc)
        return None


class RolloutController:
    """The detached, named controller actor (one per cluster): ticks its engine on a
    background thread and serves the CLI and the replicas' reports."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        logging.basicConfig(level=logging.INFO)
        self.settings = ControllerSettings.model_validate(dict(settings))
        self.engine = RolloutEngine(
            self.settings, metrics_export_interval_s=metrics_export_interval_s()
        )
        if self.engine.window_delay_s > self.settings.metrics_delay_s:
            log.info(
                "windows start %.1fs after a weight change: Ray exports metrics every %.1fs",
                self.engine.window_delay_s,
                self.engine.metrics_export_interval_s,
            )
        self.engine.resume()
        self.repaired: list[str] | None = None
        self.metrics = ControllerMetrics()
        self._stop = threading.Event()
        self._ticks = 0
        self._thread = threading.Thread(target=self._loop, name="rollout-ticks", daemon=True)
        self._thread.start()
        # The router's hot standby, polled on a thread of its own: a router that does not
        # answer must not slow the ticks or the status answers.
        self._standby: StandbyView | None = None
        self._standby_thread = threading.Thread(
            target=self._poll_standby, name="rollout-standby", daemon=True
        )
        self._standby_thread.start()

    def _poll_standby(self) -> None:
        handle = None
        while not self._stop.wait(STANDBY_POLL_S):
            try:
                if handle is None:
                    s = self.settings
                    handle = router_handle(s.app_name, s.router_deployment)
                self._standby = router_standby(handle, STANDBY_TIMEOUT_S)
            except Exception as exc:  # no app yet, a router restarting: shown as unknown
                log.debug("router standby not read: %s", exc)
                self._standby = None

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.tick_interval_s):
            if self.repaired is None:
                # Serve may not be up yet when the controller starts: retry until it is. A
                # repair Serve refuses (a deployed user_config no replica accepts) is retried
                # too, and does not stop the ticks: the rollout still holds or ends by its rules.
                try:
                    self.repaired = self.engine.reconcile_serve()
                except Exception as exc:
                    self.engine.errors.append(f"drift repair: {type(exc).__name__}: {exc}")
                    log.warning("drift repair failed (retried next tick): %s", exc)
            try:
                self.engine.tick()
                self._ticks += 1
                live = self.engine.live
                self.metrics.publish(live.state if live is not None else None)
                self.metrics.publish_drift(self.settings.model, self.engine.drift_repairs)
            except Exception as exc:  # the loop must outlive any one bad tick
                self.engine.errors.append(f"tick: {type(exc).__name__}: {exc}")
                log.exception("controller tick failed")

    # -- called by the CLI, the demo and tests
    def ping(self) -> dict[str, Any]:
        return wire(
            ControllerPing(
                **shown_settings(self.settings),
                pid=os.getpid(),
                node_id=_this_node_id(),
                ticks=self._ticks,
                repaired=None if self.repaired is None else tuple(self.repaired),
                metrics_export_interval_s=self.engine.metrics_export_interval_s,
                window_delay_s=self.engine.window_delay_s,
            )
        )

    def start_rollout(
        self,
        candidate_artifact_id: str,
        plan: Mapping[str, Any],
        actor: str = "operator",
        force: bool = False,
    ) -> dict[str, Any]:
        summary = self.engine.start_rollout(
            candidate_artifact_id,
            RolloutPlan.model_validate(dict(plan)),
            actor=actor,
            force=force,
        )
        return wire(summary)

    def command(
        self, name: OperatorCommandName, reason: str = "", actor: str = "operator"
    ) -> dict[str, Any]:
        return wire(self.engine.command(COMMANDS[name](reason), actor=actor, reason=reason))

    def rollback_stable(
        self, artifact_id: str | None, actor: str = "operator", reason: str = "rollback"
    ) -> dict[str, Any]:
        target = self.engine.rollback_stable(artifact_id, actor=actor, reason=reason)
        return wire(target.published())

    def status(self) -> dict[str, Any]:
        view = self.engine.view()
        if isinstance(view, ControllerStatus) and self._standby is not None:
            view = view.model_copy(update={"standby": self._standby})
        return wire(view)

    def tick(self) -> dict[str, Any] | None:
        summary = self.engine.tick()
        return None if summary is None else wire(summary)

    def set_standby_policy(self, policy: str, router_deployment: str) -> bool:
        """Set the router's standby policy in the Serve config, between two of the engine's
        writes (the read-modify-write must not undo a weight or target it just wrote). True
        when the config changed."""
        from rollout.serve_control import ServeControl

        control = ServeControl(self.settings.dashboard_url)
        try:
            with self.engine.exclusive():
                return control.update_user_configs(
                    self.settings.app_name,
                    {router_deployment: lambda cfg: with_standby_policy(cfg, policy)},
                )
        finally:
            control.close()

    def reconcile(self) -> list[str]:
        self.repaired = self.engine.reconcile_serve()
        return self.repaired

    def stop(self) -> None:
        self._stop.set()

    # -- called by replicas (fire and forget)
    def report_instance(self, report: Mapping[str, Any]) -> None:
        self.engine.report_instance(report)


def get_controller(name: str = CONTROLLER_NAME, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any | None:
    """The cluster's controller handle, or None (never creates one)."""
    return find_controller(name, timeout_s)


def on_the_head_node() -> dict[str, float]:
    """The controller's place: the head node, with the control plane, where losing a worker
    (a GPU node) does not take the controller with it."""
    return {HEAD_NODE_RESOURCE: 0.001}


def ensure_controller(
    settings: ControllerSettings,
    name: str = CONTROLLER_NAME,
    timeout_s: float | None = None,
) -> Any:
    """The named controller, created (detached) if absent. Restarted by Ray if its process
    dies; a new one resumes the active rollout from the registry. ``timeout_s`` bounds the
    wait for the new controller's first answer (None: wait as long as it takes)."""
    import ray

    existing = get_controller(name)
    if existing is not None:
        return existing
    actor_class = ray.remote(RolloutController)
    handle = actor_class.options(
        name=name,
        namespace=CONTROLLER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=16,
        max_restarts=-1,
        resources=on_the_head_node(),
    ).remote(settings.model_dump())
    if timeout_s is None:
        ray.get(handle.ping.remote())
    else:
        call(handle.ping, timeout_s=timeout_s)
    return handle
