"""What a replica tells others about itself: instance reports pushed to the rollout controller,
and hooks for its metrics.

The controller decides a rollout's next step from the replicas' reports, so a replica pushes
one whenever its state changes and every ``report_interval_s`` besides (a heartbeat: a report
that stops coming marks the replica stale). Reports go from a thread of their own, so a slow
or absent controller never holds up a request or a reconfigure.

Each reporter is one incarnation (``incarnation``, a random id): ``seq`` counts its reports
from 1, so the controller orders a replica's reports by seq within one incarnation only.

The reporter thread never dies silently: an error nothing expected (building the report
failed: a bug) restarts it after a short, growing pause, and the restart is logged, counted
(``restarts``) and kept (``last_crash``, category ``internal``) for the next report, which goes
out at once. A failing sink is expected (no controller yet, or it died) and only retried.

No Ray here: the sink (``deployments.ranker.ControllerSink``) and the metrics
(``deployments.ranker.ServeMetricsObserver``) are injected.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from app.contracts import ControllerRef, ErrorInfo, InstanceReport, clip_text
from app.supervised import log_crash, restart_pause, supervise

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
        self,
        name: str,
        build: Callable[[], InstanceReport],
        sink_factory: SinkFactory | None,
        *,
        on_crash: Callable[[ErrorInfo], None] | None = None,
    ) -> None:
        self._name = name
        self._build = build
        self._sink_factory = sink_factory
        self._on_crash = on_crash or (lambda crash: None)
        self.incarnation = uuid.uuid4().hex
        self._restarts = 0
        self._last_crash: ErrorInfo | None = None
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

    @property
    def restarts(self) -> int:
        """How often the thread died of an unexpected error and was restarted."""
        with self._cond:
            return self._restarts

    @property
    def last_crash(self) -> ErrorInfo | None:
        with self._cond:
            return self._last_crash

    def configure(self, controller: ControllerRef | None, interval_s: float) -> None:
        with self._cond:
            if controller != self._controller:
                self._sink = None
            self._controller = controller
            self._interval = interval_s
            wanted = controller is not None and self._sink_factory is not None
            if wanted and self._thread is None:
                self._thread = threading.Thread(
                    target=self._supervise, name=f"reporter-{self._name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def poke(self) -> None:
        """Something changed: send a report soon."""
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

    def _supervise(self) -> None:
        """The thread: ``_run`` until closed, started again whenever it dies of an error
        nothing expected."""
        supervise(self._run, on_crash=self._crashed, wait=self._wait_to_restart)

    def _wait_to_restart(self, pause: float) -> None:
        deadline = time.monotonic() + pause
        with self._cond:
            while not self._closed and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(timeout=left)
            self._dirty = True  # the next report says what happened

    def _crashed(self, exc: Exception) -> float:
        """Record and log a crash of the thread; the pause before its restart."""
        with self._cond:
            self._restarts += 1
            restarts = self._restarts
        pause = restart_pause(restarts)
        crash = ErrorInfo(
            category="internal",
            message=clip_text(
                f"the reporter-{self._name} thread died and was restarted ({restarts} so "
                f"far): {type(exc).__name__}: {exc}"
            ),
        )
        with self._cond:
            self._last_crash = crash
        log_crash(log, f"reporter-{self._name}: the thread", exc, pause, restarts)
        try:
            self._on_crash(crash)
        except Exception:  # an observer must never stop the restart
            log.exception("reporter-%s: crash observer failed", self._name)
        return pause

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
        # Outside the sink's try: a report that cannot be built is a bug, not an absent
        # controller, and goes to the supervisor (logged, counted, restarted).
        report = self._build()
        try:
            if self._sink is None:
                self._sink = factory(controller)
            self._sink.send(report)
        except Exception as exc:
            self._sink = None
            log.debug("report to controller %s failed (will retry): %s", controller.name, exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
