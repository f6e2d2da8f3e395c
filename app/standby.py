"""Moved to app.ingress.standby; kept for one release."""

from app.ingress.standby import *  # noqa: F403
