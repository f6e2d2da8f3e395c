"""Moved to app.ingress.routing; kept for one release."""

from app.ingress.routing import (
    NOT_SERVING_CATEGORY,
    UNANSWERED_PROBES_GONE,
    CohortHealth,
    RouteDecision,
    bucket,
    can_fail_over_to,
    check_basis_points,
    choose_cohort,
    decide_route,
    other_cohort,
    parse_forced_cohort,
    request_key,
    says_not_serving,
)

__all__ = [
    "NOT_SERVING_CATEGORY",
    "UNANSWERED_PROBES_GONE",
    "CohortHealth",
    "RouteDecision",
    "bucket",
    "can_fail_over_to",
    "check_basis_points",
    "choose_cohort",
    "decide_route",
    "other_cohort",
    "parse_forced_cohort",
    "request_key",
    "says_not_serving",
]
