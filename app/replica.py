"""The ranker replica's logic; ``deployments/ranker.py`` is the thin Ray Serve shell around it.

This module is the replica's config handling and request path; loading is
``app.loading.pipeline`` (driven by ``app.reconciler``), reports and metric hooks are
``app.reporting``, test-only fault injection is ``app.faults``.

Lifecycle:

- ``reconfigure(user_config)`` validates the config. The replica's FIRST config is its startup:
  its target is loaded synchronously (a replica never becomes RUNNING without a verified
  model) and an invalid config or a failed load raises. Every later config returns at once
  and never raises: Ray routes no traffic to a replica while its reconfigure runs, and an
  exception from reconfigure makes Ray replace the replica, whose replacement would get the
  same config and fail the same way. A later target goes to the reconciler's background
  worker; a failed candidate never removes the serving generation. A later invalid config is
  refused: the old one stays and the report's ``last_error`` says why (category ``config``,
  naming the field). The same config again is a no-op (Ray repeats reconfigure on rank
  changes).
- A target that becomes null retires the serving generation (requests in flight finish on
  it): the pool is idle, serves nothing, and the router does not fail over to it.
- ``rank(batch)`` borrows the current generation for one forward; a request in flight
  finishes on the generation it borrowed while a new one is installed beside it.
- Fault injection (``faults`` in the user_config; tests only) takes effect only where the
  process environment allows it (``app.faults``); elsewhere it is ignored and reported as a
  ``config`` error.
- Reports go to the rollout controller's named actor when one is configured; with no
  controller the replica keeps serving and retries quietly. A background thread (the
  reconciler's worker, the reporter) that dies of an unexpected error is restarted; the
  report counts it (``thread_restarts``) and says why (``thread_crash``).
- No failure it reports, logs or raises shows a secret of a manifest URI (userinfo password,
  presigned query values): failures are redacted against the target's URI where they are
  turned into text (``app.reconciler.error_info``), and so are refused configs and a failed
  startup load (which Serve shows in its status).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from app.cache import NODE_CACHE_DIR_ENV, ArtifactCache, node_cache_dir
from app.contracts import (
    MAX_EVALUATION_ENTRIES,
    MAX_REPORTED_REVISIONS,
    Capacity,
    ErrorInfo,
    FetchConfig,
    InstanceReport,
    LoadProgress,
    LoadTimings,
    MemoryFigures,
    ModelMeta,
    ReplicaConfig,
    SignatureTrust,
    Target,
    WireAnswer,
    WireRequest,
    clip_text,
)
from app.errors import (
    ArtifactRejected,
    ConfigError,
    InjectedFault,
    NotReady,
    ReplicaNotReady,
    StartupLoadFailed,
)
from app.faults import (
    FAULT_INJECTION_ALLOWED,
    FAULT_INJECTION_ENV,
    FaultInjector,
    FaultPlan,
    fault_injection_allowed,
)
from app.generations import GenerationHolder
from app.loading.device import default_device
from app.loading.failures import clipped_error, safe_message
from app.loading.memory import MemoryBudget, device_capacity
from app.loading.model import LoadedModel
from app.loading.pipeline import Candidate, ModelLoader
from app.model_family import Families, RequestSchema, families_for
from app.reconciler import BackoffPolicy, ReconcileEvent, Reconciler, ReconcilerSnapshot
from app.reporting import NullObserver, ReplicaObserver, Reporter, SinkFactory
from app.safe_text import redact_in
from app.signing import load_trusted_key
from app.trust import TrustPolicy, anchors_digest

log = logging.getLogger(__name__)

# The cache's directory and budget, the trust settings, the fetch settings, and the digest of
# the anchor files' content (None: no anchors).
CacheKey = tuple[str, int | None, str | None, SignatureTrust, FetchConfig, str | None]


def uri_in(raw: Mapping[str, Any] | ReplicaConfig) -> str:
    """The manifest URI a user_config names, as far as it can be read (a refused config is
    not valid, so its parts are looked up by hand); "" when it names none."""
    if isinstance(raw, ReplicaConfig):
        return raw.target.manifest_uri if raw.target is not None else ""
    target = raw.get("target") if isinstance(raw, Mapping) else None
    uri = target.get("manifest_uri") if isinstance(target, Mapping) else None
    return uri if isinstance(uri, str) else ""


class RankerReplica:
    def __init__(
        self,
        replica_id: str,
        *,
        sink_factory: SinkFactory | None = None,
        observer: ReplicaObserver | None = None,
        device: torch.device | None = None,
        loader_nice: int = 10,
    ) -> None:
        self.replica_id = replica_id
        self._observer: ReplicaObserver = observer or NullObserver()
        self._device = device or default_device()
        self._config: ReplicaConfig | None = None
        self._cache: ArtifactCache | None = None
        self._cache_key: CacheKey | None = None
        # The trust anchors changed in place and could not be read: every load is refused
        # until they can (set and cleared by _refresh_trust).
        self._trust_error: ErrorInfo | None = None
        self._trust_lock = threading.Lock()
        # The holder's cleanup is the loader's, which knows each generation's cache lease.
        self._holder = GenerationHolder(
            cleanup=lambda generation: self._loader.clean_up(generation)
        )
        self._loader = ModelLoader(
            cache=self._get_cache,
            holder=self._holder,
            budget=lambda: MemoryBudget.of(self.config.memory),
            device=self._device,
            on_installed=self._installed,
            cpu_share=lambda: self.config.loading.cpu_share if self._background else None,
            loading=lambda: self.config.loading,
            serving=lambda: (self.families, self.config.feature_schema),
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
        self._reporter = Reporter(
            replica_id, self.report, sink_factory, on_crash=self._thread_crashed
        )
        # The last error that killed a background thread (which was then restarted).
        self._thread_crash: ErrorInfo | None = None
        # Which error is newer, a load failure or a config problem (for ``last_error``).
        self._error_seq = itertools.count(1)  # next() is atomic: event and config threads
        self._load_error_seq = 0
        self._config_error: ErrorInfo | None = None
        self._config_error_seq = 0
        self._faults = FaultInjector()  # the faults in effect: allowed ones only

    # ------------------------------------------------------------------ config

    @property
    def config(self) -> ReplicaConfig:
        if self._config is None:
            raise ReplicaNotReady("replica has no user_config yet")
        return self._config

    @property
    def families(self) -> Families:
        """The model families the current config registers."""
        return families_for(self.config.models)

    @property
    def schema(self) -> RequestSchema:
        """The request schema this replica serves (its direct HTTP ingress parses with it)."""
        return self.families.schema(self.config.feature_schema)

    @staticmethod
    def _check_families(cfg: ReplicaConfig) -> None:
        """ConfigError naming ``user_config.models[i]`` or ``user_config.feature_schema``."""
        families = Families.from_paths(cfg.models, where="user_config.models")
        try:
            families.schema(cfg.feature_schema)
        except ConfigError as exc:
            raise ConfigError(f"user_config.{exc}", field="user_config.feature_schema") from None

    @staticmethod
    def _check_schema_change(cfg: ReplicaConfig) -> None:
        """A config that changes the served schema must bring a target of that schema: the
        same target would stay loaded (nothing reloads for an unchanged target) and serve
        requests of a schema it cannot read. (A new target of a foreign schema under an
        unchanged schema is a failed load, reported as such.)"""
        if cfg.target is not None and cfg.target.feature_schema != cfg.feature_schema:
            raise ConfigError(
                f"user_config.feature_schema: {cfg.feature_schema!r}, but the target is "
                f"{cfg.target.artifact_id} of {cfg.target.feature_schema!r} "
                "(user_config.target.feature_schema)",
                field="user_config.feature_schema",
            )

    @property
    def has_config(self) -> bool:
        """False until the first (startup) config was applied."""
        return self._config is not None

    @staticmethod
    def _cache_key_of(cfg: ReplicaConfig) -> CacheKey:
        """What the cache and its trust policy are built from: the config's fields, and the
        content of the anchor files it names (read now: a key replaced in place is a new
        policy; ConfigError naming the field when one cannot be read)."""
        return (
            node_cache_dir(cfg.cache_dir),
            cfg.cache_byte_budget,
            cfg.trust_key,
            cfg.trust,
            cfg.loading.fetch,
            anchors_digest(cfg.signature_trust, field="user_config.trust"),
        )

    def _cache_for(self, cfg: ReplicaConfig) -> ArtifactCache:
        """The cache ``cfg`` names, opened now so that a directory that is not a cache or a
        trust anchor that cannot be read refuses the config (ConfigError naming the field)
        instead of failing the next load."""
        if cfg.trust_key is not None:
            # The shorthand is named as such when its key cannot be used.
            try:
                load_trusted_key(Path(cfg.trust_key))
            except ConfigError as exc:
                raise ConfigError(
                    f"user_config.trust_key: {exc}", field="user_config.trust_key"
                ) from exc
        if self._cache is not None and self._cache_key == self._cache_key_of(cfg):
            return self._cache
        trust = TrustPolicy.of(cfg.signature_trust, field="user_config.trust")
        try:
            return ArtifactCache(
                Path(node_cache_dir(cfg.cache_dir)),
                byte_budget=cfg.cache_byte_budget,
                trust=trust,
                fetch=cfg.loading.fetch,
            )
        except ConfigError as exc:
            # The cache names its directory's errors; the policy was built above. A node's own
            # directory is named as such: the config's is not the one that failed.
            where = (
                f"{NODE_CACHE_DIR_ENV} (this node's, over user_config.cache_dir)"
                if os.environ.get(NODE_CACHE_DIR_ENV)
                else "user_config.cache_dir"
            )
            raise ConfigError(f"{where}: {exc}", field="user_config.cache_dir") from exc

    def _get_cache(self) -> ArtifactCache:
        """The cache of every load, its trust policy as the anchor files say now."""
        if self._cache is None:  # not reached: a config is applied only with its cache
            raise ReplicaNotReady("replica has no user_config yet")
        self._refresh_trust()
        if self._trust_error is not None:
            raise ArtifactRejected("signature", self._trust_error.message)
        cache = self._cache
        assert cache is not None
        return cache

    def _refresh_trust(self) -> None:
        """Build the cache's trust policy again when the anchor files changed in place since
        it was built (a mounted ConfigMap updated, a key replaced to revoke the old one),
        checked before every load and with every report. Anchors that cannot be read now
        refuse every load (``_trust_error``) until they can: a key removed to revoke it must
        not stay trusted. The model serving stays."""
        with self._trust_lock:
            cfg, key = self._config, self._cache_key
            if cfg is None or key is None or key[-1] is None:
                return  # nothing applied yet, or no anchors: nothing to re-read
            try:
                now = self._cache_key_of(cfg)
                if now != key:
                    self._cache = self._cache_for(cfg)
                    self._cache_key = now
                    log.warning(
                        "%s: trust anchors changed in place (%s -> %s): policy built again",
                        self.replica_id, key[-1][:16], (now[-1] or "")[:16],
                    )  # fmt: skip
                    self._reporter.poke()
            except ConfigError as exc:
                if self._trust_error is None:
                    log.error("%s: trust anchors unreadable: %s", self.replica_id, exc)
                    self._reporter.poke()
                self._trust_error = clipped_error(
                    "signature",
                    f"the trust anchors cannot be read now ({exc}); no artifact is trusted "
                    "until they can (the model serving stays)",
                    field="user_config.trust",
                )
                return
            if self._trust_error is not None:
                self._trust_error = None
                self._reporter.poke()

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
            self._check_families(new)
            if old is not None and new.feature_schema != old.feature_schema:
                self._check_schema_change(new)
            cache = self._cache_for(new)
        except ConfigError as exc:
            if old is None:
                raise  # startup: Serve reports the deployment as failed, nothing serves yet
            why = clip_text(redact_in(str(exc), uri_in(raw)))
            log.error("%s: user_config refused, keeping the current one: %s", self.replica_id, why)
            self._set_config_error(
                f"user_config refused, the previous one stays: {why}",
                field=str(exc.ids.get("field") or "user_config"),
            )
            return False
        self._apply_faults(new)
        if new == old:
            return False
        self._cache, self._cache_key = cache, self._cache_key_of(new)
        self._config = new
        self._reconciler.set_policy(BackoffPolicy.of(new.retry))
        target = new.target
        if target is not None:
            if old is None:
                # Startup: no RUNNING replica without a verified model.
                self._load_at_startup(target)
            else:
                # A running replica (serving or idle) loads in the background; a failure is
                # reported, never raised (it would kill the replica).
                self._reconciler.submit(target)
        elif old is not None and self._reconciler.clear():
            log.warning(
                "%s: target removed from user_config; the serving generation is retired",
                self.replica_id,
            )
        self._background = True
        self._reporter.configure(new.controller, new.report_interval_s)
        self._reporter.poke()
        return True

    def _load_at_startup(self, target: Target) -> None:
        """Load the first target in this thread; a failure is raised, redacted and cut."""
        try:
            self._reconciler.load_blocking(target)
        except Exception as exc:
            shown = str(exc)
            safe = clip_text(safe_message(shown, target))
            if safe == shown:
                raise
            category = getattr(exc, "category", None)
            log.error("%s: the startup load failed: %s", self.replica_id, safe)
            # Not chained: the original's message is what must not be shown.
            raise StartupLoadFailed(
                category if isinstance(category, str) else type(exc).__name__, safe
            ) from None

    def _apply_faults(self, config: ReplicaConfig) -> None:
        """Faults take effect only where the environment allows them; otherwise they are
        ignored and reported. A valid config without ignored faults clears config errors."""
        faults = config.faults
        if faults is not None and not fault_injection_allowed():
            self._faults.set(None)
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
        if self._faults.set(faults):
            self._reporter.poke()
        if self._config_error is not None:
            self._config_error = None
            self._reporter.poke()

    def _set_config_error(self, message: str, *, field: str) -> None:
        self._config_error = clipped_error("config", message, field=field)
        self._config_error_seq = next(self._error_seq)
        self._reporter.poke()

    def plan_fault(self) -> FaultPlan:
        """Fault injection for one rank call (the shell sleeps and raises, without blocking
        other calls). NO_FAULT unless allowed faults are configured."""
        return self._faults.plan()

    def injected_fault(self) -> InjectedFault:
        return InjectedFault(f"{self.replica_id}: injected rank failure (faults.error_rate)")

    # ------------------------------------------------------------------ serving

    def rank(self, batch: Sequence[WireRequest]) -> WireAnswer:
        """One forward for a batch of validated requests on one borrowed generation."""
        cohort = self.config.cohort
        try:
            with self._holder.borrow() as gen:
                model: LoadedModel = gen.model
                try:
                    results = model.rank_batch(batch)
                except RuntimeError as exc:
                    if "CUDA" in str(exc) or "cuda" in str(exc):
                        self._fatal = exc  # unrecoverable device fault: check_health fails
                    raise
                backbone = model.backbone
                meta = ModelMeta(
                    gen.artifact_id,
                    gen.revision,
                    cohort,
                    model.runtime_build,
                    self.replica_id,
                    backbone.artifact_id if backbone is not None else None,
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

    def report(self) -> InstanceReport:
        self._refresh_trust()
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
            actual_backbone=_backbone_of(model),
            trust_anchors=self._cache_key[-1] if self._cache_key is not None else None,
            runtime_build=getattr(model, "runtime_build", None),
            last_error=self._latest_error(snap.last_error),
            discarded_revisions=snap.discarded[-MAX_REPORTED_REVISIONS:],
            cancelled_revisions=snap.cancelled[-MAX_REPORTED_REVISIONS:],
            timings=self._timings,
            progress=_progress(snap),
            installed_at=self._installed_at if current is not None else None,
            capacity=Capacity(
                max_batch_size=cfg.batching.max_batch_size if cfg else None,
                device=str(self._device),
                memory=self._memory_figures(model, cfg),
            ),
            heartbeat=time.time(),
            seq=self._reporter.next_seq(),
            incarnation=self._reporter.incarnation,
            thread_restarts=snap.worker_restarts + self._reporter.restarts,
            thread_crash=self._thread_crash,
            config_error=self._config_error,
            faults=self._faults.active,
            evaluation=(
                model.manifest.offline_evaluation(MAX_EVALUATION_ENTRIES)
                if isinstance(model, LoadedModel)
                else {}
            ),
        )

    def _latest_error(self, load_error: ErrorInfo | None) -> ErrorInfo | None:
        """Anchors that cannot be read (every load refused), else the newer of the last load
        failure and the current config's problem."""
        if self._trust_error is not None:
            return self._trust_error
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
        backbone = getattr(model, "backbone", None)
        return MemoryFigures(
            resident_bytes=resident,
            capacity_bytes=capacity,
            load_peak_bytes=None if estimate is None else estimate.single_buffer_peak,
            backbone_bytes=int(getattr(backbone, "nbytes", 0)),
        )

    def _installed(self, candidate: Candidate) -> None:
        self._installed_at = time.time()
        self._timings = candidate.timings
        for stage, seconds in candidate.timings.model_dump(exclude_none=True).items():
            self._observer.load_stage(stage, seconds, True)

    def _thread_crashed(self, crash: ErrorInfo) -> None:
        self._thread_crash = crash

    def _on_event(self, event: ReconcileEvent) -> None:
        if event.kind == "worker_restarted":
            self._thread_crash = event.error
        elif event.kind == "installed" and event.duration_s is not None:
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

    def close(self) -> None:
        self._reporter.close()
        self._reconciler.close()
        self._holder.close()


def _progress(snap: ReconcilerSnapshot) -> LoadProgress | None:
    if snap.progress is None or snap.loading is None:
        return None
    p = snap.progress
    return LoadProgress(
        revision=snap.loading.revision,
        artifact_id=snap.loading.artifact_id,
        stage=p.stage,
        done_bytes=p.done_bytes,
        total_bytes=p.total_bytes,
        elapsed_s=max(0.0, p.elapsed_s),
    )


def _backbone_of(model: object) -> str | None:
    backbone = getattr(model, "backbone", None)
    return getattr(backbone, "artifact_id", None)
