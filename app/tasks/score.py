"""The ``score`` task: each item of a request gets one number (a predicted rating, a
probability of a click, a risk score) within bounds the family declares.

Dry-run checks: one finite score per item, each within the declared bounds. Two answers are
compared by the mean relative difference of their scores: ``|a - b| / max(|a|, |b|)`` per
item (0 where both are 0), averaged over the request's items, 0 for identical scores and at
most 1 for scores of one sign (2 for opposite signs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from app.errors import ArtifactRejected
from app.tasks.base import Measure, Task, TaskName, refuse_where

SCORE_ROUTE: Final = "/v1/score"


@dataclass(frozen=True)
class ScoreBounds:
    """The closed interval a family's scores lie in (e.g. [0, 1] for a probability)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.low) and np.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"score bounds must be finite with low < high: {self}")


def check_scores(scores: np.ndarray, *, items: int, bounds: ScoreBounds) -> None:
    """``scores`` is a valid answer for ``items`` items: shape ``[items]``, finite, within
    ``bounds``. ArtifactRejected("dry_run") names the first rule broken and where."""
    if scores.ndim != 1 or len(scores) != items:
        raise ArtifactRejected(
            "dry_run", f"scores of shape {tuple(scores.shape)}, expected ({items},)"
        )
    values = scores.astype(np.float64, copy=False)
    refuse_where(
        ~np.isfinite(values),
        lambda at, n: f"{n} of {items} scores are not finite (first: item {at[0]})",
    )
    refuse_where(
        (values < bounds.low) | (values > bounds.high),
        lambda at, n: (
            f"score {values[at]:.6g} of item {at[0]} outside "
            f"[{bounds.low:g}, {bounds.high:g}] ({n} of {items} items)"
        ),
    )


def relative_differences(stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per item, ``|a - b| / max(|a|, |b|)``; 0 where both are 0."""
    if stable.shape != candidate.shape:
        raise ValueError(f"shapes {stable.shape} and {candidate.shape} differ")
    a, b = stable.astype(np.float64), candidate.astype(np.float64)
    scale = np.maximum(np.abs(a), np.abs(b))
    gap = np.abs(a - b)
    return np.divide(gap, scale, out=np.zeros_like(gap), where=scale > 0)


class ScoreTask(Task):
    name: TaskName = "score"
    route = SCORE_ROUTE
    measures = (Measure("relative_diff", "mean |a - b| / max(|a|, |b|) over the items", 0.0, 1.0),)
    standby_metric = "mae"

    def compare(self, stable: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
        if stable.ndim != 1 or not len(stable):
            raise ValueError(f"one score per item: shape {stable.shape}")
        return {"relative_diff": float(np.mean(relative_differences(stable, candidate)))}


SCORE: Final = ScoreTask()
