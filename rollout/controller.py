"""The rollout controller: carries out the state machine against the registry and Ray Serve.

``RolloutEngine`` holds the logic and does the I/O (registry, Serve's REST API, metrics); it
owns no timer. ``RolloutController`` is the detached, named Ray actor that wraps one engine,
ticks it on a background thread, and takes operator commands and replica reports. Tests and
the CLI step the same engine with ``tick()``.

One tick (Flagger's ``advanceCanary``, split in three):
1. observe: replica reports (pushed by replicas; only replicas Serve still runs count), the
   weights the router really applies (Serve's deployment status), the metrics window the
   machine asks for, queued operator commands;
2. decide: ``rollout.machine.advance`` (pure);
3. act, in order, then persist the new state with compare-and-set on the rollout's version.

Targets only move by compare-and-set on the registry (revision + 1, with an audit row), then
through the Serve config. A lost compare-and-set is re-read: if the target already is what the
rollout wants, nothing is written; if another writer moved it elsewhere, the controller does
not overwrite it: it aborts the rollout (weights to stable first) and leaves that cohort's
target to whoever moved it.

At start-up the engine repairs drift: Serve's user_configs are set to the registry's targets
(a stale ``serve deploy`` of an old config file is undone) and the router's weight to the
active rollout's (0 without one).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.contracts import BASIS_POINTS, ReplicaPhase
from app.errors import (
    InvalidState,
    NotFound,
    RegistryUnavailable,
    RevisionConflict,
    RolloutSystemError,
)
from app.registry import open_registry
from app.registry.base import Registry, ReplicaReportRecord, TargetRecord
from rollout import machine
from rollout.analysis import WindowStats
from rollout.machine import (
    Abort,
    Alert,
    Finish,
    Observations,
    OperatorCommand,
    Pause,
    PoolView,
    Promote,
    RecordAudit,
    Resume,
    Rollback,
    ScaleCanary,
    SetCanaryTarget,
    SetStableTarget,
    SetWeights,
)
from rollout.metrics import MetricsUnavailable, MetricsWindows, windows_for
from rollout.plan import RolloutPlan
from rollout.serve_control import ServeControl, ServeUnreachable
from rollout.state import RolloutState, Weights

log = logging.getLogger(__name__)

CONTROLLER_NAME: Final = "rollout-controller"
CONTROLLER_NAMESPACE: Final = "rollout"
ACTOR: Final = "rollout-controller"
EVENT_HISTORY: Final = 200  # audit events kept in the persisted state


class ControllerSettings(BaseModel):
    """Where the controller finds everything. Validated at the boundary (CLI, demo, tests)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry_url: str
    dashboard_url: str
    model: str = "ranker"
    environment: str = "default"
    app_name: str = "ranker"
    router_deployment: str = "router"
    stable_deployment: str = "stable"
    canary_deployment: str = "canary"
    tick_interval_s: float = Field(default=1.0, gt=0)
    # Reports older than this do not count as a replica's state.
    report_stale_s: float = Field(default=30.0, gt=0)
    # Ray exports metrics with a delay (RAY_FACTS: 0.5-1.2 s at a 1 s report interval, 4-8 s
    # at the default 10 s): a window's first snapshot is taken at least this long after the
    # weights went live, so no request routed under the previous weights is counted in it.
    metrics_delay_s: float = Field(default=2.0, ge=0)
    metrics_endpoints: tuple[str, ...] = ()  # empty: discover every node through Ray
    prometheus_url: str | None = None  # set: use PromQL instead of scraping
    actor: str = ACTOR


@dataclass
class _Live:
    """The rollout the engine is driving, with its registry record version."""

    state: RolloutState
    version: int
    events: list[dict[str, Any]] = field(default_factory=list)
    # The revision of each cohort's target as this rollout last knew it: its compare-and-set
    # writes expect exactly that, and a registry that moved past it was moved by another
    # writer (or by this rollout just before a crash, which the state tells apart).
    known: dict[str, int] = field(default_factory=dict)


class RolloutEngine:
    def __init__(
        self,
        settings: ControllerSettings,
        *,
        registry: Registry | None = None,
        serve: ServeControl | None = None,
        windows: MetricsWindows | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.registry = registry or open_registry(settings.registry_url)
        self.serve = serve or ServeControl(settings.dashboard_url)
        self.clock = clock
        self.windows = windows or windows_for(
            application=settings.app_name,
            prometheus_url=settings.prometheus_url,
            endpoints=settings.metrics_endpoints,
            clock=clock,
        )
        self._lock = threading.RLock()
        self._commands: deque[OperatorCommand] = deque()
        self._reports: dict[str, dict[str, Any]] = {}
        self._reports_lock = threading.Lock()  # replicas report while a tick runs
        self._persisted_reports: dict[str, tuple[Any, ...]] = {}
        self._observed: dict[str, TargetRecord] = {}
        self._conflicted: set[str] = set()
        self._live: _Live | None = None
        # Set while ticks cannot reach the registry or Serve: when the hold began (a tick's
        # ``now``) and why. The first tick that gets through moves the deadlines on by it.
        self._held_since: float | None = None
        self._held_reason: str | None = None
        self.last_window: WindowStats | None = None
        self.alerts: deque[str] = deque(maxlen=50)
        self.errors: deque[str] = deque(maxlen=50)

    # ================================================================== start-up

    def resume(self) -> str | None:
        """Pick up the active rollout from the registry (after a restart); its id or None."""
        with self._lock:
            record = self.registry.get_active_rollout(
                self.settings.model, self.settings.environment
            )
            if record is None or not record.state:
                self._live = None
                return None
            state = RolloutState.from_dict(record.state["machine"])
            self._live = _Live(
                state,
                record.version,
                list(record.state.get("events", [])),
                {k: int(v) for k, v in (record.state.get("known") or {}).items()},
            )
            log.info("resumed rollout %s at %s", state.rollout_id, state.phase.value)
            return state.rollout_id

    def reconcile_serve(self) -> list[str]:
        """Drift repair: make Serve's user_configs say what the registry says. Returns what
        was changed."""
        s = self.settings
        changed = []
        with self._lock:
            stable = self._target_or_none("stable")
            if stable is not None and self._set_serve_target(s.stable_deployment, stable):
                changed.append(f"stable target -> {stable.artifact_id} (rev {stable.revision})")
            canary: TargetRecord | None = None
            if self._live is not None and self._live.state.canary_target is not None:
                canary = self._target_or_none("canary")
            if self._set_serve_target(s.canary_deployment, canary):
                changed.append(
                    f"canary target -> {canary.artifact_id} (rev {canary.revision})"
                    if canary
                    else "canary target cleared"
                )
            bp = self._live.state.weights.canary_bp if self._live else 0
            if self._set_router_weight(bp):
                changed.append(f"router canary weight -> {bp} bp")
        for line in changed:
            log.warning("drift repaired: %s", line)
        return changed

    # ================================================================== operator surface

    def start_rollout(
        self,
        candidate_artifact_id: str,
        plan: RolloutPlan,
        *,
        actor: str = "operator",
        rollout_id: str | None = None,
    ) -> dict[str, Any]:
        s = self.settings
        with self._lock:
            artifact = self.registry.get_artifact(s.model, candidate_artifact_id)  # NotFound
            if artifact.state != "ready":
                raise InvalidState(
                    f"{candidate_artifact_id} is {artifact.state}, not ready: approve it first "
                    "(rollout registry approve ...)"
                )
            try:
                baseline = self.registry.get_target(s.model, s.environment, "stable")
            except NotFound:
                raise InvalidState(
                    f"{s.model}/{s.environment} has no stable target to compare with; "
                    "publish one first (rollout registry publish stable ...)"
                ) from None
            if self._live is not None and self._live.state.is_active:
                raise InvalidState(
                    f"rollout {self._live.state.rollout_id} of {s.model} is still "
                    f"{self._live.state.phase.value}; abort it or wait for it to finish"
                )
            if candidate_artifact_id == baseline.artifact_id:
                raise InvalidState(
                    f"{candidate_artifact_id} is already the stable target: nothing to roll out"
                )
            rollout_id = rollout_id or f"{candidate_artifact_id}-{uuid.uuid4().hex[:6]}"
            state = RolloutState.new(
                plan,
                rollout_id=rollout_id,
                model=s.model,
                candidate_artifact_id=candidate_artifact_id,
                baseline_artifact_id=baseline.artifact_id,
                now=self.clock(),
            )
            record = self.registry.create_rollout(
                s.model,
                s.environment,
                candidate_artifact_id=candidate_artifact_id,
                baseline_artifact_id=baseline.artifact_id,
                plan=plan.model_dump(mode="json"),
                phase=state.phase.value,
                weights=_weights_dict(state.weights),
                rollout_id=rollout_id,
            )
            canary = self._target_or_none("canary")
            self._live = _Live(
                state,
                record.version,
                known={"stable": baseline.revision, "canary": canary.revision if canary else 0},
            )
            self._conflicted.clear()
            self._persist(state)
            self._event("created", f"rollout of {candidate_artifact_id} by {actor}")
            return self.rollout_summary()

    def command(self, command: OperatorCommand) -> dict[str, Any]:
        with self._lock:
            if self._live is None or not self._live.state.is_active:
                raise InvalidState(f"no rollout of {self.settings.model} is in progress")
            self._commands.append(command)
            return {"queued": type(command).__name__.lower(), **self.rollout_summary()}

    def rollback_stable(self, artifact_id: str | None, *, actor: str, reason: str) -> TargetRecord:
        """Point stable back at an earlier artifact (a higher revision) when no rollout runs.

        The weights already send everything to stable; the stable replicas hot-swap while
        serving (a failed load leaves them on the current model)."""
        s = self.settings
        with self._lock:
            if self._live is not None and self._live.state.is_active:
                raise InvalidState("a rollout is in progress: use its rollback command")
            current = self.registry.get_target(s.model, s.environment, "stable")
            if artifact_id is None:
                artifact_id = self._previous_stable(current)
            target = self._publish("stable", artifact_id, actor=actor, reason=reason)
            self._set_serve_target(s.stable_deployment, target)
            return target

    def report_instance(self, report: Mapping[str, Any]) -> None:
        """A replica's report (pushed by the replica; see app/replica.py InstanceReport)."""
        replica_id = str(report.get("replica_id"))
        with self._reports_lock:
            previous = self._reports.get(replica_id)
            if previous is not None and previous.get("seq", -1) > report.get("seq", 0):
                return  # late delivery of an older report
            self._reports[replica_id] = dict(report)

    def reports(self) -> dict[str, dict[str, Any]]:
        with self._reports_lock:
            return dict(self._reports)

    # ================================================================== the tick

    def tick(self) -> dict[str, Any] | None:
        """One observe -> decide -> act -> persist step; the summary of the rollout or None.

        A tick that cannot reach the registry or Serve changes nothing and holds the rollout:
        serving goes on as it is, and the held time does not count against its deadlines."""
        with self._lock:
            now = self.clock()
            try:
                self._persist_reports()
            except RegistryUnavailable as exc:
                self._error(f"persist reports: {exc}")
                return self._hold(now, f"registry unavailable: {exc}")
            live = self._live
            if live is None or not live.state.is_active:
                return None
            try:
                self._check_targets(live)
            except RolloutSystemError as exc:
                self._error(f"registry: {exc}")
                return self._hold(now, f"registry: {exc}", exc)
            try:
                self.windows.observe()
            except MetricsUnavailable as exc:
                self._error(f"metrics: {exc}")
            try:
                observations = self._observe(live.state, now)
            except RolloutSystemError as exc:
                # Without a view of Serve nothing can be decided safely: hold.
                self._error(f"observe: {exc}")
                return self._hold(now, f"Serve: {exc}", exc)
            self._end_hold(live, now)
            commands = tuple(self._commands)
            self._commands.clear()
            new_state, actions = machine.advance(
                live.state, _with_commands(observations, commands), now
            )
            try:
                for action in actions:
                    self._execute(action, new_state)
            except _TargetConflict as conflict:
                # Keep the old state: the next tick aborts from it (weights to stable first).
                self._commands.appendleft(Abort(reason=str(conflict)))
                self._error(str(conflict))
                return self.rollout_summary()
            except RolloutSystemError as exc:
                # Serve or the registry refused or is down: keep the persisted state; the
                # next tick replays the same actions (they are declarative and idempotent).
                self._commands.extendleft(reversed(commands))
                self._error(f"act: {exc}")
                return self._hold(now, f"act: {exc}", exc)
            live.state = new_state
            try:
                self._persist(new_state)
            except RegistryUnavailable as exc:
                # The actions are done and the state is kept here; the next tick that reaches
                # the registry writes it (same expected version).
                self._error(f"persist: {exc}")
                return self._hold(now, f"registry unavailable: {exc}")
            return self.rollout_summary()

    def _hold(
        self, now: float, reason: str, error: Exception | None = None
    ) -> dict[str, Any] | None:
        """Note that this tick could not act; the first such tick starts the hold.

        Only when the registry or Serve is out of reach (``error`` None or an unavailability):
        a refusal (a config Serve rejects, a registry inconsistency) is no outage, and the
        deadlines keep counting, so a rollout that cannot proceed still ends."""
        live = self._live
        if live is None or not live.state.is_active:
            return None if live is None else self.rollout_summary()
        if error is not None and not isinstance(error, RegistryUnavailable | ServeUnreachable):
            return self.rollout_summary()
        if self._held_since is None:
            self._held_since = now
            self.alerts.append(
                f"warning: rollout {live.state.rollout_id} held: {reason}; serving goes on"
            )
            self._event("held", reason)
        self._held_reason = reason
        return self.rollout_summary()

    def _end_hold(self, live: _Live, now: float) -> None:
        if self._held_since is None:
            return
        seconds = now - self._held_since
        self._held_since = None
        self._held_reason = None
        live.state = machine.held(live.state, seconds)
        self._event("resumed", f"registry and Serve reachable again after {seconds:.1f}s held")

    # ---------------------------------------------------------------- observe

    def _observe(self, state: RolloutState, now: float) -> Observations:
        s = self.settings
        details = self.serve.details()
        deployments = (details.get("applications") or {}).get(s.app_name, {}).get(
            "deployments"
        ) or {}
        canary = self._pool(deployments.get(s.canary_deployment), "canary", now)
        stable = self._pool(deployments.get(s.stable_deployment), "stable", now)
        window = None
        wanted = machine.next_window(state, now)
        if wanted is not None:
            start, end = wanted
            try:
                window = self.windows.window_between(start + s.metrics_delay_s, end)
            except MetricsUnavailable as exc:
                self._error(f"metrics: {exc}")
            if window is not None:
                self.last_window = window
        return Observations(
            canary=canary,
            stable=stable,
            router_weights=_router_weights(deployments.get(s.router_deployment)),
            window=window,
            in_place_fits=in_place_fits(
                [self._reports_of(r.replica_id) for r in canary.replicas],
                [self._reports_of(r.replica_id) for r in stable.replicas],
                state.candidate_artifact_id,
            ),
        )

    def _reports_of(self, replica_id: str) -> Mapping[str, Any]:
        return self.reports().get(replica_id) or {}

    def _pool(self, deployment: Mapping[str, Any] | None, cohort: str, now: float) -> PoolView:
        if not deployment:
            return PoolView()
        running = {
            r.get("replica_id")
            for r in deployment.get("replicas") or []
            if r.get("state") == "RUNNING"
        }
        reports = []
        for replica_id, report in self.reports().items():
            if replica_id not in running or report.get("cohort") != cohort:
                continue
            if now - float(report.get("heartbeat", 0)) > self.settings.report_stale_s:
                continue
            error = report.get("last_error")
            reports.append(
                machine.ReplicaObservation(
                    replica_id=replica_id,
                    desired_artifact_id=report.get("desired_artifact"),
                    actual_artifact_id=report.get("actual_artifact"),
                    phase=ReplicaPhase(report.get("phase")),
                    error=_describe_error(error),
                )
            )
        expected = int(deployment.get("target_num_replicas") or len(running))
        return PoolView(replicas=tuple(reports), expected=expected)

    # ---------------------------------------------------------------- act

    def _execute(self, action: machine.Action, state: RolloutState) -> None:
        s = self.settings
        reason = f"rollout {state.rollout_id}"
        match action:
            case SetWeights(canary_bp=bp):
                self._set_router_weight(bp)
                self._event("weights", f"canary {bp / 100:g}%", canary_bp=bp)
            case SetCanaryTarget(artifact_id=None):
                self._set_serve_target(s.canary_deployment, None)
            case SetCanaryTarget(artifact_id=artifact_id):
                target = self._publish_for_rollout("canary", artifact_id, reason)
                if target is not None:
                    self._set_serve_target(s.canary_deployment, target)
            case SetStableTarget(artifact_id=artifact_id):
                target = self._publish_for_rollout("stable", artifact_id, reason)
                if target is not None:
                    self._set_serve_target(s.stable_deployment, target)
            case ScaleCanary(replicas=n):
                self.serve.update_deployment(s.app_name, s.canary_deployment, num_replicas=n)
            case RecordAudit(key=key, event=event, message=message):
                self._event(event, message, key=key)
            case Alert(severity=severity, message=message):
                self.alerts.append(f"{severity}: {message}")
                log.warning("ALERT %s: %s", severity, message)
            case Finish(phase=phase, reason=why):
                log.info("rollout %s finished: %s (%s)", state.rollout_id, phase.value, why)

    def _check_targets(self, live: _Live) -> None:
        """Notice targets moved by another writer since this rollout last wrote them: abort
        (weights to stable first) and leave that cohort's target as the other writer set it."""
        if live.state.phase.is_terminal:
            return
        for cohort in ("stable", "canary"):
            current = self._target_or_none(cohort)
            revision = current.revision if current else 0
            known = live.known.get(cohort)
            if known is None or revision == known:
                live.known[cohort] = revision
                continue
            ours = live.state.stable_target if cohort == "stable" else live.state.canary_target
            live.known[cohort] = revision
            if current is not None and current.artifact_id == ours:
                continue  # this rollout's own write, made just before a restart
            self._conflicted.add(cohort)
            where = f"{current.artifact_id} at revision {revision}" if current else "nothing"
            reason = (
                f"registry conflict: another writer moved the {cohort} target to {where}; "
                "the rollout stops and does not overwrite it"
            )
            self._commands.appendleft(Abort(reason=reason))
            self._error(reason)

    def _publish_for_rollout(
        self, cohort: str, artifact_id: str, reason: str
    ) -> TargetRecord | None:
        if cohort in self._conflicted:
            self.alerts.append(
                f"warning: {cohort} target left as another writer set it (not {artifact_id})"
            )
            return None
        live = self._live
        assert live is not None
        target = self._publish(
            cohort,
            artifact_id,
            actor=self.settings.actor,
            reason=reason,
            expected_revision=live.known.get(cohort),
        )
        live.known[cohort] = target.revision
        return target

    def _publish(
        self,
        cohort: str,
        artifact_id: str,
        *,
        actor: str,
        reason: str,
        expected_revision: int | None = None,
    ) -> TargetRecord:
        """Compare-and-set the cohort's target to ``artifact_id`` unless it already is.

        ``expected_revision``: the revision the caller last knew (a rollout's own record);
        None: whatever the registry holds now (an operator's explicit command)."""
        s = self.settings
        current = self._target_or_none(cohort)
        if current is not None and current.artifact_id == artifact_id:
            return current  # a replayed action, or someone already did it: nothing to write
        if expected_revision is None:
            expected_revision = current.revision if current else 0
        try:
            target = self.registry.publish(
                s.model,
                s.environment,
                cohort,
                artifact_id,
                expected_revision,
                actor=actor,
                reason=reason,
            )
        except RevisionConflict as exc:
            now_target = self._target_or_none(cohort)
            if now_target is not None and now_target.artifact_id == artifact_id:
                return now_target
            self._conflicted.add(cohort)
            where = (
                f"{now_target.artifact_id} at revision {now_target.revision}"
                if now_target
                else "nothing"
            )
            raise _TargetConflict(
                f"registry conflict: another writer moved the {cohort} target to {where} "
                f"while this rollout wanted {artifact_id}; not overwriting it"
            ) from exc
        self._observed[cohort] = target
        return target

    def _target_or_none(self, cohort: str) -> TargetRecord | None:
        s = self.settings
        try:
            target = self.registry.get_target(
                s.model, s.environment, cohort, observed=self._observed.get(cohort)
            )
        except NotFound:
            return None
        self._observed[cohort] = target
        return target

    def _previous_stable(self, current: TargetRecord) -> str:
        for entry in self.registry.history(
            self.settings.model, self.settings.environment, cohort="stable"
        ):
            if entry.new_revision == current.revision and entry.old_artifact_id:
                return entry.old_artifact_id
        raise InvalidState(
            f"stable has no earlier artifact than {current.artifact_id}; name one with --to"
        )

    def _set_serve_target(self, deployment: str, target: TargetRecord | None) -> bool:
        s = self.settings
        config = self.serve.current_user_config(s.app_name, deployment) or {}
        wanted = dict(config)
        wanted["target"] = (
            None
            if target is None
            else {
                "revision": target.revision,
                "artifact_id": target.artifact_id,
                "manifest_uri": target.manifest_uri,
                "manifest_sha256": target.manifest_sha256,
                "feature_schema": target.feature_schema,
            }
        )
        if wanted == config:
            return False
        return self.serve.update_deployment(s.app_name, deployment, user_config=wanted)

    def _set_router_weight(self, canary_bp: int) -> bool:
        s = self.settings
        config = dict(self.serve.current_user_config(s.app_name, s.router_deployment) or {})
        if config.get("canary_bp", 0) == canary_bp:
            return False
        config["canary_bp"] = canary_bp
        return self.serve.update_deployment(s.app_name, s.router_deployment, user_config=config)

    # ---------------------------------------------------------------- persistence

    def _event(self, event: str, message: str, *, key: str | None = None, **data: Any) -> None:
        live = self._live
        if live is None:
            return
        if key is not None and any(e.get("key") == key for e in live.events):
            return  # a replayed audit record
        live.events.append(
            {"key": key, "event": event, "message": message, "at": self.clock(), **data}
        )
        del live.events[:-EVENT_HISTORY]
        log.info("rollout %s: %s: %s", live.state.rollout_id, event, message)

    def _persist(self, state: RolloutState) -> None:
        live = self._live
        assert live is not None
        record = self.registry.update_rollout(
            state.rollout_id,
            expected_version=live.version,
            phase=_persisted_phase(state),
            step=state.step_index + 1,  # 1-based step in progress; 0 before the first
            weights=_weights_dict(state.weights),
            verdicts=[
                {
                    "window_end": v.window_end,
                    "step": v.step_index,
                    "canary_bp": v.canary_bp,
                    "outcome": v.outcome.value,
                    "reasons": list(v.reasons),
                }
                for v in state.verdicts
            ],
            state={"machine": state.to_dict(), "events": live.events, "known": live.known},
            reason=state.reason,
        )
        live.version = record.version

    def _persist_reports(self) -> None:
        """Replica reports go to the registry when they change (heartbeats at most every
        10 s), so ``rollout status`` and operators see them without the actor."""
        s = self.settings
        for replica_id, report in self.reports().items():
            fingerprint = (
                report.get("phase"),
                report.get("desired_revision"),
                report.get("actual_revision"),
                _describe_error(report.get("last_error")),
                int(float(report.get("heartbeat", 0)) // 10),
            )
            if self._persisted_reports.get(replica_id) == fingerprint:
                continue
            try:
                self.registry.upsert_replica_report(_registry_report(report, s))
            except RegistryUnavailable:
                raise  # the next report would wait out the same timeout: stop here
            except RolloutSystemError as exc:
                self._error(f"persist report of {replica_id}: {exc}")
                continue
            self._persisted_reports[replica_id] = fingerprint

    def _error(self, message: str) -> None:
        self.errors.append(message)
        log.warning("%s", message)

    # ================================================================== views

    def rollout_summary(self) -> dict[str, Any]:
        live = self._live
        if live is None:
            return {"rollout": None}
        st = live.state
        return {
            "rollout": st.rollout_id,
            "model": st.model,
            "candidate": st.candidate_artifact_id,
            "baseline": st.baseline_artifact_id,
            "phase": st.phase.value,
            "finished": st.finished,
            "step": st.step_index,
            "step_percent": st.step_percent,
            "steps": list(st.plan.steps),
            "weights": _weights_dict(st.weights),
            "failed_checks": st.failed_checks,
            "reason": st.reason,
            "pending_gate": st.pending_gate,
            "held": None
            if self._held_since is None
            else {"since": self._held_since, "reason": self._held_reason},
            "verdicts": [
                {"step": v.step_index, "outcome": v.outcome.value, "reasons": list(v.reasons)}
                for v in st.verdicts
            ],
            "events": live.events[-10:],
        }

    def view(self) -> dict[str, Any]:
        s = self.settings
        with self._lock:
            targets: list[dict[str, Any]] | None
            try:
                targets = [t.to_dict() for t in self.registry.list_targets(s.model, s.environment)]
            except RolloutSystemError as exc:
                # Status is asked for exactly when something is down: show the rollout as
                # the controller holds it, and say that the registry cannot be read.
                targets = None
                self._error(f"status: registry: {exc}")
            window = self.last_window
            return {
                **self.rollout_summary(),
                "targets": targets,
                "replicas": sorted(
                    (
                        {
                            "replica": rid,
                            "cohort": r.get("cohort"),
                            "phase": r.get("phase"),
                            "desired": r.get("desired_artifact"),
                            "actual": r.get("actual_artifact"),
                            "actual_revision": r.get("actual_revision"),
                            "error": _describe_error(r.get("last_error")),
                            "age_s": round(self.clock() - float(r.get("heartbeat", 0)), 1),
                        }
                        for rid, r in self.reports().items()
                    ),
                    key=lambda r: (str(r["cohort"]), str(r["replica"])),
                ),
                "last_window": None if window is None else _window_dict(window),
                "alerts": list(self.alerts)[-10:],
                "errors": list(self.errors)[-10:],
            }


class _TargetConflict(RolloutSystemError):
    category = "registry.conflict"


# ====================================================================== small helpers


def _weights_dict(weights: Weights) -> dict[str, int]:
    return {"stable_bp": weights.stable_bp, "canary_bp": weights.canary_bp}


def _persisted_phase(state: RolloutState) -> str:
    # The registry finishes a rollout when it is given a terminal phase. The machine's phase
    # turns terminal before the canary pool is cleaned up, so until ``finished`` the record
    # says e.g. "rolled_back-cleanup" and the rollout still blocks a new one.
    if state.phase.is_terminal and not state.finished:
        return f"{state.phase.value}-cleanup"
    return state.phase.value


def _with_commands(obs: Observations, commands: tuple[OperatorCommand, ...]) -> Observations:
    from dataclasses import replace

    return replace(obs, commands=commands)


def _router_weights(deployment: Mapping[str, Any] | None) -> Weights | None:
    """The weights the router applies: its user_config once Serve reports every replica
    reconfigured (HEALTHY; reconfiguring replicas are UPDATING)."""
    if not deployment or deployment.get("status") != "HEALTHY":
        return None
    config = (deployment.get("deployment_config") or {}).get("user_config") or {}
    replicas = deployment.get("replicas") or []
    if any(r.get("state") != "RUNNING" for r in replicas):
        return None
    canary_bp = int(config.get("canary_bp", 0))
    return Weights(BASIS_POINTS - canary_bp, canary_bp)


def in_place_fits(
    canary: list[Mapping[str, Any]], stable: list[Mapping[str, Any]], candidate: str
) -> bool | None:
    """Whether every stable replica can load ``candidate`` beside the model it serves, from
    the replicas' own reports: what loading the candidate alone took on a canary replica (its
    load's estimate: weights, load temporaries, warm-up, margin) plus each stable replica's
    resident bytes, within that replica's capacity. None when a report lacks a figure (the
    machine then promotes by shift); the stable replicas re-check at load time all the same.
    """
    peaks = [
        ((r.get("capacity") or {}).get("memory") or {}).get("load_peak_bytes")
        for r in canary
        if r.get("actual_artifact") == candidate
    ]
    if not peaks or None in peaks or not stable:
        return None
    needed = max(int(p) for p in peaks)
    for report in stable:
        memory = (report.get("capacity") or {}).get("memory") or {}
        resident, capacity = memory.get("resident_bytes"), memory.get("capacity_bytes")
        if resident is None or capacity is None:
            return None
        if int(resident) + needed > int(capacity):
            return False
    return True


def _describe_error(error: Any) -> str | None:
    if not error:
        return None
    if isinstance(error, Mapping):
        category = error.get("category")
        message = error.get("message") or ""
        return f"{category}: {message}" if category else str(message)
    return str(error)


def _registry_report(report: Mapping[str, Any], s: ControllerSettings) -> ReplicaReportRecord:
    return ReplicaReportRecord(
        replica_id=str(report["replica_id"]),
        model=s.model,
        environment=s.environment,
        cohort=str(report.get("cohort")),
        state=str(report.get("phase")),
        heartbeat_at=datetime.fromtimestamp(float(report.get("heartbeat", 0)), UTC),
        desired_revision=report.get("desired_revision"),
        desired_artifact_id=report.get("desired_artifact"),
        actual_revision=report.get("actual_revision"),
        actual_artifact_id=report.get("actual_artifact"),
        last_error=_describe_error(report.get("last_error")),
        capacity=dict(report.get("capacity") or {}),
        timings={k: float(v) for k, v in (report.get("timings") or {}).items()},
    )


def _window_dict(window: WindowStats) -> dict[str, Any]:
    def cohort(stats: Any) -> dict[str, Any] | None:
        if stats is None:
            return None
        span = max(window.duration_s, 1e-9)
        return {
            "requests": stats.requests,
            "rps": round(stats.requests / span, 1),
            "error_rate": stats.error_rate,
            "p50_ms": stats.p50_ms,
            "p99_ms": stats.p99_ms,
        }

    return {
        "start": window.start,
        "end": window.end,
        "canary": cohort(window.canary),
        "stable": cohort(window.stable),
    }


COMMANDS: Final[dict[str, Callable[[str], OperatorCommand]]] = {
    "pause": lambda reason: Pause(reason=reason),
    "resume": lambda _reason: Resume(),
    "promote": lambda _reason: Promote(),
    "abort": lambda reason: Abort(reason=reason or "aborted by operator"),
    "rollback": lambda reason: Rollback(reason=reason or "rollback requested by operator"),
}

CommandName = Literal["pause", "resume", "promote", "abort", "rollback"]


# ====================================================================== the Ray actor


def absolute_registry_url(url: str) -> str:
    """An SQLite path relative to the caller's directory, made absolute: the actor's worker
    process runs elsewhere."""
    import os

    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/"):
        return prefix + os.path.abspath(url[len(prefix) :])
    return url


class RolloutController:
    """The detached, named controller actor (one per cluster): ticks its engine on a
    background thread and serves the CLI and the replicas' reports."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        logging.basicConfig(level=logging.INFO)
        self.settings = ControllerSettings.model_validate(dict(settings))
        self.engine = RolloutEngine(self.settings)
        self.engine.resume()
        self.repaired: list[str] | None = None
        self._stop = threading.Event()
        self._ticks = 0
        self._thread = threading.Thread(target=self._loop, name="rollout-ticks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.tick_interval_s):
            try:
                if self.repaired is None:
                    # Serve may not be up yet when the controller starts: retry until it is.
                    self.repaired = self.engine.reconcile_serve()
                self.engine.tick()
                self._ticks += 1
            except Exception as exc:  # the loop must outlive any one bad tick
                self.engine.errors.append(f"tick: {type(exc).__name__}: {exc}")
                log.exception("controller tick failed")

    # -- called by the CLI, the demo and tests
    def ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "ticks": self._ticks,
            "repaired": self.repaired,
            **self.settings.model_dump(),
        }

    def start_rollout(
        self, candidate_artifact_id: str, plan: Mapping[str, Any], actor: str = "operator"
    ) -> dict[str, Any]:
        return self.engine.start_rollout(
            candidate_artifact_id, RolloutPlan.model_validate(dict(plan)), actor=actor
        )

    def command(self, name: str, reason: str = "") -> dict[str, Any]:
        return self.engine.command(COMMANDS[name](reason))

    def rollback_stable(
        self, artifact_id: str | None, actor: str = "operator", reason: str = "rollback"
    ) -> dict[str, Any]:
        return self.engine.rollback_stable(artifact_id, actor=actor, reason=reason).to_dict()

    def status(self) -> dict[str, Any]:
        return self.engine.view()

    def tick(self) -> dict[str, Any] | None:
        return self.engine.tick()

    def reconcile(self) -> list[str]:
        self.repaired = self.engine.reconcile_serve()
        return self.repaired

    def stop(self) -> None:
        self._stop.set()

    # -- called by replicas (fire and forget)
    def report_instance(self, report: Mapping[str, Any]) -> None:
        self.engine.report_instance(report)


def connect(address: str | None = None) -> str | None:
    """Attach to the running cluster (``RAY_ADDRESS`` or ``auto``) in the controller's
    namespace; returns the cluster's dashboard URL when Ray tells it."""
    import ray

    if ray.is_initialized():
        return None
    context = ray.init(
        address=address or "auto",
        namespace=CONTROLLER_NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    url = getattr(context, "dashboard_url", None)
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


def get_controller(name: str = CONTROLLER_NAME) -> Any | None:
    import ray

    try:
        return ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def ensure_controller(settings: ControllerSettings, name: str = CONTROLLER_NAME) -> Any:
    """The named controller, created (detached) if absent. Restarted by Ray if its process
    dies; a new one resumes the active rollout from the registry."""
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
    ).remote(settings.model_dump())
    ray.get(handle.ping.remote())
    return handle
