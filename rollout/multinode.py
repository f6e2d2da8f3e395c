"""Moved to rollout.local.multinode; this path is kept for one release."""

from rollout.local.multinode import *  # noqa: F403
from rollout.local.multinode import _descendants, _processes_naming  # noqa: F401
