"""What every task declares: its name, its HTTP route, the measures a candidate's answer is
compared with stable's by, and the offline metric the standby's accuracy guard reads.

A task is what a family's answers are *for* (ranking candidates, classifying texts, scoring
items, embedding them); the family defines the model and its request schema, the task the
shape of the answer, the checks every answer of a dry run must pass, and how two answers to
the same request are compared (shadow traffic, ``rollout replay``, the shadow judge). The
rollout machinery (artifacts, generations, cohorts, the controller, the judges of errors and
latency) does not depend on the task.

Pure module: numpy and the standard library only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from app.errors import ArtifactRejected

# The tasks a family may declare. Streaming generation ("generate") answers with a stream of
# tokens rather than one array per request; it gets its name once its answer and comparison
# are defined.
TaskName = Literal["rank", "classify", "score", "embed"]
TASK_NAMES: Final[tuple[str, ...]] = ("rank", "classify", "score", "embed")


def refuse_where(mask: np.ndarray, message: Callable[[tuple[int, ...], int], str]) -> None:
    """A dry-run check: ArtifactRejected("dry_run") when ``mask`` holds anywhere, worded by
    ``message(index of the first place it holds, how many places do)``."""
    hits = np.argwhere(mask)
    if len(hits):
        first = tuple(int(i) for i in hits[0])
        raise ArtifactRejected("dry_run", message(first, len(hits)))


@dataclass(frozen=True)
class Measure:
    """One figure by which a candidate's answer to a request is compared with stable's answer
    to the same request. A tally's figure is the mean over the requests compared."""

    name: str
    meaning: str
    # Its value for two identical answers, and for two answers that have nothing in common:
    # a figure closer to ``identical`` is closer agreement.
    identical: float
    disjoint: float

    def agreement(self, value: float) -> float:
        """``value`` on a common scale: 1 for identical answers, 0 for disjoint ones."""
        span = self.identical - self.disjoint
        return min(1.0, max(0.0, (value - self.disjoint) / span))


@dataclass
class MeasureTotals:
    """Comparisons of one task added up: how many requests were compared and the sum of each
    measure over them."""

    measures: tuple[Measure, ...]
    compared: int = 0
    sums: dict[str, float] | None = None

    def add(self, values: Mapping[str, float]) -> None:
        names = {m.name for m in self.measures}
        if set(values) != names:
            raise ValueError(f"measures {sorted(values)}, expected {sorted(names)}")
        if not all(math.isfinite(v) for v in values.values()):
            raise ValueError(f"a measure is not finite: {dict(values)}")
        sums = self.sums if self.sums is not None else dict.fromkeys(names, 0.0)
        for name, value in values.items():
            sums[name] += float(value)
        self.sums = sums
        self.compared += 1

    def means(self) -> dict[str, float | None]:
        """Each measure's mean (None before the first comparison)."""
        return {
            m.name: (self.sums[m.name] / self.compared if self.sums and self.compared else None)
            for m in self.measures
        }


class Task(ABC):
    """A task's declaration. Subclasses are immutable singletons (``app.tasks.RANK`` ...)."""

    name: TaskName
    # The HTTP route its families answer on, below the application's route prefix.
    route: str
    # The measures of ``compare``, the first being the one a shadow gate and a status line
    # lead with.
    measures: tuple[Measure, ...]
    # The offline evaluation metric (a manifest's ``metadata.offline_evaluation`` key) the
    # router's standby guard compares a fallback with stable by, unless configured.
    standby_metric: str

    @abstractmethod
    def compare(self, stable: Any, candidate: Any) -> dict[str, float]:
        """Both answers to one request -> each measure's value for it."""

    @property
    def primary(self) -> Measure:
        return self.measures[0]

    def totals(self) -> MeasureTotals:
        return MeasureTotals(self.measures)

    def compare_all(self, pairs: Sequence[tuple[Any, Any]]) -> MeasureTotals:
        """The comparisons of many requests, added up."""
        totals = self.totals()
        for stable, candidate in pairs:
            totals.add(self.compare(stable, candidate))
        return totals

    def __repr__(self) -> str:
        return f"Task({self.name!r}, route={self.route!r})"
