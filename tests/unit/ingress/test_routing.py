"""Routing decisions: deterministic, monotone bucketing; random split; breaker; failover."""

from __future__ import annotations

import random

import pytest

from app.ingress.routing import (
    BASIS_POINTS,
    CohortHealth,
    bucket,
    can_fail_over_to,
    choose_cohort,
    decide_route,
    other_cohort,
    parse_forced_cohort,
    request_key,
    says_not_serving,
)


def never_random() -> int:
    raise AssertionError("a keyed request must not use the random source")


def test_bucket_is_deterministic_and_in_range() -> None:
    assert bucket("salt", "u:alice") == bucket("salt", "u:alice")
    points = [bucket("salt", f"u:{i}") for i in range(5000)]
    assert all(0 <= p < BASIS_POINTS for p in points)
    # A different salt reshuffles users (so two experiments do not pick the same users).
    assert [bucket("other", f"u:{i}") for i in range(50)] != points[:50]


def test_bucket_is_roughly_uniform() -> None:
    points = [bucket("s", f"u:{i}") for i in range(20000)]
    below_5pct = sum(p < 500 for p in points) / len(points)
    assert 0.04 < below_5pct < 0.06


def test_bucketing_is_monotone_as_the_weight_grows() -> None:
    users = [request_key(f"user-{i}", None) for i in range(3000)]
    previous: set[str] = set()
    for weight in (0, 100, 500, 2500, 5000, 10000):
        canary = {
            u
            for u in users
            if choose_cohort(canary_bp=weight, salt="s", key=u, random_bp=never_random) == "canary"
        }
        assert previous <= canary, f"a user left the canary when the weight grew to {weight}"
        previous = canary
    assert len(previous) == len(users)


def test_extreme_weights_do_not_consult_the_key() -> None:
    assert choose_cohort(canary_bp=0, salt="s", key=None, random_bp=never_random) == "stable"
    assert choose_cohort(canary_bp=10000, salt="s", key=None, random_bp=never_random) == "canary"


def test_requests_without_a_key_split_at_random() -> None:
    rng = random.Random(7)
    picks = [
        choose_cohort(
            canary_bp=2500, salt="s", key=None, random_bp=lambda: rng.randrange(BASIS_POINTS)
        )
        for _ in range(8000)
    ]
    share = picks.count("canary") / len(picks)
    assert 0.22 < share < 0.28


def test_weights_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="canary_bp"):
        choose_cohort(canary_bp=10001, salt="s", key="k", random_bp=never_random)


def test_request_key_prefers_the_user_id() -> None:
    assert request_key("alice", "sess") == "u:alice"
    assert request_key(None, "sess") == "s:sess"
    assert request_key(None, None) is None
    # A user id and an equal session id are different keys.
    assert request_key("x", None) != request_key(None, "x")


def test_forced_cohort_header_is_ignored_unless_allowed() -> None:
    assert parse_forced_cohort("canary", allowed=False) is None
    assert parse_forced_cohort(" Canary ", allowed=True) == "canary"
    assert parse_forced_cohort(None, allowed=True) is None
    with pytest.raises(ValueError, match="unknown cohort"):
        parse_forced_cohort("blue", allowed=True)


def test_other_cohort() -> None:
    assert other_cohort("stable") == "canary"
    assert other_cohort("canary") == "stable"
    with pytest.raises(ValueError):
        other_cohort("green")


def serving() -> CohortHealth:
    state = CohortHealth()
    state.record_success()
    return state


def test_fallback_only_to_a_cohort_that_serves() -> None:
    health = {"stable": serving(), "canary": CohortHealth(serving=False)}
    d = decide_route(
        canary_bp=0,
        salt="s",
        key="u:a",
        forced=None,
        health=health,
        now=0.0,
        random_bp=never_random,
    )
    assert (d.primary, d.failover_to) == ("stable", None)  # the idle canary pool is no fallback
    health["canary"] = serving()
    d = decide_route(
        canary_bp=10000,
        salt="s",
        key="u:a",
        forced=None,
        health=health,
        now=0.0,
        random_bp=never_random,
    )
    assert (d.primary, d.failover_to, d.reason) == ("canary", "stable", "weight")


def test_open_breaker_sends_traffic_to_the_other_cohort_until_it_expires() -> None:
    health = {"stable": serving(), "canary": serving()}
    health["canary"].record_failure(now=100.0, base_s=1.0)
    kwargs = dict(canary_bp=10000, salt="s", key="u:a", forced=None, random_bp=never_random)
    d = decide_route(health=health, now=100.5, **kwargs)
    assert (d.primary, d.bucketed, d.reason) == ("stable", "canary", "breaker_open")
    # After the breaker window one request tries the canary again.
    d = decide_route(health=health, now=101.5, **kwargs)
    assert d.primary == "canary"
    # Repeated failures widen the window, capped.
    for _ in range(10):
        health["canary"].record_failure(now=200.0, base_s=1.0, cap_s=10.0)
    assert health["canary"].open_until == pytest.approx(210.0)


def test_breaker_stays_on_the_chosen_cohort_when_the_other_cannot_serve() -> None:
    health = {"stable": CohortHealth(serving=False), "canary": serving()}
    health["canary"].record_failure(now=0.0)
    d = decide_route(
        canary_bp=10000,
        salt="s",
        key=None,
        forced=None,
        health=health,
        now=0.1,
        random_bp=never_random,
    )
    assert (d.primary, d.failover_to) == ("canary", None)


def test_forced_requests_never_fail_over() -> None:
    health = {"stable": serving(), "canary": serving()}
    d = decide_route(
        canary_bp=0,
        salt="s",
        key="u:a",
        forced="canary",
        health=health,
        now=0.0,
        random_bp=never_random,
    )
    assert (d.primary, d.failover_to, d.reason) == ("canary", None, "forced")


def test_failover_rechecks_the_fallback_after_the_primary_failed() -> None:
    health = {"stable": serving(), "canary": serving()}
    d = decide_route(
        canary_bp=10000,
        salt="s",
        key="u:a",
        forced=None,
        health=health,
        now=0.0,
        random_bp=never_random,
    )
    assert d.failover_to == "stable" and can_fail_over_to(d.failover_to, health, now=0.0)
    health["stable"].record_failure(now=0.0)
    assert not can_fail_over_to(d.failover_to, health, now=0.1)


def test_failover_can_be_disabled() -> None:
    health = {"stable": serving(), "canary": serving()}
    d = decide_route(
        canary_bp=10000,
        salt="s",
        key="u:a",
        forced=None,
        health=health,
        now=0.0,
        random_bp=never_random,
        failover=False,
    )
    assert d.failover_to is None


def test_probe_answers_open_and_close_the_view() -> None:
    state = CohortHealth()
    state.record_failure(now=0.0)
    state.record_probe(True)
    assert state.serving and not state.is_open(0.1)
    state.record_probe(False)
    assert state.serving is False


def test_a_cohort_known_not_to_serve_is_skipped_when_the_other_serves() -> None:
    health = {"stable": serving(), "canary": CohortHealth(serving=False)}
    d = decide_route(
        canary_bp=10000,
        salt="s",
        key="u:a",
        forced=None,
        health=health,
        now=0.0,
        random_bp=never_random,
    )
    assert (d.primary, d.bucketed, d.reason) == ("stable", "canary", "not_serving")


class NotServingHere(RuntimeError):
    category = "serving.not_ready"


class WrappedLikeRay(NotServingHere):
    """What Ray raises for a replica's exception: an instance of the cause's class too."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class OnlyCause(RuntimeError):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_not_serving_errors_are_recognised_through_ray_wrapping() -> None:
    assert says_not_serving(NotServingHere("idle"))
    assert says_not_serving(WrappedLikeRay(NotServingHere("idle")))
    assert says_not_serving(OnlyCause(NotServingHere("idle")))
    assert not says_not_serving(RuntimeError("boom"))
    assert not says_not_serving(OnlyCause(TimeoutError()))


def test_a_cohort_that_says_it_serves_nothing_is_no_failover_target() -> None:
    # The last probe said the canary serves, then its target was cleared: the first call
    # that meets "not ready" removes it as a failover destination until a probe sees a model.
    health = {"stable": serving(), "canary": serving()}
    health["canary"].record_not_serving(now=0.0)
    later = 60.0  # long after any breaker window
    assert health["canary"].serving is False
    d = decide_route(
        canary_bp=0,
        salt="s",
        key="u:a",
        forced=None,
        health=health,
        now=later,
        random_bp=never_random,
    )
    assert d.primary == "stable" and d.failover_to is None
    assert not can_fail_over_to("canary", health, later)
    health["canary"].record_probe(True)
    assert can_fail_over_to("canary", health, later)


def test_one_unanswered_probe_round_is_not_taken_for_a_gone_cohort() -> None:
    """Under load a probe round can time out while the cohort serves: stable must stay a
    failover destination. Two rounds in a row nobody answered: gone."""
    state = CohortHealth()
    state.record_probe(True)
    state.record_probe(False, answered=False)
    assert state.serving is True and can_fail_over_to("stable", {"stable": state}, now=0.0)
    state.record_probe(True)  # it answers again: the count starts over
    state.record_probe(False, answered=False)
    assert state.serving is True
    state.record_probe(False, answered=False)
    assert state.serving is False
    # Replicas that answer without a model are not serving at once (an idle pool).
    idle = CohortHealth()
    idle.record_probe(True)
    idle.record_probe(False)
    assert idle.serving is False
