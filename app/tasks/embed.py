"""The ``embed`` task: each input of a request gets a vector of the family's declared
dimension.

Dry-run checks: one finite vector of the declared dimension per input, each norm within the
declared bounds (a model that normalises its output declares [1 - tol, 1 + tol]; a collapsed
model gives zero vectors, which a positive lower bound refuses). Two answers are compared by
the mean cosine similarity of the vectors of the same input (1 for the same directions; a
candidate of another embedding space has no reason to agree with stable's, so a candidate
trained into a new space is compared by its offline evaluation, not by shadow traffic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from app.errors import ArtifactRejected
from app.tasks.base import Measure, Task, TaskName, refuse_where

EMBED_ROUTE: Final = "/v1/embed"


@dataclass(frozen=True)
class EmbeddingShape:
    """What a family declares of its vectors: their dimension and the bounds of their norms."""

    dimension: int
    min_norm: float
    max_norm: float

    def __post_init__(self) -> None:
        if self.dimension < 1 or not 0.0 <= self.min_norm <= self.max_norm:
            raise ValueError(f"an embedding shape needs dimension >= 1, 0 <= min <= max: {self}")


def check_embeddings(vectors: np.ndarray, *, inputs: int, shape: EmbeddingShape) -> None:
    """``vectors`` is a valid answer for ``inputs`` inputs: ``[inputs, dimension]``, finite,
    each norm within the declared bounds. ArtifactRejected("dry_run") names the first rule
    broken and where."""
    expected = (inputs, shape.dimension)
    if vectors.ndim != 2 or tuple(vectors.shape) != expected:
        raise ArtifactRejected(
            "dry_run", f"embeddings of shape {tuple(vectors.shape)}, expected {expected}"
        )
    values = vectors.astype(np.float64, copy=False)
    refuse_where(
        ~np.isfinite(values).all(axis=1),
        lambda at, n: f"{n} of {inputs} embeddings are not finite (first: input {at[0]})",
    )
    norms = np.linalg.norm(values, axis=1)
    refuse_where(
        (norms < shape.min_norm) | (norms > shape.max_norm),
        lambda at, n: (
            f"the embedding of input {at[0]} has norm {norms[at]:.6g}, outside "
            f"[{shape.min_norm:g}, {shape.max_norm:g}] ({n} of {inputs} inputs)"
        ),
    )


def cosine_similarities(stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per row, the cosine of the angle between the two vectors (0 where either is zero)."""
    if stable.shape != candidate.shape:
        raise ValueError(f"shapes {stable.shape} and {candidate.shape} differ")
    a, b = stable.astype(np.float64), candidate.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.einsum("ij,ij->i", a, b)
    cosine = np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
    return np.clip(cosine, -1.0, 1.0)


class EmbedTask(Task):
    name: TaskName = "embed"
    route = EMBED_ROUTE
    # Cosine similarity runs from -1 (opposite) through 0 (unrelated) to 1: "nothing in
    # common" is 0, and an opposite vector counts no worse than an unrelated one.
    measures = (Measure("cosine", "mean cosine similarity of each input's vectors", 1.0, 0.0),)
    standby_metric = "recall_at_10"

    def compare(self, stable: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
        if stable.ndim != 2 or not len(stable):
            raise ValueError(f"one vector per input: shape {stable.shape}")
        return {"cosine": float(np.mean(cosine_similarities(stable, candidate)))}


EMBED: Final = EmbedTask()
