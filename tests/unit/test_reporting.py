"""The replica's reporter thread (app.reporting) with a fake sink: no Ray."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from app.contracts import ControllerRef, ErrorInfo, InstanceReport, ReplicaPhase
from app.polling import wait_until
from app.reporting import Reporter

CONTROLLER = ControllerRef(name="rollout-controller")
WAIT_S = 10.0
QUIET_S = 3600.0  # an interval no test waits out: every send below comes from a poke


class Sinks:
    """A sink factory whose sinks record reports; ``fail`` makes the next sends raise."""

    def __init__(self) -> None:
        self.made: list[ControllerRef] = []
        self.sent: list[InstanceReport] = []
        self.fail = 0
        self.lock = threading.Lock()

    def __call__(self, controller: ControllerRef) -> Sinks:
        with self.lock:
            self.made.append(controller)
        return self

    def send(self, report: InstanceReport) -> None:
        with self.lock:
            if self.fail:
                self.fail -= 1
                raise ConnectionError("controller gone")
            self.sent.append(report)


@pytest.fixture
def sinks() -> Sinks:
    return Sinks()


@pytest.fixture
def reporter(sinks: Sinks) -> Iterator[Reporter]:
    holder: list[Reporter] = []

    def build() -> InstanceReport:
        return InstanceReport(
            replica_id="r1",
            cohort="stable",
            pid=1,
            phase=ReplicaPhase.READY,
            heartbeat=1.0,
            seq=holder[0].next_seq(),
        )

    r = Reporter("r1", build, sinks)
    holder.append(r)
    yield r
    r.close()


def test_a_poke_sends_a_report_with_a_growing_seq(reporter: Reporter, sinks: Sinks) -> None:
    reporter.configure(CONTROLLER, QUIET_S)
    reporter.poke()
    wait_until(lambda: len(sinks.sent) >= 1, WAIT_S, "the first report")
    reporter.poke()
    wait_until(lambda: len(sinks.sent) >= 2, WAIT_S, "the second report")
    seqs = [r.seq for r in sinks.sent]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert sinks.made == [CONTROLLER]  # one sink while it works


def test_a_failed_send_looks_the_controller_up_again(reporter: Reporter, sinks: Sinks) -> None:
    sinks.fail = 1
    reporter.configure(CONTROLLER, QUIET_S)
    reporter.poke()
    wait_until(lambda: len(sinks.made) >= 1, WAIT_S, "the first lookup")
    reporter.poke()
    wait_until(lambda: len(sinks.sent) >= 1, WAIT_S, "a report after the failure")
    assert len(sinks.made) == 2  # the failed sink was dropped and a new one made


def test_nothing_is_sent_without_a_controller(reporter: Reporter, sinks: Sinks) -> None:
    reporter.configure(None, 0.01)
    reporter.poke()
    assert reporter._thread is None  # no thread to send anything
    assert sinks.made == [] and sinks.sent == []


class Flaky:
    """Builds reports; ``fail`` makes the next build raise an error nothing expects."""

    def __init__(self) -> None:
        self.fail = threading.Event()
        self.reporter: Reporter | None = None

    def __call__(self) -> InstanceReport:
        if self.fail.is_set():
            self.fail.clear()
            raise RuntimeError("a bug in the report")
        reporter = self.reporter
        assert reporter is not None
        return InstanceReport(
            replica_id="r1",
            cohort="stable",
            pid=1,
            phase=ReplicaPhase.READY,
            heartbeat=1.0,
            seq=reporter.next_seq(),
            incarnation=reporter.incarnation,
            thread_restarts=reporter.restarts,
            thread_crash=reporter.last_crash,
        )


def test_a_reporter_thread_killed_by_an_unexpected_error_is_restarted_and_says_so(
    sinks: Sinks, caplog
) -> None:
    build = Flaky()
    crashes: list[ErrorInfo] = []
    reporter = Reporter("r1", build, sinks, on_crash=crashes.append)
    build.reporter = reporter
    reporter.configure(CONTROLLER, QUIET_S)
    reporter.poke()
    wait_until(lambda: len(sinks.sent) >= 1, WAIT_S, "the first report")

    with caplog.at_level(logging.ERROR, logger="app.reporting"):
        build.fail.set()
        reporter.poke()
        # After the restart the reporter sends at once, without another poke: the report
        # that says it crashed.
        wait_until(lambda: len(sinks.sent) >= 2, WAIT_S, "a report after the restart")

    after = sinks.sent[-1]
    assert after.thread_restarts == 1 and reporter.restarts == 1
    assert after.thread_crash is not None and after.thread_crash.category == "internal"
    assert "RuntimeError: a bug in the report" in after.thread_crash.message
    assert crashes == [after.thread_crash]
    [line] = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert "reporter-r1" in line and "a bug in the report" in line
    alive = [t for t in threading.enumerate() if t.name == "reporter-r1" and t.is_alive()]
    assert len(alive) == 1
    assert after.seq > sinks.sent[0].seq and after.incarnation == sinks.sent[0].incarnation
    reporter.close()


def test_each_reporter_is_its_own_incarnation() -> None:
    first, second = Reporter("r1", Flaky(), None), Reporter("r1", Flaky(), None)
    assert first.incarnation != second.incarnation
    assert first.next_seq() == second.next_seq() == 1
