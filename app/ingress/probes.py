"""What the router's status probes found, and how its probe loop is kept alive.

A probe asks a cohort's replicas for their ``InstanceReport`` through an injected ``ask``
(the Serve shell's handle call); ``probe_cohort`` turns the answers into a ``ProbeFinding``.
``ReplicaViews`` keeps each replica's last report for the status view, and
``ProbeLoopRestarts`` is the bookkeeping of a probe loop that died and is started again. No
Ray, no clock of its own: ``now`` comes from the caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ValidationError

from app.api import LoopView
from app.contracts import InstanceReport, clip_text
from app.supervised import restart_pause

log = logging.getLogger("ray.serve")

# A replica's probe answer is kept this many probe intervals before it is dropped from status.
REPLICA_VIEW_TTL_INTERVALS: Final = 30
# Replicas asked per probe: two, to see more replicas of a cohort than the one Serve picks.
ASKS_PER_PROBE: Final = 2
# A probe loop that died is started again after this long, doubled for every death in a row
# (no probe round completed in between) up to the maximum: a loop that dies on every round
# must neither spin nor flood the log.
PROBE_RESTART_DELAY_S: Final = 0.5
PROBE_RESTART_MAX_DELAY_S: Final = 10.0

# One status call to one replica of a cohort: its report as JSON (the shell's handle call).
AskStatus = Callable[[], Awaitable[Any]]


def probe_timeout_s(probe_interval_s: float) -> float:
    """How long one status call may take: twice the interval, within [0.5 s, 2 s]."""
    return max(0.5, min(2.0, 2 * probe_interval_s))


@dataclass(frozen=True)
class ProbeFinding:
    """One probe of a cohort: did any replica answer, does one serve a model, and what the
    answering replicas reported."""

    answered: bool
    serving: bool
    reports: tuple[InstanceReport, ...] = ()

    @property
    def evaluation(self) -> dict[str, float] | None:
        """The offline evaluation of the last serving replica's model (None: none serves)."""
        for report in reversed(self.reports):
            if report.serving:
                return dict(report.evaluation)
        return None


async def probe_cohort(cohort: str, ask: AskStatus, *, timeout_s: float) -> ProbeFinding:
    """Ask ``ASKS_PER_PROBE`` times; a call that fails or times out is no answer, a report
    that is not an ``InstanceReport`` neither (logged). A cancellation is not caught: it
    ends the probe loop, which is restarted (``ProbeLoopRestarts``)."""
    reports: list[InstanceReport] = []
    for _ in range(ASKS_PER_PROBE):
        try:
            raw = await asyncio.wait_for(ask(), timeout=timeout_s)
        except Exception:
            continue
        try:
            reports.append(InstanceReport.model_validate(raw))
        except ValidationError as exc:
            log.warning("a %s replica's report is not an InstanceReport: %s", cohort, exc)
    return ProbeFinding(
        answered=bool(reports),
        serving=any(report.serving for report in reports),
        reports=tuple(reports),
    )


@dataclass
class ReplicaViews:
    """Per replica id of one cohort: when its probe last answered, and its report."""

    seen: dict[str, tuple[float, InstanceReport]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seen)

    def record(self, finding: ProbeFinding, now: float, ttl_s: float) -> None:
        """Keep the answering replicas' reports; forget every replica when nobody answered,
        and each one not heard of for ``ttl_s``."""
        for report in finding.reports:
            self.seen[report.replica_id] = (now, report)
        if not finding.answered:
            self.seen.clear()
        for rid, (seen, _) in list(self.seen.items()):
            if now - seen > ttl_s:
                del self.seen[rid]

    def clear(self) -> None:
        self.seen.clear()

    def items(self) -> list[tuple[str, tuple[float, InstanceReport]]]:
        return sorted(self.seen.items())


@dataclass
class ProbeLoopRestarts:
    """A probe loop's deaths: shown in status, and how long to wait before the next start."""

    view: LoopView = field(default_factory=LoopView)
    died_at: float | None = None
    deaths_in_row: int = 0

    def died(self, why: str, now: float) -> float:
        """Record a death (``why``: "ExceptionType: message"); the seconds to wait before
        starting the loop again."""
        self.died_at = now
        self.view = LoopView(restarts=self.view.restarts + 1, last_error=clip_text(why))
        self.deaths_in_row += 1
        return restart_pause(self.deaths_in_row, PROBE_RESTART_DELAY_S, PROBE_RESTART_MAX_DELAY_S)

    def round_completed(self) -> None:
        self.deaths_in_row = 0

    def status(self, now: float) -> LoopView:
        if self.died_at is None:
            return self.view
        return self.view.model_copy(update={"last_error_s_ago": round(now - self.died_at, 3)})
