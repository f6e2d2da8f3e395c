"""Moved to app.ingress.coalescing; kept for one release."""

from app.ingress.coalescing import (
    Answer,
    CohortCoalescer,
    Ranking,
    Waiter,
)

__all__ = [
    "Answer",
    "CohortCoalescer",
    "Ranking",
    "Waiter",
]
