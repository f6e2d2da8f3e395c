"""The ``classify`` task: each input of a request (a text, for the text classifier) gets a
probability per label of the artifact's label map and the most probable label.

Dry-run checks: one row of probabilities per input and one column per label, every value
finite and in [0, 1], each row summing to 1 (within the compute dtype's rounding). Two
answers are compared by label agreement (the share of inputs given the same label) and the
total-variation distance of their probabilities (half the sum of the absolute differences,
0 for identical distributions, 1 for disjoint ones), averaged over the request's inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

from app.errors import ArtifactRejected
from app.tasks.base import Measure, Task, TaskName, refuse_where

CLASSIFY_ROUTE: Final = "/v1/classify"
# How far from 1 a row of float32 probabilities may sum (a softmax over a few thousand labels
# rounds to about 1e-6; half precision to about 1e-3).
DEFAULT_SUM_TOLERANCE: Final = 1e-3


def check_probabilities(
    probabilities: np.ndarray,
    labels: Sequence[str],
    *,
    inputs: int,
    tol: float = DEFAULT_SUM_TOLERANCE,
) -> None:
    """``probabilities`` is a valid answer for ``inputs`` inputs over ``labels``: shape
    ``[inputs, len(labels)]``, finite, each in [0, 1], each row summing to 1 within ``tol``.
    ArtifactRejected("dry_run") names the first rule broken and where."""
    if not labels or len(set(labels)) != len(labels):
        raise ArtifactRejected("dry_run", f"the label map must name distinct labels: {labels}")
    expected = (inputs, len(labels))
    if probabilities.ndim != 2 or tuple(probabilities.shape) != expected:
        raise ArtifactRejected(
            "dry_run", f"probabilities of shape {tuple(probabilities.shape)}, expected {expected}"
        )
    values = probabilities.astype(np.float64, copy=False)
    refuse_where(
        ~np.isfinite(values),
        lambda at, n: f"{n} probabilities are not finite (first: input {at[0]}, {labels[at[1]]!r})",
    )
    refuse_where(
        (values < 0.0) | (values > 1.0),
        lambda at, _: (
            f"probability {values[at]:.6g} outside [0, 1] (input {at[0]}, {labels[at[1]]!r})"
        ),
    )
    sums = values.sum(axis=1)
    refuse_where(
        np.abs(sums - 1.0) > tol,
        lambda at, n: (
            f"the probabilities of input {at[0]} sum to {sums[at]:.6g}, not 1 "
            f"(tol {tol:g}); {n} of {inputs} inputs are off"
        ),
    )


def predicted_labels(probabilities: np.ndarray, labels: Sequence[str]) -> list[str]:
    """The most probable label of each row (the first label of a tie, as argmax gives)."""
    return [labels[int(i)] for i in np.argmax(probabilities, axis=1)]


def total_variation(stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per row, half the sum of the absolute differences of two probability rows: the largest
    difference in the probability either gives to any set of labels (0 to 1)."""
    if stable.shape != candidate.shape:
        raise ValueError(f"shapes {stable.shape} and {candidate.shape} differ")
    gap = np.abs(stable.astype(np.float64) - candidate.astype(np.float64))
    return np.minimum(0.5 * gap.sum(axis=1), 1.0)


class ClassifyTask(Task):
    name: TaskName = "classify"
    route = CLASSIFY_ROUTE
    measures = (
        Measure("label_agreement", "share of inputs given the same label", 1.0, 0.0),
        Measure("tv_distance", "total-variation distance of the probabilities", 0.0, 1.0),
    )
    standby_metric = "accuracy"

    def compare(self, stable: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
        """Both answers' probabilities (``[inputs, labels]``, the same label order) -> the
        request's label agreement and mean total-variation distance."""
        if stable.ndim != 2 or stable.shape != candidate.shape or not len(stable):
            raise ValueError(f"two [inputs, labels] arrays of one shape: {stable.shape}, "
                             f"{candidate.shape}")  # fmt: skip
        same = np.argmax(stable, axis=1) == np.argmax(candidate, axis=1)
        return {
            "label_agreement": float(np.mean(same)),
            "tv_distance": float(np.mean(total_variation(stable, candidate))),
        }


CLASSIFY: Final = ClassifyTask()
