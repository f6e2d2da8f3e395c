"""Moved to rollout.cli.exit_codes; this path is kept for one release."""

from rollout.cli.exit_codes import *  # noqa: F403
