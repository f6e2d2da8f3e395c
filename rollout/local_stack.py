"""Moved to rollout.local.stack; this path is kept for one release."""

from rollout.local.stack import *  # noqa: F403
