"""Moved to app.loading.control; this path is kept for one release."""

from app.loading.control import DEFAULT_BURST_S, LoadPacer

__all__ = ["DEFAULT_BURST_S", "LoadPacer"]
