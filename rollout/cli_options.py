"""Moved to rollout.cli.options; this path is kept for one release."""

from rollout.cli.options import *  # noqa: F403
