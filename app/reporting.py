"""What a replica tells others about itself: instance reports pushed to the rollout controller,
and hooks for its metrics.

The controller decides a rollout's next step from the replicas' reports, so a replica pushes
one whenever its state changes and every ``report_interval_s`` besides (a heartbeat: a report
that stops coming marks the replica stale). Reports go from a thread of their own, so a slow
or absent controller never holds up a request or a reconfigure.

No Ray here: the sink (``deployments.ranker.ControllerSink``) and the metrics
(``deployments.ranker.ServeMetricsObserver``) are injected.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from app.contracts import ControllerRef, InstanceReport

log = logging.getLogger(__name__)


class ReportSink(Protocol):
    """Where reports go (the controller actor); ``send`` may raise when it is absent."""

    def send(self, report: InstanceReport) -> None: ...


SinkFactory = Callable[[ControllerRef], ReportSink]


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


class Reporter:
    """Pushes ``build()`` on change (``poke``) and every interval, from its own thread.

    The thread starts when a controller is first configured (and a sink factory was given).
    An absent controller (no actor yet, or it died) costs one failed lookup per interval and
    a debug log line; serving is never affected.
    """

    def __init__(
        self, name: str, build: Callable[[], InstanceReport], sink_factory: SinkFactory | None
    ) -> None:
        self._name = name
        self._build = build
        self._sink_factory = sink_factory
        self._cond = threading.Condition()
        self._dirty = False
        self._closed = False
        self._interval = 10.0
        self._controller: ControllerRef | None = None
        self._sink: ReportSink | None = None
        self._seq = 0
        self._thread: threading.Thread | None = None

    def next_seq(self) -> int:
        """The next report's sequence number (grows with every report built)."""
        with self._cond:
            self._seq += 1
            return self._seq

    def configure(self, controller: ControllerRef | None, interval_s: float) -> None:
        with self._cond:
            if controller != self._controller:
                self._sink = None
            self._controller = controller
            self._interval = interval_s
            wanted = controller is not None and self._sink_factory is not None
            if wanted and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"reporter-{self._name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def poke(self) -> None:
        """Something changed: send a report soon."""
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
            if controller is not None:
                self._send_once(controller)

    def _send_once(self, controller: ControllerRef) -> None:
        factory = self._sink_factory
        if factory is None:
            return
        try:
            if self._sink is None:
                self._sink = factory(controller)
            self._sink.send(self._build())
        except Exception as exc:
            self._sink = None
            log.debug("report to controller %s failed (will retry): %s", controller.name, exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
