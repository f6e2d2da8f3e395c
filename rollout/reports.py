"""What the replicas last said about themselves, as the controller keeps it.

Replicas push ``app.contracts.InstanceReport`` (as its JSON dump) to the controller actor on
every change and every report interval. ``ReportStore`` validates each one where it arrives
and keeps the latest per replica; one report can never stop the controller's ticks:

- a report that does not validate, or whose heartbeat is more than ``MAX_CLOCK_SKEW_S`` ahead
  of the controller's clock (it would count as fresh long after the replica went quiet), is
  refused: one bounded log line, and counted (``refused``, ``last_refusal``);
- a report older than the one kept is a late delivery and is dropped (counted: ``late``).
  Reports of one incarnation of a replica (``InstanceReport.incarnation``, else its pid) are
  ordered by ``seq``; a report whose seq went backwards still wins when its heartbeat is newer,
  so one bogus huge seq cannot make every later report late (and a replica whose counter
  restarted under the same incarnation id is followed). Reports of another incarnation (a
  restarted replica counts its seq from 1 again) are ordered by heartbeat alone.

The store then turns the reports into the state machine's observations of a pool: only the
replicas Serve still runs, only fresh reports.

Reports also go to the registry when they change, so ``rollout status`` and operators can see
them without the actor; a report the registry cannot file is reported and skipped, the others
are still written. And the store answers the one question the machine asks of their figures:
whether an in-place promotion fits (``in_place_fits``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import ValidationError

from app.contracts import COHORTS, Cohort, InstanceReport, clip_text
from app.errors import RegistryUnavailable, RolloutSystemError
from app.registry import Registry, ReplicaReportRecord
from rollout.machine import PoolView, ReplicaObservation

log = logging.getLogger(__name__)

# A heartbeat alone (nothing else changed) is written to the registry at most this often.
HEARTBEAT_PERSIST_S: Final = 10
# How far a replica's clock may run ahead of the controller's. A heartbeat further ahead is
# refused: it would keep a silent replica fresh, and (with a bogus seq) hold off that
# replica's true reports, until the controller's clock caught up.
MAX_CLOCK_SKEW_S: Final = 60.0
# Characters of a refused report's field path or sender shown in a log line or the status.
SHOWN_CHARS: Final = 200


def describe_error(report: InstanceReport) -> str | None:
    return report.last_error.describe() if report.last_error is not None else None


class ReportStore:
    """The latest valid report of each replica. Safe to use from several threads: replicas
    report while a tick runs."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._latest: dict[str, InstanceReport] = {}
        self._lock = threading.Lock()
        self._persisted: dict[str, tuple[Any, ...]] = {}
        self._refused = 0
        self._late = 0
        self._last_refusal: str | None = None

    @property
    def refused(self) -> int:
        """Reports refused since the store was made (invalid, or a heartbeat too far ahead)."""
        with self._lock:
            return self._refused

    @property
    def late(self) -> int:
        """Reports dropped as late deliveries (older than the one kept)."""
        with self._lock:
            return self._late

    @property
    def last_refusal(self) -> str | None:
        """Why the last refused report was refused (bounded text), None if none was."""
        with self._lock:
            return self._last_refusal

    def receive(self, raw: Any) -> InstanceReport | None:
        """Keep ``raw`` (a report's JSON dump) if it is valid and not older than the one kept;
        the report kept, or None when it was refused or dropped as late. Never raises: the
        report comes from outside the controller."""
        try:
            report = InstanceReport.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "report"
            self._refuse(raw, f"{clip_text(where, SHOWN_CHARS)}: {first.get('msg')}")
            return None
        except Exception as exc:  # foreign input: a mapping that raises, ...
            self._refuse(raw, f"unreadable: {type(exc).__name__}")
            return None
        ahead = report.heartbeat - self._clock()
        if ahead > MAX_CLOCK_SKEW_S:
            self._refuse(
                raw,
                f"heartbeat: {ahead:.0f} s ahead of the controller's clock "
                f"(at most {MAX_CLOCK_SKEW_S:.0f} s of clock skew)",
            )
            return None
        with self._lock:
            previous = self._latest.get(report.replica_id)
            if previous is not None and is_older(report, previous):
                self._late += 1
                return None
            self._latest[report.replica_id] = report
        return report

    def _refuse(self, raw: Any, why: str) -> None:
        try:
            sender = raw.get("replica_id") if isinstance(raw, Mapping) else None
            shown = clip_text(repr(sender), SHOWN_CHARS)
        except Exception:  # the same foreign mapping that could not be read
            shown = "(unreadable)"
        why = clip_text(why, 2 * SHOWN_CHARS)
        with self._lock:
            self._refused += 1
            self._last_refusal = f"refused a report from replica {shown}: {why}"
        log.error("dropped an invalid report from replica %s: %s", shown, why)

    def latest(self) -> dict[str, InstanceReport]:
        with self._lock:
            return dict(self._latest)

    def pool(
        self,
        cohort: Cohort,
        running: Collection[str],
        expected: int,
        *,
        now: float,
        stale_s: float,
        since: float | None = None,
    ) -> PoolView:
        """The machine's view of a cohort: the fresh reports of its RUNNING replicas (sent at
        or after ``since``, when given: older ones may describe a replica since changed)."""
        observed = tuple(
            ReplicaObservation(
                replica_id=replica_id,
                desired_artifact_id=report.desired_artifact,
                actual_artifact_id=report.actual_artifact,
                phase=report.phase,
                error=describe_error(report),
                actual_backbone_id=report.actual_backbone,
            )
            for replica_id, report in self.latest().items()
            if replica_id in running
            and report.cohort == cohort
            and now - report.heartbeat <= stale_s
            and (since is None or report.heartbeat >= since)
        )
        return PoolView(replicas=observed, expected=expected)

    def reports_of(self, pool: PoolView) -> list[InstanceReport]:
        latest = self.latest()
        return [latest[r.replica_id] for r in pool.replicas if r.replica_id in latest]

    def persist_changed(
        self,
        registry: Registry,
        *,
        model: str,
        environment: str,
        on_error: Callable[[str], None],
    ) -> None:
        """Upsert the reports that changed since they were last written (a heartbeat alone
        at most every ``HEARTBEAT_PERSIST_S``). RegistryUnavailable stops at the first: the
        next would wait out the same timeout. Other refusals are reported and skipped."""
        for replica_id, report in self.latest().items():
            if report.cohort not in COHORTS:
                # None: before its first user_config, nothing the registry could file. The
                # fallback has no registry target: its reports are kept here (status shows
                # them), not filed.
                continue
            fingerprint = (
                report.phase,
                report.desired_revision,
                report.actual_revision,
                describe_error(report),
                int(report.heartbeat // HEARTBEAT_PERSIST_S),
            )
            if self._persisted.get(replica_id) == fingerprint:
                continue
            try:
                registry.upsert_replica_report(
                    registry_record(report, model=model, environment=environment)
                )
            except RegistryUnavailable:
                raise
            except RolloutSystemError as exc:
                on_error(f"persist report of {replica_id}: {exc}")
                continue
            except Exception as exc:  # one report must not stop the tick
                log.exception("persist report of %s failed", replica_id)
                on_error(f"persist report of {replica_id}: {type(exc).__name__}: {exc}")
                # Not retried until the report changes (a heartbeat does every
                # HEARTBEAT_PERSIST_S): the same report would fail the same way every tick.
            self._persisted[replica_id] = fingerprint


def is_older(report: InstanceReport, kept: InstanceReport) -> bool:
    """Whether ``report`` is a late delivery, older than the ``kept`` one of its replica.

    Within one incarnation seq counts reports, so a lower seq is older, unless the heartbeat
    is newer: a seq that went backwards with time moving on is a counter that started again
    (or a bogus one kept before), and waiting for the seq to catch up would ignore the replica
    for good. Across incarnations (a restart counts from 1 again) only the heartbeat orders.
    """
    if incarnation_of(report) != incarnation_of(kept):
        return report.heartbeat < kept.heartbeat
    return report.seq < kept.seq and report.heartbeat <= kept.heartbeat


def incarnation_of(report: InstanceReport) -> str:
    return report.incarnation if report.incarnation is not None else f"pid:{report.pid}"


def registry_record(report: InstanceReport, *, model: str, environment: str) -> ReplicaReportRecord:
    assert report.cohort is not None
    # The record's timings are seconds by stage; the byte counts stay in the live report.
    timings = report.timings.model_dump(
        mode="json",
        exclude_none=True,
        exclude={"fetched_bytes", "loaded_bytes", "backbone_loaded_bytes"},
    )
    return ReplicaReportRecord(
        replica_id=report.replica_id,
        model=model,
        environment=environment,
        cohort=report.cohort,
        state=report.phase.value,
        heartbeat_at=datetime.fromtimestamp(report.heartbeat, UTC),
        desired_revision=report.desired_revision,
        desired_artifact_id=report.desired_artifact,
        actual_revision=report.actual_revision,
        actual_artifact_id=report.actual_artifact,
        last_error=describe_error(report),
        capacity=report.capacity.model_dump(mode="json"),
        timings={k: float(v) for k, v in timings.items()},
    )


def in_place_fits(
    canary: Sequence[InstanceReport], stable: Sequence[InstanceReport], candidate: str
) -> bool | None:
    """Whether every stable replica can load ``candidate`` beside the model it serves, from
    the replicas' own reports: what loading the candidate alone took on a canary replica (its
    load's estimate: weights, load temporaries, warm-up, margin) plus each stable replica's
    resident bytes, within that replica's capacity. A head candidate's load took its head
    alone (its backbone was resident): a stable replica that runs on the same backbone needs
    that, one on another backbone (or a whole model) the backbone's bytes as well. None when
    a report lacks a figure (the machine then promotes by shift); the stable replicas
    re-check at load time all the same.
    """
    loads = [r for r in canary if r.actual_artifact == candidate]
    if not loads or not stable:
        return None
    peak = 0
    backbone: str | None = None
    backbone_bytes = 0
    for report in loads:
        memory = report.capacity.memory
        if memory.load_peak_bytes is None:
            return None
        peak = max(peak, memory.load_peak_bytes)
        backbone = report.actual_backbone
        backbone_bytes = max(backbone_bytes, memory.backbone_bytes)
    for report in stable:
        memory = report.capacity.memory
        if memory.capacity_bytes is None:
            return None
        shared = backbone is not None and report.actual_backbone == backbone
        needed = peak + (0 if shared else backbone_bytes)
        if memory.resident_bytes + needed > memory.capacity_bytes:
            return False
    return True
