"""Moved to app.ingress.shadow; kept for one release."""

from app.ingress.shadow import (
    COMPARED,
    DROPPED,
    ERROR,
    OUTCOMES,
    Answer,
    Comparison,
    Ranking,
    ShadowMirror,
    is_mirrored,
    shadow_salt,
)

__all__ = [
    "COMPARED",
    "DROPPED",
    "ERROR",
    "OUTCOMES",
    "Answer",
    "Comparison",
    "Ranking",
    "ShadowMirror",
    "is_mirrored",
    "shadow_salt",
]
