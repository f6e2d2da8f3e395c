"""Moved: the views to rollout.views, their text to rollout.cli.render; this path is kept for one
release."""

from rollout.cli.render import *  # noqa: F403
from rollout.views import *  # noqa: F403
