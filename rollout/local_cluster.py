"""Moved to rollout.local.cluster; this path is kept for one release."""

from rollout.local.cluster import *  # noqa: F403
