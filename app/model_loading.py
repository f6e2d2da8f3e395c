"""Moved to app.loading.pipeline; this path is kept for one release."""

from app.loading.pipeline import (
    CACHED_BYTES_CHANGED,
    RETRYABLE_BACKBONE_CATEGORIES,
    BackboneShelf,
    Candidate,
    ModelLoader,
    PinnedBackbone,
    check_manifest_for,
    close_model,
    load_pinned_backbone,
)

__all__ = [
    "CACHED_BYTES_CHANGED",
    "RETRYABLE_BACKBONE_CATEGORIES",
    "BackboneShelf",
    "Candidate",
    "ModelLoader",
    "PinnedBackbone",
    "check_manifest_for",
    "close_model",
    "load_pinned_backbone",
]
