"""Synthetic ``POST /v1/rank`` bodies, the kind the live load sends.

One generator for the load that goes to a running service (``rollout.local.traffic``: the demo, the
e2e tests, the benches) and for the requests ``rollout replay`` sends through two models
offline (``app.replay``): what a shadow phase measures live is then what was recorded offline.
The bodies are the request schema's (``RequestSchema.synthetic_bodies``): the default
family's unless a schema is given.

Pure: the standard library and the request schema only (no torch, no Ray). The bodies are a
function of the seed and the shape alone: the first ``n`` bodies of a longer run are the
``n`` bodies of a shorter one with the same seed, so the live load's bodies are among a
larger replay's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from app.model_family import RequestSchema

DEFAULT_SEED: Final = 7
DEFAULT_CANDIDATES: Final = 20
DEFAULT_TOP_N: Final = 10


def rank_bodies(
    count: int,
    *,
    seed: int = DEFAULT_SEED,
    candidates: int = DEFAULT_CANDIDATES,
    top_n: int = DEFAULT_TOP_N,
    schema: RequestSchema | None = None,
) -> Iterator[dict[str, Any]]:
    """``count`` rank bodies of ``schema`` (default: ``ranker-features-v3``, whose bodies are
    ``{"context", "candidates", "top_n"}``, candidate ``j`` of body ``i`` being ``item-i-j``)
    without a user id."""
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    if candidates < 1:
        raise ValueError(f"candidates must be at least 1, got {candidates}")
    if schema is None:
        from app.models.ranker_mlp.features import SCHEMA

        schema = SCHEMA
    return schema.synthetic_bodies(count, seed=seed, candidates=candidates, top_n=top_n)
