"""Synthetic ``POST /v1/rank`` bodies, the kind the live load sends.

One generator for the load that goes to a running service (``rollout.traffic``: the demo, the
e2e tests, the benches) and for the requests ``rollout replay`` sends through two models
offline (``app.replay``): what a shadow phase measures live is then what was recorded offline.

Pure: the standard library and the feature schema only (no torch, no numpy, no Ray). The
bodies are a function of the seed and the shape alone: the first ``n`` bodies of a longer run
are the ``n`` bodies of a shorter one with the same seed, so the live load's bodies are among
a larger replay's.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Final

from app.features import CONTEXT_FIELDS, NUM_FEATURES

DEFAULT_SEED: Final = 7
DEFAULT_CANDIDATES: Final = 20
DEFAULT_TOP_N: Final = 10
# Every this-many candidates (the first, the eighth, ...) lacks one feature: sparse inputs
# happen.
SPARSE_EVERY: Final = 7


def rank_bodies(
    count: int,
    *,
    seed: int = DEFAULT_SEED,
    candidates: int = DEFAULT_CANDIDATES,
    top_n: int = DEFAULT_TOP_N,
) -> Iterator[dict[str, Any]]:
    """``count`` rank bodies without a user id (``{"context", "candidates", "top_n"}``, in
    that key order): candidate ``j`` of body ``i`` is ``item-i-j`` with 80 features drawn
    from N(0, 1) and rounded to 4 decimals (one missing, ``null``, on every seventh), the
    context one random value per field."""
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    if candidates < 1:
        raise ValueError(f"candidates must be at least 1, got {candidates}")
    rng = random.Random(seed)
    for i in range(count):
        cands = []
        for j in range(candidates):
            features: list[float | None] = [round(rng.gauss(0, 1), 4) for _ in range(NUM_FEATURES)]
            if j % SPARSE_EVERY == 0:
                features[rng.randrange(NUM_FEATURES)] = None
            cands.append({"id": f"item-{i}-{j}", "features": features})
        context = {name: rng.choice(f.values) for name, f in CONTEXT_FIELDS.items()}
        yield {"context": context, "candidates": cands, "top_n": top_n}
