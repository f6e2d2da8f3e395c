"""The replica's reporter thread (app.reporting) with a fake sink: no Ray."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from app.contracts import ControllerRef, InstanceReport, ReplicaPhase
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
