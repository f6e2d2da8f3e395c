"""What the router and a replica exchange on the data path, per request.

NamedTuples, not models: they are pickled once per request on the hot path and validated once
at the HTTP edge. numpy appears in annotations only: the CLI imports the contracts without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the arrays: numpy is the replica's and the router's, not the CLI's
    import numpy as np


class WireRequest(NamedTuple):
    """One validated rank request as the router hands it to a replica.

    A NamedTuple, not a model: it is pickled once per request on the hot path, validated once
    at the HTTP edge (the family's ``app.model_family.RequestSchema``) and not again, and
    carries the features as float32 arrays that the model consumes as they are. Their widths
    are the family's: ``features`` per candidate, ``query`` per request (a two-tower family's
    user features; None for a family without request-level numbers)."""

    candidate_ids: tuple[str, ...]
    features: np.ndarray  # float32 [candidates, features]; NaN = missing
    context: Mapping[str, str | int | float]
    top_n: int
    query: np.ndarray | None = None  # float32 [query features]; NaN = missing


class ModelMeta(NamedTuple):
    """Which model answered: on every answer, and in its headers."""

    artifact_id: str
    revision: int
    cohort: str
    runtime_build: str
    replica: str
    backbone: str | None = None  # the backbone artifact a head runs on


class WireAnswer(NamedTuple):
    """A replica's answer to one handle call: one generation served the whole call."""

    model: ModelMeta
    rankings: list[list[tuple[str, float, str]]]  # per request: (id, score, label)


# These are pickled on every handle call between the router and the replicas, which run
# different releases while an upgrade rolls through the cluster: pickled by the name every
# release resolves (``app.contracts.X``; the package re-exports them), not by this module's.
for _pickled in (WireRequest, ModelMeta, WireAnswer):
    _pickled.__module__ = "app.contracts"
