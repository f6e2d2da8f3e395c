"""The ranker replica's logic; ``deployments/ranker.py`` is the thin Ray Serve shell around it.

Lifecycle (DESIGN.md "Replica"):

- ``reconfigure(user_config)`` validates the config. The replica's FIRST config is its startup:
  its target is loaded synchronously (a replica never becomes RUNNING without a verified
  model) and an invalid config or a failed load raises. Every later config returns at once
  and never raises: Ray routes no traffic to a replica while its reconfigure runs, and a
  raising reconfigure kills the replica and its replacements (RAY_FACTS.md). A later target
  goes to the reconciler's background worker; a failed candidate never removes the serving
  generation. A later invalid config is refused: the old one stays and the report's
  ``last_error`` says why (category ``config``, naming the field). The same config again is a
  no-op (Ray repeats reconfigure on rank changes).
- A target that becomes null retires the serving generation (requests in flight finish on
  it): the pool is idle, serves nothing, and the router does not fail over to it.
- ``rank(batch)`` borrows the current generation for one forward; a request in flight
  finishes on the generation it borrowed while a new one is installed beside it.
- Fault injection (``faults`` in the user_config; tests only) takes effect only in a process
  whose environment has ``ROLLOUT_FAULT_INJECTION=allow``; elsewhere it is ignored and
  reported as a ``config`` error.
- Reports go to the rollout controller's named actor when one is configured; with no
  controller the replica keeps serving and retries quietly.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import torch

from app.cache import ArtifactCache, Lease
from app.contracts import (
    MAX_REPORTED_REVISIONS,
    Capacity,
    ControllerRef,
    ErrorInfo,
    FaultInjection,
    InstanceReport,
    LoadTimings,
    MemoryFigures,
    ModelMeta,
    ReplicaConfig,
    ReplicaPhase,
    Target,
    WireAnswer,
    WireRequest,
)
from app.errors import ArtifactRejected, ConfigError
from app.features import FEATURE_SCHEMA, RankRequest
from app.generations import Generation, GenerationHolder, NotReady
from app.load_pacing import LoadPacer
from app.loader import LoadedModel, default_device, load_verified
from app.memory import MemoryBudget, device_capacity
from app.reconciler import BackoffPolicy, ReconcileEvent, Reconciler, ReconcilerSnapshot

log = logging.getLogger(__name__)

# Fault injection is honoured only where the replica's process environment says so.
FAULT_INJECTION_ENV: Final = "ROLLOUT_FAULT_INJECTION"
FAULT_INJECTION_ALLOWED: Final = "allow"


def fault_injection_allowed() -> bool:
    return os.environ.get(FAULT_INJECTION_ENV) == FAULT_INJECTION_ALLOWED


# --------------------------------------------------------------------------- reports


class ReportSink(Protocol):
    """Where reports go (the controller actor); ``send`` may raise when it is absent."""

    def send(self, report: InstanceReport) -> None: ...


class ReplicaObserver(Protocol):
    """Metrics hooks; the Ray shell implements them with ``ray.serve.metrics``."""

    def load_stage(self, stage: str, seconds: float, ok: bool) -> None: ...

    def revisions(self, desired: int | None, actual: int | None) -> None: ...

    def load_failure(self, category: str) -> None: ...

    def batch_size(self, requests: int) -> None: ...


class NullObserver:
    def load_stage(self, stage: str, seconds: float, ok: bool) -> None:
        pass

    def revisions(self, desired: int | None, actual: int | None) -> None:
        pass

    def load_failure(self, category: str) -> None:
        pass

    def batch_size(self, requests: int) -> None:
        pass


class ReplicaNotReady(RuntimeError):
    """No verified model is installed (an idle pool, or still starting)."""

    category = "serving.not_ready"


class InjectedFault(RuntimeError):
    """A rank call failed on purpose (``faults.error_rate``; tests only)."""

    category = "fault_injection"


@dataclass(frozen=True)
class FaultPlan:
    """What fault injection does to one rank call: wait ``delay_s``, then fail or not."""

    delay_s: float = 0.0
    fail: bool = False


NO_FAULT: Final = FaultPlan()


# --------------------------------------------------------------------------- loading


@dataclass
class Candidate:
    """A loaded, dry-run-validated model that is not serving yet."""

    target: Target
    model: LoadedModel
    lease: Lease
    timings: LoadTimings
    handed_over: bool = False  # given to the generation holder, which owns its cleanup


def _close_candidate(model: Any, lease: Lease | None) -> None:
    try:
        model.close()
    finally:
        if lease is not None:
            lease.release()


class ModelLoader:
    """The reconciler's load/install/discard steps for real artifacts and the holder."""

    def __init__(
        self,
        *,
        cache: Callable[[], ArtifactCache],
        holder: GenerationHolder,
        leases: dict[int, Lease],
        budget: Callable[[], MemoryBudget],
        device: torch.device,
        on_installed: Callable[[Candidate], None],
        cpu_share: Callable[[], float | None] = lambda: None,
    ) -> None:
        self._on_installed = on_installed
        self._cpu_share = cpu_share  # None: an unpaced load
        self._cache = cache
        self._holder = holder
        self._leases = leases
        self._budget = budget
        self._device = device

    def load(self, target: Target) -> Candidate:
        if target.feature_schema != FEATURE_SCHEMA:
            raise ArtifactRejected(
                "schema",
                f"target feature_schema {target.feature_schema!r}; this service speaks "
                f"{FEATURE_SCHEMA!r}",
                artifact_id=target.artifact_id,
            )
        cache = self._cache()
        share = self._cpu_share()
        pacer = LoadPacer(share) if share is not None else None  # a share of 1 never pauses
        lease = cache.lease(target.manifest_sha256)
        try:
            artifact = cache.fetch_verified(
                target.manifest_uri, target.manifest_sha256, pacer=pacer
            )
            if artifact.manifest.artifact_id != target.artifact_id:
                raise ArtifactRejected(
                    "manifest_digest",
                    f"manifest names artifact {artifact.manifest.artifact_id!r}, the target "
                    f"says {target.artifact_id!r}",
                    artifact_id=target.artifact_id,
                )
            if artifact.manifest.feature_schema != target.feature_schema:
                raise ArtifactRejected(
                    "schema",
                    f"manifest feature_schema {artifact.manifest.feature_schema!r} differs "
                    f"from the target's {target.feature_schema!r}",
                    artifact_id=target.artifact_id,
                )
            current = self._holder.current
            resident = int(getattr(current.model, "param_bytes", 0)) if current else 0
            model = load_verified(
                artifact,
                device=self._device,
                budget=self._budget(),
                resident_bytes=resident,
                pacer=pacer,
            )
        except BaseException:
            lease.release()
            raise
        timings = LoadTimings(
            download=float(artifact.timings.get("fetch_s", 0.0)),
            verify=float(
                artifact.timings.get("verify_s", 0.0) + artifact.timings.get("publish_s", 0.0)
            ),
            load=float(model.timings.get("load", 0.0)),
            dry_run=float(model.timings.get("dry_run", 0.0)),
            paced=pacer.paused_s if pacer is not None else 0.0,
        )
        return Candidate(target, model, lease, timings)

    def install(self, target: Target, loaded: Candidate) -> bool:
        started = time.perf_counter()
        self._holder.set_desired(target.revision, target.artifact_id)
        generation = Generation(
            revision=target.revision, artifact_id=target.artifact_id, model=loaded.model
        )
        # The lease is released by the holder's cleanup when this generation retires.
        self._leases[id(loaded.model)] = loaded.lease
        loaded.handed_over = True
        if not self._holder.install(generation):
            # The holder cleaned the refused generation up (model closed, lease released).
            return False
        loaded.timings = loaded.timings.model_copy(
            update={"install": time.perf_counter() - started}
        )
        self._on_installed(loaded)
        return True

    def discard(self, loaded: Candidate) -> None:
        if not loaded.handed_over:
            _close_candidate(loaded.model, loaded.lease)

    def retire(self) -> None:
        # The holder's cleanup (model closed, lease released) runs when borrowers are done.
        self._holder.retire_current()


# --------------------------------------------------------------------------- the replica


class RankerReplica:
    def __init__(
        self,
        replica_id: str,
        *,
        sink_factory: Callable[[ControllerRef], ReportSink] | None = None,
        observer: ReplicaObserver | None = None,
        device: torch.device | None = None,
        loader_nice: int = 10,
    ) -> None:
        self.replica_id = replica_id
        self._sink_factory = sink_factory
        self._observer: ReplicaObserver = observer or NullObserver()
        self._device = device or default_device()
        self._config: ReplicaConfig | None = None
        self._cache: ArtifactCache | None = None
        self._cache_key: tuple[str, int | None, str | None] | None = None
        self._leases: dict[int, Lease] = {}
        self._holder = GenerationHolder(cleanup=self._retire)
        self._loader = ModelLoader(
            cache=self._get_cache,
            holder=self._holder,
            leases=self._leases,
            budget=lambda: MemoryBudget.of(self.config.memory),
            device=self._device,
            on_installed=self._installed,
            cpu_share=lambda: self.config.loading.cpu_share if self._background else None,
        )
        self._reconciler: Reconciler[Candidate] = Reconciler(
            self._loader,
            on_event=self._on_event,
            name=f"reconciler-{replica_id}",
            worker_nice=loader_nice,
        )
        self._timings = LoadTimings()
        self._installed_at: float | None = None
        # False until the first config was applied: the startup load runs unpaced.
        self._background = False
        self._fatal: BaseException | None = None
        self._reporter = _Reporter(self)
        self.runtime_build: str | None = None
        # Which error is newer, a load failure or a config problem (for ``last_error``).
        self._error_seq = itertools.count(1)  # next() is atomic: event and config threads
        self._load_error_seq = 0
        self._config_error: ErrorInfo | None = None
        self._config_error_seq = 0
        self._faults: FaultInjection | None = None  # effective (allowed) faults
        self._fault_rng = random.Random()

    # ------------------------------------------------------------------ config

    @property
    def config(self) -> ReplicaConfig:
        if self._config is None:
            raise ReplicaNotReady("replica has no user_config yet")
        return self._config

    @property
    def has_config(self) -> bool:
        """False until the first (startup) config was applied."""
        return self._config is not None

    def _get_cache(self) -> ArtifactCache:
        cfg = self.config
        key = (cfg.cache_dir, cfg.cache_byte_budget, cfg.trust_key)
        if self._cache is None or self._cache_key != key:
            self._cache = ArtifactCache(
                Path(cfg.cache_dir), byte_budget=cfg.cache_byte_budget, trust_key=cfg.trust_key
            )
            self._cache_key = key
        return self._cache

    def reconfigure(self, raw: Mapping[str, Any] | ReplicaConfig) -> bool:
        """Apply a user_config; returns False when it was not applied: equal to the current
        one (no-op) or refused (the current one stays; see ``report().last_error``).

        Raises only at startup (the replica's first config): for an invalid config or a
        failed first load. Never afterwards.
        """
        old = self._config
        try:
            new = ReplicaConfig.from_user_config(raw)
            if old is not None and new.cohort != old.cohort:
                raise ConfigError(
                    f"user_config.cohort: a replica cannot move from {old.cohort!r} to "
                    f"{new.cohort!r}",
                    field="user_config.cohort",
                )
        except ConfigError as exc:
            if old is None:
                raise  # startup: Serve reports the deployment as failed, nothing serves yet
            log.error("%s: user_config refused, keeping the current one: %s", self.replica_id, exc)
            self._set_config_error(
                f"user_config refused, the previous one stays: {exc}",
                field=str(exc.ids.get("field") or "user_config"),
            )
            return False
        self._apply_faults(new)
        if new == old:
            return False
        self._config = new
        self._reconciler.set_policy(BackoffPolicy.of(new.retry))
        target = new.target
        if target is not None:
            if old is None:
                # Startup: no RUNNING replica without a verified model.
                self._reconciler.load_blocking(target)
            else:
                # A running replica (serving or idle) loads in the background; a failure is
                # reported, never raised (it would kill the replica).
                self._reconciler.submit(target)
        elif old is not None and self._reconciler.clear():
            log.warning(
                "%s: target removed from user_config; the serving generation is retired",
                self.replica_id,
            )
            self.runtime_build = None
        self._background = True
        self._reporter.configure(new)
        self._reporter.poke()
        return True

    def _apply_faults(self, config: ReplicaConfig) -> None:
        """Faults take effect only where the environment allows them; otherwise they are
        ignored and reported. A valid config without ignored faults clears config errors."""
        faults = config.faults
        if faults is not None and not fault_injection_allowed():
            self._faults = None
            log.warning(
                "%s: user_config.faults ignored: %s=%s is not set in this process",
                self.replica_id,
                FAULT_INJECTION_ENV,
                FAULT_INJECTION_ALLOWED,
            )
            self._set_config_error(
                f"user_config.faults ignored: fault injection needs "
                f"{FAULT_INJECTION_ENV}={FAULT_INJECTION_ALLOWED} in the replica's environment",
                field="user_config.faults",
            )
            return
        if faults is not None:
            log.warning("%s: fault injection active: %s", self.replica_id, faults)
        if faults != self._faults:
            self._faults = faults
            self._reporter.poke()
        if self._config_error is not None:
            self._config_error = None
            self._reporter.poke()

    def _set_config_error(self, message: str, *, field: str) -> None:
        self._config_error = ErrorInfo.clipped("config", message, field=field)
        self._config_error_seq = next(self._error_seq)
        self._reporter.poke()

    def plan_fault(self) -> FaultPlan:
        """Fault injection for one rank call (the shell sleeps and raises, without blocking
        other calls). NO_FAULT unless allowed faults are configured."""
        faults = self._faults
        if faults is None:
            return NO_FAULT
        fail = faults.error_rate > 0 and self._fault_rng.random() < faults.error_rate
        return FaultPlan(delay_s=faults.extra_latency_ms / 1000.0, fail=fail)

    def injected_fault(self) -> InjectedFault:
        return InjectedFault(f"{self.replica_id}: injected rank failure (faults.error_rate)")

    # ------------------------------------------------------------------ serving

    def rank(self, batch: Sequence[WireRequest]) -> WireAnswer:
        """One forward for a batch of validated requests on one borrowed generation."""
        cohort = self.config.cohort
        try:
            with self._holder.borrow() as gen:
                model: LoadedModel = gen.model
                requests = [
                    RankRequest(
                        candidate_ids=w.candidate_ids,
                        features=w.features,  # type: ignore[arg-type]  # ndarray rows
                        context=w.context,
                        top_n=w.top_n,
                    )
                    for w in batch
                ]
                try:
                    results = model.rank_batch(requests)
                except RuntimeError as exc:
                    if "CUDA" in str(exc) or "cuda" in str(exc):
                        self._fatal = exc  # unrecoverable device fault: check_health fails
                    raise
                meta = ModelMeta(
                    gen.artifact_id, gen.revision, cohort, model.runtime_build, self.replica_id
                )
        except NotReady as exc:
            raise ReplicaNotReady(f"{self.replica_id}: {exc}") from None
        self._observer.batch_size(len(batch))
        return WireAnswer(meta, [[(c.id, c.score, c.label) for c in ranked] for ranked in results])

    def check_health(self) -> None:
        """Fails only for unrecoverable runtime faults, never for a failed candidate."""
        if self._fatal is not None:
            raise RuntimeError(f"unrecoverable runtime fault: {self._fatal}")

    # ------------------------------------------------------------------ reports

    def snapshot(self) -> ReconcilerSnapshot:
        return self._reconciler.snapshot()

    def report(self) -> InstanceReport:
        snap = self._reconciler.snapshot()
        cfg = self._config
        current = self._holder.current
        model = current.model if current is not None else None
        return InstanceReport(
            replica_id=self.replica_id,
            cohort=cfg.cohort if cfg else None,
            pid=os.getpid(),
            phase=snap.phase,
            desired_revision=snap.desired.revision if snap.desired else None,
            desired_artifact=snap.desired.artifact_id if snap.desired else None,
            actual_revision=current.revision if current else None,
            actual_artifact=current.artifact_id if current else None,
            runtime_build=getattr(model, "runtime_build", None),
            last_error=self._latest_error(snap.last_error),
            discarded_revisions=snap.discarded[-MAX_REPORTED_REVISIONS:],
            timings=self._timings,
            installed_at=self._installed_at if current is not None else None,
            capacity=Capacity(
                max_batch_size=cfg.batching.max_batch_size if cfg else None,
                device=str(self._device),
                memory=self._memory_figures(model, cfg),
            ),
            heartbeat=time.time(),
            seq=self._reporter.next_seq(),
            config_error=self._config_error,
            faults=self._faults,
        )

    def _latest_error(self, load_error: ErrorInfo | None) -> ErrorInfo | None:
        """The newer of the last load failure and the current config's problem."""
        config_error = self._config_error
        newer = self._config_error_seq > self._load_error_seq
        if config_error is not None and (load_error is None or newer):
            return config_error
        return load_error

    def _memory_figures(self, model: Any, cfg: ReplicaConfig | None) -> MemoryFigures:
        """What the controller needs to tell whether a candidate fits beside the resident
        model here (an in-place promotion)."""
        resident = int(getattr(model, "param_bytes", 0)) if model is not None else 0
        capacity = cfg.memory.capacity_bytes if cfg is not None else None
        if capacity is None:
            capacity = device_capacity(self._device, resident)
        estimate = getattr(model, "memory", None)
        return MemoryFigures(
            resident_bytes=resident,
            capacity_bytes=capacity,
            load_peak_bytes=None if estimate is None else estimate.single_buffer_peak,
        )

    def _installed(self, candidate: Candidate) -> None:
        self._installed_at = time.time()
        self._timings = candidate.timings
        self.runtime_build = candidate.model.runtime_build
        for stage, seconds in candidate.timings.model_dump(exclude_none=True).items():
            self._observer.load_stage(stage, seconds, True)

    def _on_event(self, event: ReconcileEvent) -> None:
        if event.kind == "installed" and event.duration_s is not None:
            self._observer.load_stage("total", event.duration_s, True)
        elif event.kind in ("failed", "retry_scheduled") and event.error is not None:
            self._load_error_seq = next(self._error_seq)
            self._observer.load_failure(event.error.category)
        snap = self._reconciler.snapshot()
        self._observer.revisions(
            snap.desired.revision if snap.desired else None,
            snap.actual.revision if snap.actual else None,
        )
        self._reporter.poke()

    def _retire(self, generation: Generation) -> None:
        model = generation.model
        _close_candidate(model, self._leases.pop(id(model), None))

    def close(self) -> None:
        self._reporter.close()
        self._reconciler.close()
        self._holder.close()

    @property
    def phase(self) -> ReplicaPhase:
        return self._reconciler.snapshot().phase


class _Reporter:
    """Pushes reports on change and every ``report_interval_s`` from its own thread.

    An absent controller (no actor yet, or it died) costs one failed lookup per interval and
    a debug log line; serving is never affected.
    """

    def __init__(self, replica: RankerReplica) -> None:
        self._replica = replica
        self._cond = threading.Condition()
        self._dirty = False
        self._closed = False
        self._interval = 10.0
        self._controller: ControllerRef | None = None
        self._sink: ReportSink | None = None
        self._seq = 0
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failed = 0

    def next_seq(self) -> int:
        with self._cond:
            self._seq += 1
            return self._seq

    def configure(self, cfg: ReplicaConfig) -> None:
        with self._cond:
            if cfg.controller != self._controller:
                self._sink = None
            self._controller = cfg.controller
            self._interval = cfg.report_interval_s
            wanted = self._controller is not None and self._replica._sink_factory is not None
            if wanted and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"reporter-{self._replica.replica_id}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def poke(self) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._dirty and not self._closed:
                    self._cond.wait(timeout=self._interval)
                if self._closed:
                    return
                self._dirty = False
                controller = self._controller
            if controller is None:
                continue
            self._send_once(controller)

    def _send_once(self, controller: ControllerRef) -> None:
        factory = self._replica._sink_factory
        if factory is None:
            return
        try:
            if self._sink is None:
                self._sink = factory(controller)
            self._sink.send(self._replica.report())
            self.sent += 1
        except Exception as exc:
            self._sink = None
            self.failed += 1
            log.debug("report to controller %s failed (will retry): %s", controller.name, exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
