"""The rollout engine: carries out the state machine against the registry, Serve and metrics.

``RolloutEngine`` holds the logic and owns no timer: the controller actor (``rollout.actor``)
ticks it on a background thread, and tests step it with ``tick()``. It reaches the world only
through its ports: the registry (``app.registry.Registry``), Serve (``rollout.serve_port``),
the metrics windows (``rollout.metrics``) and a clock.

One tick, in three parts:
1. observe: replica reports (pushed by replicas; only replicas Serve still runs count), the
   weights the router really applies, the metrics window the machine asks for, queued
   operator commands. One read of Serve.
2. decide: ``rollout.machine.advance`` (pure).
3. act, in the machine's order, then persist the new state with compare-and-set on the
   rollout's version. Serve changes that follow each other go out as one write; a weight
   change is always a write of its own (what comes before it is sent first, what follows it
   after), and a target is published in the registry before Serve is told of it.

Targets only move by compare-and-set in the registry (``rollout.targets``), then through the
Serve config. A target another writer moved is not overwritten: the rollout is aborted
(weights to stable first) and that cohort's target is left to whoever moved it.

Drift repair, on every tick (rollout or not) and at start-up: Serve's user_configs are set to
the registry's targets and the router's weight and mirroring to the active rollout's (0
without one), the canary pool to the rollout's size. Serve's config changes behind the
controller's back when an old config is applied again: a stale ``serve deploy``, or KubeRay
resubmitting its cached ``serveConfigV2`` (after an operator restart or on a new head pod),
which puts back the targets and weights the manifest was rendered with. The tick's one read of
Serve shows it; one write repairs it, recorded as a ``drift`` event (and an alert). When the
canary's side drifted during a rollout, its weight and mirroring are withdrawn until every
canary replica reports the candidate ready again (``machine.after_drift``), since the replicas
may be reloading; a stable target put back at an older revision changes nothing on the
replicas, which ignore a late revision.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from app import telemetry
from app.contracts import (
    CANARY,
    STABLE,
    Cohort,
    CommandAccepted,
    ControllerSettings,
    ControllerStatus,
    ExpectedDivergence,
    InstanceReport,
    RolloutSummary,
    ShadowRouting,
    Target,
)
from app.errors import (
    ConfigError,
    InvalidState,
    MetricsUnavailable,
    NotFound,
    RegistryUnavailable,
    RolloutSystemError,
    TargetConflict,
)
from app.registry import Registry, TargetRecord, open_registry
from rollout import machine
from rollout.analysis import WindowStats
from rollout.custom_checks import CustomCheckReader
from rollout.live import LiveRollout, weights_dict
from rollout.machine import (
    Abort,
    Action,
    Alert,
    Finish,
    Observations,
    OperatorCommand,
    PoolView,
    RecordAudit,
    ScaleCanary,
    SetCanaryTarget,
    SetShadow,
    SetStableTarget,
    SetWeights,
)
from rollout.metrics import MetricsWindows, PromQLSource, scrape_spacing_s, windows_for
from rollout.plan import RolloutPlan
from rollout.reports import ReportStore, in_place_fits
from rollout.serve_control import ServeUnreachable
from rollout.serve_port import (
    CANARY_REPLICAS,
    CANARY_TARGET,
    ROUTER_SHADOW,
    ROUTER_WEIGHT,
    STABLE_TARGET,
    HttpServePort,
    ServeChange,
    ServePort,
    ServeState,
    drift,
)
from rollout.shadow_judge import expectation_applies
from rollout.start_estimate import (
    TRAFFIC_LOOKBACK_S,
    MeasuredTraffic,
    estimate_note,
    measured_traffic,
    plan_for_start,
)
from rollout.state import RolloutState
from rollout.targets import TargetBook
from rollout.views import controller_status, fields_of, rollout_summary

log = logging.getLogger(__name__)


def routing_of(action: SetShadow) -> ShadowRouting:
    if action.fraction_bp <= 0:
        return ShadowRouting()  # off, and every other field back to its default
    return ShadowRouting(
        fraction_bp=action.fraction_bp,
        max_in_flight=action.max_in_flight,
        top_k=action.top_k,
        rbo_p=action.rbo_p,
    )


def describe_change(wanted: ServeChange, changed: frozenset[str]) -> list[str]:
    """What a write of ``wanted`` changed, one line per setting, in words."""
    lines = []
    for cohort, what in ((STABLE, STABLE_TARGET), (CANARY, CANARY_TARGET)):
        if what not in changed or cohort not in wanted.targets:
            continue
        target = wanted.targets[cohort]
        lines.append(
            f"{cohort} target -> {target.artifact_id} (rev {target.revision})"
            if target is not None
            else f"{cohort} target cleared"
        )
    if ROUTER_WEIGHT in changed and wanted.canary_bp is not None:
        lines.append(f"router canary weight -> {wanted.canary_bp} bp")
    if ROUTER_SHADOW in changed and wanted.shadow is not None:
        lines.append(f"router shadow mirroring -> {wanted.shadow.fraction_bp} bp")
    if CANARY_REPLICAS in changed and wanted.canary_replicas is not None:
        lines.append(f"canary replicas -> {wanted.canary_replicas}")
    return lines


# A sample is on its node's metrics endpoint at most one export interval after the router
# handed it to Ray, plus the agent's handling: a fifth of the interval covers that.
EXPORT_LAG_FACTOR = 1.2


def window_delay_s(configured_s: float, export_interval_s: float | None) -> float:
    """How long after a weight change a window may start: the configured delay, raised to
    what the metrics path takes at worst. A request answered just before the change is
    counted by its router at once, handed to Ray with the router's next flush (at most
    ``REQUEST_COUNT_FLUSH_S`` later) and exported with the next report after that (up to one
    interval); a window that began earlier would count it under the new weights."""
    if export_interval_s is None:
        return configured_s
    worst = telemetry.REQUEST_COUNT_FLUSH_S + EXPORT_LAG_FACTOR * export_interval_s
    return max(configured_s, worst)


# Between rollouts the controller takes a metrics snapshot this often (one scrape of every
# node's endpoint: about 70 ms of its agent's CPU on the test machine), so that a start can
# estimate from the minutes before it (rollout.start_estimate.TRAFFIC_LOOKBACK_S).
IDLE_OBSERVE_S = 15.0


def evidence_interval_s(
    settings: ControllerSettings, export_interval_s: float | None
) -> float | None:
    """How often the sequential judge adds evidence: the configured interval, else every
    distinct snapshot of Ray's endpoints (they move once per export; scrapes are at least
    ``scrape_spacing_s`` apart), else None (once per plan interval: a Prometheus server's
    scrape interval is not known here)."""
    if settings.evidence_interval_s is not None:
        return settings.evidence_interval_s
    if settings.prometheus_url:
        return None
    return scrape_spacing_s(export_interval_s) or None


def shadow_routing(state: RolloutState) -> ShadowRouting:
    """What the router should mirror for ``state``: the plan's shadow while it is on."""
    shadow = state.plan.shadow
    if shadow is None or state.shadow_bp <= 0 or state.phase.is_terminal:
        return ShadowRouting()
    return routing_of(SetShadow(state.shadow_bp, shadow.max_in_flight, shadow.top_k, shadow.rbo_p))


class RolloutEngine:
    def __init__(
        self,
        settings: ControllerSettings,
        *,
        registry: Registry | None = None,
        serve: ServePort | None = None,
        windows: MetricsWindows | None = None,
        clock: Callable[[], float] = time.time,
        metrics_export_interval_s: float | None = None,
        custom_checks: CustomCheckReader | None = None,
    ) -> None:
        """``metrics_export_interval_s``: Ray's metrics report interval in this cluster, which
        windows must wait out after a weight change (None: only the configured delay).
        ``custom_checks``: where plans' custom checks are read (default: the settings'
        Prometheus server; None without one: such plans are refused)."""
        self.settings = settings
        self.metrics_export_interval_s = metrics_export_interval_s
        self.window_delay_s = window_delay_s(settings.metrics_delay_s, metrics_export_interval_s)
        self.evidence_interval_s = evidence_interval_s(settings, metrics_export_interval_s)
        self.registry = registry or open_registry(settings.registry_url)
        self.serve = serve or HttpServePort.for_settings(settings)
        self.windows = windows or windows_for(
            application=settings.app_name,
            prometheus_url=settings.prometheus_url,
            endpoints=settings.metrics_endpoints,
            clock=clock,
            export_interval_s=metrics_export_interval_s,
        )
        if custom_checks is None and settings.prometheus_url:
            custom_checks = CustomCheckReader(
                PromQLSource(settings.prometheus_url, application=settings.app_name),
                app=settings.app_name,
            )
        self.custom_checks = custom_checks
        self.clock = clock
        self.targets = TargetBook(
            self.registry, model=settings.model, environment=settings.environment
        )
        self.reports = ReportStore(clock=clock)  # heartbeats are judged by this clock
        self._lock = threading.RLock()
        self._commands: deque[OperatorCommand] = deque()
        self._live: LiveRollout | None = None
        # Set while ticks cannot reach the registry or Serve: when the hold began (a tick's
        # ``now``) and why. The first tick that gets through moves the deadlines on by it.
        self._held_since: float | None = None
        self._held_reason: str | None = None
        # Whether the last holding tick found the registry out of reach (not Serve): a read of
        # it then waits out the connect timeout (10 s for PostgreSQL) before failing again.
        self._held_on_registry = False
        self.last_window: WindowStats | None = None
        self._idle_observed_at: float | None = None
        self.alerts: deque[str] = deque(maxlen=50)
        self.errors: deque[str] = deque(maxlen=50)
        # Drift repairs so far, by what drifted (``STABLE_TARGET`` ...): exported as a counter.
        self.drift_repairs: dict[str, int] = {}
        # After the canary's target or size drifted, only reports sent since count towards
        # its readiness: one from before may still say ready while the replica reloads.
        self._canary_reports_since: float | None = None

    @property
    def live(self) -> LiveRollout | None:
        return self._live

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
            self._live = live = LiveRollout.from_record(record)
            log.info("resumed rollout %s at %s", live.state.rollout_id, live.state.phase.value)
            return live.state.rollout_id

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """No tick, command or drift repair runs inside: for a read-modify-write of the Serve
        config from outside the engine (the router's standby policy) that must not undo one
        of the engine's."""
        with self._lock:
            yield

    def reconcile_serve(self) -> list[str]:
        """Drift repair: make Serve's user_configs say what the registry and the rollout say,
        in one write. Returns what was changed."""
        with self._lock:
            wanted = self._serve_wanted()
            changed = self.serve.write(wanted)
            self._count_drift(changed)
        lines = describe_change(wanted, changed)
        for line in lines:
            log.warning("drift repaired: %s", line)
        return lines

    def _serve_wanted(self) -> ServeChange:
        """What Serve's config should say: the registry's targets (the canary's only while a
        rollout has one), the rollout's weight, mirroring and canary pool size."""
        live = self._live
        targets: dict[Cohort, Target | None] = {}
        stable = self.targets.current(STABLE)
        if stable is not None:
            targets[STABLE] = stable.target()
        canary: TargetRecord | None = None
        if live is not None and live.state.canary_target is not None:
            canary = self.targets.current(CANARY)
        targets[CANARY] = canary.target() if canary is not None else None
        active = live is not None and live.state.is_active
        return ServeChange(
            targets=targets,
            canary_bp=live.state.weights.canary_bp if live is not None else 0,
            shadow=shadow_routing(live.state) if live is not None else ShadowRouting(),
            canary_replicas=live.state.canary_replicas if active and live is not None else None,
        )

    def _count_drift(self, repaired: frozenset[str]) -> None:
        for what in repaired:
            self.drift_repairs[what] = self.drift_repairs.get(what, 0) + 1

    def _repair_drift(self, serve: ServeState, now: float) -> bool:
        """Compare what Serve was last asked for (``serve``, this tick's read) with what it
        should say; on a difference, repair it in one write and record it. True when a repair
        was written (``serve`` is then out of date)."""
        wanted = self._serve_wanted()
        found = drift(serve, wanted)
        if not found:
            return False
        live = self._live
        canary_side = found & {CANARY_TARGET, CANARY_REPLICAS, ROUTER_WEIGHT, ROUTER_SHADOW}
        if live is not None and live.state.is_active and canary_side:
            # The canary pool may be reloading: no users or copies for it until it is ready.
            live.state = machine.after_drift(live.state)
            if found & {CANARY_TARGET, CANARY_REPLICAS}:
                self._canary_reports_since = now
            wanted = self._serve_wanted()
        changed = self.serve.write(wanted)
        self._count_drift(found | changed)
        lines = describe_change(wanted, changed | found)
        message = (
            "Serve's config differed from the registry and the rollout (an old config applied "
            "again, e.g. KubeRay resubmitting serveConfigV2); repaired: " + "; ".join(lines)
        )
        if live is not None and live.state.is_active and live.state.withdrawn_canary_bp:
            message += (
                f" (canary weight {live.state.withdrawn_canary_bp / 100:g}% withdrawn until "
                "every canary replica serves the candidate again)"
            )
        log.warning("%s", message)
        self.alerts.append(f"warning: {message}")
        self._event("drift", message)
        return True

    # ================================================================== operator surface

    def start_rollout(
        self,
        candidate_artifact_id: str,
        plan: RolloutPlan,
        *,
        actor: str = "operator",
        rollout_id: str | None = None,
        force: bool = False,
    ) -> RolloutSummary:
        """Start a rollout. Under the sequential judge, the traffic of the last minutes sets
        what each step will take (rollout.start_estimate): a plan that leaves its deadline to
        the estimate gets one; a step that does not fit the plan's deadline is refused
        (``PlanDoesNotFit``) unless ``force``."""
        s = self.settings
        with self._lock:
            artifact = self.registry.get_artifact(s.model, candidate_artifact_id)  # NotFound
            if artifact.state != "ready":
                raise InvalidState(
                    f"{candidate_artifact_id} is {artifact.state}, not ready: approve it first "
                    "(rollout registry approve ...)"
                )
            try:
                baseline = self.registry.get_target(s.model, s.environment, STABLE)
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
            if plan.custom_checks and self.custom_checks is None:
                raise ConfigError(
                    "custom_checks: read from a Prometheus server, and this controller has "
                    "none (start it with a prometheus_url)"
                )
            if plan.canary_scaling.idle_replicas == 0:
                canary = self.serve.read().canary
                if canary is None or canary.autoscaling is None:
                    raise InvalidState(
                        "canary_scaling.idle_replicas: 0 needs a canary deployment that Serve "
                        "autoscales (autoscaling_config with min_replicas 0); the "
                        f"{s.canary_deployment!r} deployment has a fixed replica count, which "
                        "Serve cannot set to 0"
                    )
            plan, estimated = plan_for_start(
                plan,
                self.measure_traffic(),
                per_step_overhead_s=self.window_delay_s
                + (self.evidence_interval_s or plan.interval_s),
                force=force,
            )
            rollout_id = rollout_id or f"{candidate_artifact_id}-{uuid.uuid4().hex[:6]}"
            expected, note = None, ""
            if plan.shadow is not None:
                try:
                    recorded = ExpectedDivergence.from_metadata(artifact.metadata)
                except ConfigError as exc:
                    raise InvalidState(
                        f"{candidate_artifact_id}: its manifest's {exc} (re-record it with "
                        "rollout replay)"
                    ) from None
                applies, note = expectation_applies(
                    recorded,
                    plan.shadow,
                    baseline_artifact_id=baseline.artifact_id,
                    baseline_manifest_sha256=baseline.manifest_sha256,
                )
                if applies:
                    assert recorded is not None
                    expected, note = recorded.model_dump(mode="json"), ""
            state = RolloutState.new(
                plan,
                rollout_id=rollout_id,
                model=s.model,
                candidate_artifact_id=candidate_artifact_id,
                baseline_artifact_id=baseline.artifact_id,
                now=self.clock(),
                shadow_expected=expected,
                shadow_basis_note=note,
            )
            state.estimate = estimated
            record = self.registry.create_rollout(
                s.model,
                s.environment,
                candidate_artifact_id=candidate_artifact_id,
                baseline_artifact_id=baseline.artifact_id,
                plan=plan.model_dump(mode="json"),
                phase=state.phase.value,
                weights=weights_dict(state.weights),
                rollout_id=rollout_id,
            )
            canary = self.targets.current(CANARY)
            self._live = LiveRollout(
                state,
                record.version,
                known={STABLE: baseline.revision, CANARY: canary.revision if canary else 0},
            )
            self.targets.conflicted.clear()
            self._canary_reports_since = None
            self._live.persist(self.registry)
            self._event(
                "created",
                f"rollout of {candidate_artifact_id} by {actor}; {estimate_note(estimated, plan)}",
            )
            return self.rollout_summary()

    def measure_traffic(self) -> MeasuredTraffic | None:
        """The traffic of the last ``TRAFFIC_LOOKBACK_S`` (None: not enough measured yet)."""
        now = self.clock()
        try:
            self.windows.observe()
            window = self.windows.window_between(now - TRAFFIC_LOOKBACK_S, now)
        except Exception as exc:  # no measurement is no estimate, not a failed start
            self._error(f"metrics before the start: {exc}")
            return None
        return measured_traffic(window)

    def command(
        self, command: OperatorCommand, *, actor: str = "operator", reason: str = ""
    ) -> CommandAccepted:
        """Queue an operator command for the next tick, and record who gave it and why in the
        rollout's events (persisted with the tick's state), whatever the command keeps."""
        with self._lock:
            if self._live is None or not self._live.state.is_active:
                raise InvalidState(f"no rollout of {self.settings.model} is in progress")
            self._commands.append(command)
            name = type(command).__name__.lower()
            self._event("operator", f"{name} by {actor}" + (f": {reason}" if reason else ""))
            return CommandAccepted(queued=name, **fields_of(self.rollout_summary()))

    def rollback_stable(self, artifact_id: str | None, *, actor: str, reason: str) -> TargetRecord:
        """Point stable back at an earlier artifact (a higher revision) when no rollout runs.

        The weights already send everything to stable; the stable replicas hot-swap while
        serving (a failed load leaves them on the current model)."""
        s = self.settings
        with self._lock:
            if self._live is not None and self._live.state.is_active:
                raise InvalidState("a rollout is in progress: use its rollback command")
            current = self.registry.get_target(s.model, s.environment, STABLE)
            if artifact_id is None:
                artifact_id = self.targets.previous_stable(current)
            target = self.targets.publish(STABLE, artifact_id, actor=actor, reason=reason)
            self.serve.write(ServeChange(targets={STABLE: target.target()}))
            return target

    def report_instance(self, report: Mapping[str, Any]) -> InstanceReport | None:
        """A replica's report (``InstanceReport.model_dump(mode="json")``); the report kept,
        or None when it was dropped (invalid, or older than the one kept)."""
        refused_before = self.reports.refused
        kept = self.reports.receive(report)
        if self.reports.refused > refused_before:
            self._error(f"report refused: {self.reports.last_refusal}")
        return kept

    # ================================================================== the tick

    def tick(self) -> RolloutSummary | None:
        """One observe -> decide -> act -> persist step; the summary of the rollout or None.

        A tick that cannot reach the registry or Serve changes nothing and holds the rollout:
        serving goes on as it is, and the held time does not count against its deadlines."""
        s = self.settings
        with self._lock:
            now = self.clock()
            try:
                self.reports.persist_changed(
                    self.registry, model=s.model, environment=s.environment, on_error=self._error
                )
            except RegistryUnavailable as exc:
                self._error(f"persist reports: {exc}")
                return self._hold(now, f"registry unavailable: {exc}", exc)
            live = self._live
            active = live is not None and live.state.is_active
            if live is not None and active:
                try:
                    self._check_targets(live)
                except RolloutSystemError as exc:
                    self._error(f"registry: {exc}")
                    return self._hold(now, f"registry: {exc}", exc)
            try:
                serve = self.serve.read()
            except RolloutSystemError as exc:
                # Without a view of Serve nothing can be decided safely: hold.
                self._error(f"observe: {exc}")
                return self._hold(now, f"Serve: {exc}", exc) if active else None
            if live is not None and active:
                self._end_hold(live, now)  # Serve answered: the time held is given back
            try:
                if self._repair_drift(serve, now):
                    serve = self.serve.read()  # what the repair left
            except RolloutSystemError as exc:
                self._error(f"drift repair: {exc}")
                return self._hold(now, f"drift repair: {exc}", exc) if active else None
            live = self._live
            if live is None or not live.state.is_active:
                self._observe_idle(now)
                return None
            try:
                self.windows.observe()
            except MetricsUnavailable as exc:
                self._error(f"metrics: {exc}")
            observations = self._observe(live.state, now, serve)
            commands = tuple(self._commands)
            self._commands.clear()
            new_state, actions = machine.advance(
                live.state, dataclasses.replace(observations, commands=commands), now
            )
            try:
                self._act(actions, new_state)
            except TargetConflict as conflict:
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
                live.persist(self.registry)
            except RegistryUnavailable as exc:
                # The actions are done and the state is kept here; the next tick that reaches
                # the registry writes it (same expected version).
                self._error(f"persist: {exc}")
                return self._hold(now, f"registry unavailable: {exc}")
            return self.rollout_summary()

    def _observe_idle(self, now: float) -> None:
        """Between rollouts, a snapshot of the metrics every ``IDLE_OBSERVE_S``: the traffic
        the next start's estimate is made from."""
        if self._idle_observed_at is not None and now - self._idle_observed_at < IDLE_OBSERVE_S:
            return
        self._idle_observed_at = now
        try:
            self.windows.observe()
        except Exception as exc:  # between rollouts nothing depends on it yet
            self._error(f"metrics between rollouts: {exc}")

    def _hold(
        self, now: float, reason: str, error: Exception | None = None
    ) -> RolloutSummary | None:
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
        self._held_on_registry = isinstance(error, RegistryUnavailable)
        return self.rollout_summary()

    def _end_hold(self, live: LiveRollout, now: float) -> None:
        if self._held_since is None:
            return
        seconds = now - self._held_since
        self._held_since = None
        self._held_reason = None
        self._held_on_registry = False
        live.state = machine.held(live.state, seconds)
        self._event("resumed", f"registry and Serve reachable again after {seconds:.1f}s held")

    # ---------------------------------------------------------------- observe

    def _observe(self, state: RolloutState, now: float, serve: ServeState) -> Observations:
        canary = self._pool(serve, CANARY, now, since=self._canary_reports_since)
        stable = self._pool(serve, STABLE, now)
        window = None
        wanted = machine.next_window(state, now, self.evidence_interval_s)
        if wanted is not None:
            start, end = wanted
            # Only a window that starts where the weights changed waits for the metrics of the
            # old ones to arrive; the next one starts where the last judged window ended.
            delay = self.window_delay_s if machine.follows_weight_change(state, start) else 0.0
            # Not before the window is as long as the judge needs, the wait included.
            if end - (start + delay) >= machine.window_length_s(state, self.evidence_interval_s):
                try:
                    window = self.windows.window_between(start + delay, end)
                except MetricsUnavailable as exc:
                    self._error(f"metrics: {exc}")
                if window is not None and state.plan.custom_checks:
                    window = self._with_custom_checks(state, window)
            if window is not None:
                self.last_window = window
        return Observations(
            canary=canary,
            stable=stable,
            router_weights=serve.router_weights,
            router_shadow_bp=serve.router_shadow_bp,
            window=window,
            evidence_interval_s=self.evidence_interval_s,
            in_place_fits=in_place_fits(
                self.reports.reports_of(canary),
                self.reports.reports_of(stable),
                state.candidate_artifact_id,
            ),
        )

    def _with_custom_checks(self, state: RolloutState, window: WindowStats) -> WindowStats:
        """``window`` with the plan's custom checks read over it (unread, they hold the step:
        a counts check gains no evidence, a level check has no value)."""
        if self.custom_checks is None:
            return window
        try:
            read = self.custom_checks.read(state.plan.custom_checks, window.start, window.end)
        except MetricsUnavailable as exc:
            self._error(f"custom checks: {exc}")
            return window
        return dataclasses.replace(window, custom=read)

    def _pool(
        self, serve: ServeState, cohort: Cohort, now: float, since: float | None = None
    ) -> PoolView:
        deployment = serve.cohort(cohort)
        if deployment is None:
            return PoolView()
        return self.reports.pool(
            cohort,
            deployment.running,
            deployment.expected_replicas,
            now=now,
            stale_s=self.settings.report_stale_s,
            since=since,
        )

    # ---------------------------------------------------------------- act

    def _act(self, actions: Sequence[Action], state: RolloutState) -> None:
        """Carry the actions out in order. Serve changes are gathered and sent as one write
        until a weight change or a registry publish comes: what was gathered goes first.
        Audit records follow the writes before them."""
        reason = f"rollout {state.rollout_id}"
        pending = ServeChange()
        # An audit record says what the actions before it did: it is recorded once they are
        # done, so a write that fails leaves no record of it (the replay records it).
        audits: list[RecordAudit] = []

        def send() -> None:
            nonlocal pending
            if pending:
                self.serve.write(pending)
            pending = ServeChange()
            for audit in audits:
                self._event(audit.event, audit.message, key=audit.key)
            audits.clear()

        for action in actions:
            match action:
                case SetWeights(canary_bp=bp):
                    send()
                    self.serve.write(ServeChange(canary_bp=bp))
                    self._event("weights", f"canary {bp / 100:g}%", canary_bp=bp)
                case SetShadow():
                    send()
                    self.serve.write(ServeChange(shadow=routing_of(action)))
                    what = (
                        f"mirroring {action.fraction_bp / 100:g}% of stable's requests"
                        if action.fraction_bp
                        else "mirroring off"
                    )
                    self._event("shadow_routing", what)
                case SetCanaryTarget(artifact_id=None):
                    pending = pending.then(ServeChange(targets={CANARY: None}))
                case SetCanaryTarget(artifact_id=str(artifact_id)):
                    send()
                    target = self._publish_for_rollout(CANARY, artifact_id, reason)
                    if target is not None:
                        pending = pending.then(ServeChange(targets={CANARY: target.target()}))
                case SetStableTarget(artifact_id=artifact_id):
                    send()
                    target = self._publish_for_rollout(STABLE, artifact_id, reason)
                    if target is not None:
                        pending = pending.then(ServeChange(targets={STABLE: target.target()}))
                case ScaleCanary(replicas=n):
                    pending = pending.then(ServeChange(canary_replicas=n))
                case RecordAudit():
                    audits.append(action)
                case Alert(severity=severity, message=message):
                    self.alerts.append(f"{severity}: {message}")
                    log.warning("ALERT %s: %s", severity, message)
                case Finish(phase=phase, reason=why):
                    log.info("rollout %s finished: %s (%s)", state.rollout_id, phase.value, why)
        send()

    def _check_targets(self, live: LiveRollout) -> None:
        """Notice targets moved by another writer since this rollout last wrote them: abort
        (weights to stable first) and leave that cohort's target as the other writer set it."""
        if live.state.phase.is_terminal:
            return
        for reason in self.targets.moved_since(live.known, live.ours()):
            self._commands.appendleft(Abort(reason=reason))
            self._error(reason)

    def _publish_for_rollout(
        self, cohort: Cohort, artifact_id: str, reason: str
    ) -> TargetRecord | None:
        if cohort in self.targets.conflicted:
            self.alerts.append(
                f"warning: {cohort} target left as another writer set it (not {artifact_id})"
            )
            return None
        live = self._live
        assert live is not None
        target = self.targets.publish(
            cohort,
            artifact_id,
            actor=self.settings.actor,
            reason=reason,
            expected_revision=live.known.get(cohort),
        )
        live.known[cohort] = target.revision
        return target

    # ---------------------------------------------------------------- persistence

    def _event(
        self, event: str, message: str, *, key: str | None = None, canary_bp: int | None = None
    ) -> None:
        live = self._live
        if live is not None and live.record(
            event, message, at=self.clock(), key=key, canary_bp=canary_bp
        ):
            log.info("rollout %s: %s: %s", live.state.rollout_id, event, message)

    def _error(self, message: str) -> None:
        self.errors.append(message)
        log.warning("%s", message)

    # ================================================================== views

    def rollout_summary(self) -> RolloutSummary:
        live = self._live
        return rollout_summary(
            live.state if live is not None else None,
            live.events if live is not None else (),
            held_since=self._held_since,
            held_reason=self._held_reason,
            now=self.clock(),
        )

    def view(self) -> ControllerStatus:
        with self._lock:
            # Status is asked for exactly when something is down: show the rollout as the
            # controller holds it, and say that the registry cannot be read. While a tick's
            # hold says it is out of reach, status does not wait on it again (the next tick
            # finds out whether it is back).
            targets = None
            if self._held_since is None or not self._held_on_registry:
                try:
                    targets = [t.published() for t in self.targets.list_targets()]
                except RolloutSystemError as exc:
                    self._error(f"status: registry: {exc}")
            return controller_status(
                self.rollout_summary(),
                targets=targets,
                reports=self.reports.latest(),
                now=self.clock(),
                last_window=self.last_window,
                alerts=self.alerts,
                errors=self.errors,
                reports_refused=self.reports.refused,
            )
