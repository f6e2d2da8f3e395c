"""The controller's report store: reports validated where they arrive, the latest per replica
by ``seq``, pools of RUNNING replicas with fresh reports, and what goes to the registry."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import pytest

from app.contracts import MAX_REVISION, InstanceReport, ReplicaPhase
from app.errors import RegistryUnavailable, RolloutSystemError
from app.registry import ReplicaReportRecord
from rollout.machine import ReplicaObservation
from rollout.reports import MAX_CLOCK_SKEW_S, ReportStore, registry_record

V41, V42 = "ranker-v41", "ranker-v42"


def report(replica_id: str = "c0", **fields: Any) -> dict[str, Any]:
    """A replica's report as it sends it: the contract's JSON dump."""
    values: dict[str, Any] = {
        "replica_id": replica_id,
        "cohort": "canary",
        "pid": 4242,
        "phase": "ready",
        "desired_revision": 2,
        "desired_artifact": V42,
        "actual_revision": 2,
        "actual_artifact": V42,
        "heartbeat": 1000.0,
        "seq": 1,
        **fields,
    }
    return InstanceReport.model_validate(values).model_dump(mode="json")


def test_an_invalid_report_is_dropped_with_one_log_line(caplog) -> None:
    store = ReportStore()
    with caplog.at_level(logging.WARNING, logger="rollout.reports"):
        assert store.receive({**report(), "phase": "dancing"}) is None
        assert store.receive({**report("c1"), "extra": 1}) is None
        assert store.receive({"nothing": "useful"}) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("dropped an invalid report from replica 'c0': phase: ")
    assert lines[1].startswith("dropped an invalid report from replica 'c1': extra: ")
    assert lines[2].startswith("dropped an invalid report from replica None: ")
    assert store.latest() == {}


def test_the_latest_report_by_seq_is_kept_and_a_late_one_dropped() -> None:
    store = ReportStore()
    kept = store.receive(report(seq=5, phase="loading"))
    assert isinstance(kept, InstanceReport) and kept.phase is ReplicaPhase.LOADING
    assert store.receive(report(seq=4, phase="failed")) is None  # delivered late
    assert store.latest()["c0"].phase is ReplicaPhase.LOADING
    assert store.receive(report(seq=5, phase="ready")) is not None  # the same seq again: kept
    store.receive(report(seq=6, phase="backoff"))
    assert store.latest()["c0"].phase is ReplicaPhase.BACKOFF


def test_a_pool_holds_the_fresh_reports_of_running_replicas_of_its_cohort() -> None:
    store = ReportStore()
    store.receive(report("c0", last_error={"category": "load", "message": "shape mismatch"}))
    store.receive(report("c1", heartbeat=900.0))  # 100 s old
    store.receive(report("c2"))  # not RUNNING (any more)
    store.receive(report("s0", cohort="stable", actual_artifact=V41, phase="loading"))

    pool = store.pool("canary", {"c0", "c1", "s0"}, 3, now=1010.0, stale_s=30)

    assert pool.expected == 3
    assert pool.replicas == (
        ReplicaObservation("c0", V42, V42, ReplicaPhase.READY, "load: shape mismatch"),
    )
    [stable] = store.pool("stable", {"s0"}, 1, now=1010.0, stale_s=30).replicas
    assert (stable.phase, stable.actual_artifact_id, stable.error) == (
        ReplicaPhase.LOADING,
        V41,
        None,
    )
    assert [r.replica_id for r in store.reports_of(pool)] == ["c0"]


class Recording:
    """A registry that records the reports upserted, or refuses with the queued errors."""

    def __init__(self) -> None:
        self.upserted: list[ReplicaReportRecord] = []
        self.errors: list[Exception] = []

    def upsert_replica_report(self, record: ReplicaReportRecord) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.upserted.append(record)


def test_reports_go_to_the_registry_when_they_change() -> None:
    store, registry, errors = ReportStore(), Recording(), []

    def persist() -> list[str]:
        before = len(registry.upserted)
        store.persist_changed(
            registry, model="ranker", environment="default", on_error=errors.append
        )  # type: ignore[arg-type]
        return [r.replica_id for r in registry.upserted[before:]]

    store.receive(report("c0", heartbeat=1000.0, seq=1))
    store.receive(report("u0", cohort=None, seq=1))  # no cohort yet: nothing to file it under
    assert persist() == ["c0"]
    store.receive(report("c0", heartbeat=1005.0, seq=2))  # a heartbeat within 10 s: not again
    assert persist() == []
    store.receive(report("c0", heartbeat=1011.0, seq=3))
    assert persist() == ["c0"]
    store.receive(report("c0", heartbeat=1012.0, seq=4, phase="failed"))
    registry.errors.append(RolloutSystemError("refused"))
    assert persist() == [] and errors == ["persist report of c0: refused"]
    assert persist() == ["c0"]  # retried on the next tick
    store.receive(report("c0", heartbeat=1013.0, seq=5, phase="loading"))
    registry.errors.append(RegistryUnavailable("down"))
    with pytest.raises(RegistryUnavailable):
        persist()


def test_the_registry_record_of_a_report() -> None:
    sent = report(
        "c0",
        heartbeat=1_764_400_000.5,
        last_error={"category": "dry_run", "message": "NaN in output", "revision": 2},
        timings={"download": 0.5, "verify": 0.25, "load": 1.0, "dry_run": 0.125},
        capacity={"max_batch_size": 32, "memory": {"resident_bytes": 10, "capacity_bytes": 99}},
    )
    record = registry_record(InstanceReport.model_validate(sent), model="m", environment="e")
    assert record == ReplicaReportRecord(
        replica_id="c0",
        model="m",
        environment="e",
        cohort="canary",
        state="ready",
        heartbeat_at=datetime.fromtimestamp(1_764_400_000.5, UTC),
        desired_revision=2,
        desired_artifact_id=V42,
        actual_revision=2,
        actual_artifact_id=V42,
        last_error="dry_run: NaN in output",
        capacity={
            "max_batch_size": 32,
            "device": "cpu",
            "memory": {
                "resident_bytes": 10,
                "capacity_bytes": 99,
                "load_peak_bytes": None,
                "backbone_bytes": 0,
            },
        },
        timings={"download": 0.5, "verify": 0.25, "load": 1.0, "dry_run": 0.125, "paced": 0.0},
    )


# ---------------------------------------------------------------------- malformed reports

NOW = 1_764_400_000.0  # the controller's clock in the tests below


def at(now: float = NOW) -> ReportStore:
    return ReportStore(clock=lambda: now)


def without(raw: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != key}


MALFORMED: dict[str, Any] = {
    "heartbeat 1e20": {**report(heartbeat=NOW), "heartbeat": 1e20},
    "heartbeat NaN": {**report(heartbeat=NOW), "heartbeat": float("nan")},
    "heartbeat inf": {**report(heartbeat=NOW), "heartbeat": float("inf")},
    "heartbeat a day ahead": report(heartbeat=NOW + 86_400),
    "heartbeat as text": {**report(heartbeat=NOW), "heartbeat": "soon"},
    "seq 2**60": {**report(heartbeat=NOW), "seq": 2**60},
    "seq NaN": {**report(heartbeat=NOW), "seq": float("nan")},
    "seq negative": {**report(heartbeat=NOW), "seq": -1},
    "no heartbeat": without(report(heartbeat=NOW), "heartbeat"),
    "no seq": without(report(heartbeat=NOW), "seq"),
    "no replica_id": without(report(heartbeat=NOW), "replica_id"),
    "not a mapping": ["c0", "ready"],
    "None": None,
}


@pytest.mark.parametrize("bad", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_report_is_refused_counted_and_the_next_good_one_kept(bad: Any) -> None:
    store = at()
    assert store.receive(report(heartbeat=NOW - 2, seq=7, phase="loading")) is not None

    assert store.receive(bad) is None

    assert store.refused == 1
    assert store.latest()["c0"].phase is ReplicaPhase.LOADING  # what was kept stays
    kept = store.receive(report(heartbeat=NOW - 1, seq=8, phase="ready"))
    assert kept is not None and store.latest()["c0"].phase is ReplicaPhase.READY
    assert store.refused == 1


def test_a_refusal_logs_one_bounded_line(caplog) -> None:
    store = at()
    with caplog.at_level(logging.WARNING, logger="rollout.reports"):
        assert store.receive({**report(heartbeat=NOW), "x" * 5_000_000: 1}) is None
        assert store.receive({**report(heartbeat=NOW), "replica_id": "r" * 5_000_000}) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(len(line) < 2000 for line in lines), [len(x) for x in lines]
    assert store.refused == 2
    assert store.last_refusal is not None and len(store.last_refusal) < 2000


def test_a_heartbeat_ahead_of_the_controller_clock_by_more_than_the_skew_is_refused() -> None:
    store = at()
    assert store.receive(report(heartbeat=NOW + MAX_CLOCK_SKEW_S, seq=1)) is not None
    assert store.receive(report(heartbeat=NOW + MAX_CLOCK_SKEW_S + 1, seq=2)) is None
    assert store.refused == 1 and store.latest()["c0"].seq == 1
    assert store.last_refusal is not None and "ahead" in store.last_refusal


def test_a_huge_seq_does_not_make_later_good_reports_late() -> None:
    store = at()
    assert store.receive(report(heartbeat=NOW - 10, seq=3, phase="loading")) is not None
    # Valid by the contract (the largest seq it allows) but not from this replica's counter.
    bogus = report(heartbeat=NOW - 9, seq=MAX_REVISION, phase="failed")
    assert store.receive(bogus) is not None

    good = store.receive(report(heartbeat=NOW - 8, seq=4, phase="ready"))

    assert good is not None and store.latest()["c0"].phase is ReplicaPhase.READY
    # A late delivery is still late: behind the kept report in seq and in heartbeat.
    assert store.receive(report(heartbeat=NOW - 10, seq=3, phase="loading")) is None
    assert store.late == 1 and store.refused == 0
    assert store.latest()["c0"].phase is ReplicaPhase.READY


def test_a_restarted_replica_starts_its_seq_again() -> None:
    store = at()
    old = {"incarnation": "first", "pid": 11}
    assert store.receive(report(heartbeat=NOW - 30, seq=500, phase="ready", **old)) is not None

    restarted = report(heartbeat=NOW - 20, seq=1, phase="loading", incarnation="second")
    assert store.receive(restarted) is not None
    assert store.latest()["c0"].incarnation == "second"

    # A report of the first process delivered late: a higher seq, but another incarnation's,
    # and an older heartbeat.
    assert store.receive(report(heartbeat=NOW - 25, seq=501, phase="failed", **old)) is None
    assert store.latest()["c0"].incarnation == "second"
    assert store.receive(report(heartbeat=NOW - 19, seq=2, incarnation="second")) is not None
    assert store.late == 1


def test_the_seq_orders_reports_of_one_incarnation_whatever_their_heartbeat() -> None:
    # The replica's clock stepped back (NTP): its seq still says which report is newer.
    store = at()
    assert store.receive(report(heartbeat=NOW - 5, seq=10, phase="loading")) is not None
    assert store.receive(report(heartbeat=NOW - 7, seq=11, phase="ready")) is not None
    assert store.latest()["c0"].phase is ReplicaPhase.READY


def test_one_report_the_registry_cannot_file_does_not_stop_the_others() -> None:
    class Picky(Recording):
        def upsert_replica_report(self, record: ReplicaReportRecord) -> None:
            if record.replica_id == "c0":
                raise OverflowError("timestamp out of range for the database")
            super().upsert_replica_report(record)

    store, registry, errors = at(), Picky(), []
    store.receive(report("c0", heartbeat=NOW))
    store.receive(report("c1", heartbeat=NOW))

    def persist() -> None:
        store.persist_changed(
            registry, model="ranker", environment="default", on_error=errors.append
        )  # type: ignore[arg-type]

    persist()

    assert [r.replica_id for r in registry.upserted] == ["c1"]
    assert errors == [
        "persist report of c0: OverflowError: timestamp out of range for the database"
    ]
    # The same report is not tried again every tick; a changed one is.
    persist()
    assert len(errors) == 1
    store.receive(report("c0", heartbeat=NOW, seq=2, phase="failed"))
    persist()
    assert len(errors) == 2


def test_a_mapping_that_cannot_be_read_is_refused() -> None:
    class Hostile(dict):  # type: ignore[type-arg]
        def get(self, *args: Any) -> Any:
            raise RuntimeError("no")

        def __getitem__(self, key: Any) -> Any:
            raise RuntimeError("no")

        def items(self) -> Any:
            raise RuntimeError("no")

        def keys(self) -> Any:
            raise RuntimeError("no")

        def __iter__(self) -> Any:
            raise RuntimeError("no")

    store = at()
    assert store.receive(Hostile(report(heartbeat=NOW))) is None
    assert store.refused == 1
