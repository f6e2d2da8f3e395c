"""Moved to rollout.local.demo; this path is kept for one release."""

from rollout.local.demo import *  # noqa: F403
