"""Moved to rollout.local.traffic; this path is kept for one release."""

from rollout.local.traffic import *  # noqa: F403
from rollout.local.traffic import _request_bodies  # noqa: F401
