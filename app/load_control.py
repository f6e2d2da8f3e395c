"""Moved to app.loading.control; this path is kept for one release."""

from app.loading.control import (
    LoadCancelled,
    LoadControl,
    LoadStage,
    StageProgress,
    advance,
    begin,
    checkpoint,
)

__all__ = [
    "LoadCancelled",
    "LoadControl",
    "LoadStage",
    "StageProgress",
    "advance",
    "begin",
    "checkpoint",
]
