"""Moved to app.cache.budget; this path is kept for one release."""

from app.cache.budget import *  # noqa: F403
from app.cache.budget import BUDGET_LOCK_NAME, budget_lock, reservation_prefix, reserved_bytes

__all__ = ["BUDGET_LOCK_NAME", "budget_lock", "reservation_prefix", "reserved_bytes"]
