"""Moved to rollout.cli.progress; this path is kept for one release."""

from rollout.cli.progress import *  # noqa: F403
