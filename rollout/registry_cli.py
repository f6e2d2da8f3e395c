"""Moved to rollout.cli.registry; this path is kept for one release."""

from rollout.cli.registry import *  # noqa: F403
