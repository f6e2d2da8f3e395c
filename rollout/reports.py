"""What the replicas last said about themselves, as the controller keeps it.

Replicas push ``app.contracts.InstanceReport`` (as its JSON dump) to the controller actor on
every change and every report interval. ``ReportStore`` validates each one where it arrives
(one that does not validate is dropped with one log line: the controller never acts on a
report it cannot read), keeps the latest per replica (a report with a lower ``seq`` than the
one kept is a late delivery and is dropped), and turns them into the state machine's
observations of a pool: only the replicas Serve still runs, only fresh reports.

Reports also go to the registry when they change, so ``rollout status`` and operators can see
them without the actor. And the store answers the one question the machine asks of their
figures: whether an in-place promotion fits (``in_place_fits``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import ValidationError

from app.contracts import Cohort, InstanceReport
from app.errors import RegistryUnavailable, RolloutSystemError
from app.registry import Registry, ReplicaReportRecord
from rollout.machine import PoolView, ReplicaObservation

log = logging.getLogger(__name__)

# A heartbeat alone (nothing else changed) is written to the registry at most this often.
HEARTBEAT_PERSIST_S: Final = 10


def describe_error(report: InstanceReport) -> str | None:
    return report.last_error.describe() if report.last_error is not None else None


class ReportStore:
    """The latest valid report of each replica. Safe to use from several threads: replicas
    report while a tick runs."""

    def __init__(self) -> None:
        self._latest: dict[str, InstanceReport] = {}
        self._lock = threading.Lock()
        self._persisted: dict[str, tuple[Any, ...]] = {}

    def receive(self, raw: Mapping[str, Any]) -> InstanceReport | None:
        """Keep ``raw`` (a report's JSON dump) if it is valid and not older than the one kept;
        the report kept, or None when it was dropped."""
        try:
            report = InstanceReport.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "report"
            sender = raw.get("replica_id") if isinstance(raw, Mapping) else None
            log.error(
                "dropped an invalid report from replica %r: %s: %s",
                sender,
                where,
                first.get("msg"),
            )
            return None
        with self._lock:
            previous = self._latest.get(report.replica_id)
            if previous is not None and previous.seq > report.seq:
                return None  # late delivery of an older report
            self._latest[report.replica_id] = report
        return report

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
    ) -> PoolView:
        """The machine's view of a cohort: the fresh reports of its RUNNING replicas."""
        observed = tuple(
            ReplicaObservation(
                replica_id=replica_id,
                desired_artifact_id=report.desired_artifact,
                actual_artifact_id=report.actual_artifact,
                phase=report.phase,
                error=describe_error(report),
            )
            for replica_id, report in self.latest().items()
            if replica_id in running
            and report.cohort == cohort
            and now - report.heartbeat <= stale_s
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
            if report.cohort is None:
                continue  # before its first user_config: nothing the registry could file
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
            self._persisted[replica_id] = fingerprint


def registry_record(report: InstanceReport, *, model: str, environment: str) -> ReplicaReportRecord:
    assert report.cohort is not None
    timings = report.timings.model_dump(mode="json", exclude_none=True)
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
    resident bytes, within that replica's capacity. None when a report lacks a figure (the
    machine then promotes by shift); the stable replicas re-check at load time all the same.
    """
    peaks = [r.capacity.memory.load_peak_bytes for r in canary if r.actual_artifact == candidate]
    if not peaks or not stable:
        return None
    needed = 0
    for peak in peaks:
        if peak is None:
            return None
        needed = max(needed, peak)
    for report in stable:
        memory = report.capacity.memory
        if memory.capacity_bytes is None:
            return None
        if memory.resident_bytes + needed > memory.capacity_bytes:
            return False
    return True
