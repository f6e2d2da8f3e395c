"""The hot standby's breaker, hysteresis, admission and accuracy guard, on a fake clock.

Each timeline test reads as the router lives it: ``t`` is the router's monotonic clock in
seconds; a comment says what happens at each instant.
"""

from __future__ import annotations

import pytest

from app.contracts import RouterConfig, StandbyConfig
from app.errors import ConfigError
from app.ingress.standby import (
    BreakerState,
    PrimaryBreaker,
    accuracy_verdict,
    admission_point,
    metric_direction,
    primaries_down,
    route_with_standby,
)
from app.manifest import Manifest

CONFIG = StandbyConfig(
    trip_after_failures=5,
    trip_after_probes=3,
    min_open_s=0,
    fail_back_after_s=120,
    half_open_share=0.05,
    ramp_s=30,
)


def never_random() -> int:
    raise AssertionError("a keyed request must not use the random source")


def breaker(config: StandbyConfig = CONFIG) -> PrimaryBreaker:
    return PrimaryBreaker("stable", config)


def opened_at(t: float) -> PrimaryBreaker:
    b = breaker()
    for _ in range(5):
        b.record_failure(t, "TimeoutError")
    assert b.state is BreakerState.OPEN and b.since == t
    return b


# --------------------------------------------------------------------------- tripping


def test_failures_below_the_minimum_never_trip_and_a_success_starts_the_count_again() -> None:
    b = breaker()
    for t in range(4):  # t=0..3: four requests in a row time out
        b.record_failure(t, "TimeoutError")
    assert b.state is BreakerState.CLOSED and b.share(4) == 1.0
    b.record_success(4)  # t=4: one answers
    for t in range(5, 9):  # t=5..8: four more fail: still not five in a row
        b.record_failure(t, "TimeoutError")
    assert b.state is BreakerState.CLOSED
    b.record_failure(9, "ActorDiedError")  # t=9: the fifth in a row
    assert b.state is BreakerState.OPEN and b.share(9) == 0.0
    assert b.opened == 1 and "5 calls in a row failed (last: ActorDiedError)" in b.reason


def test_probes_nobody_answers_trip_it_but_a_cohort_without_a_model_does_not() -> None:
    b = breaker()
    for t in range(10):  # an idle pool (no target): replicas answer, none serves
        b.record_probe(t, answered=True, serving=False)
    assert b.state is BreakerState.CLOSED
    b.record_probe(10, answered=False, serving=False)  # t=10..11: no replica answers
    b.record_probe(11, answered=False, serving=False)
    b.record_probe(12, answered=True, serving=True)  # t=12: one does again: count restarts
    b.record_probe(13, answered=False, serving=False)
    b.record_probe(14, answered=False, serving=False)
    assert b.state is BreakerState.CLOSED
    b.record_probe(15, answered=False, serving=False)  # t=15: the third in a row
    assert b.state is BreakerState.OPEN and "3 probes in a row unanswered" in b.reason


# --------------------------------------------------------------------------- hysteresis


def test_fail_back_waits_out_the_window_half_open_then_ramps() -> None:
    b = opened_at(10)  # t=10: stable's replicas die; the fallback answers
    b.record_probe(20, answered=False, serving=False)  # t=20: still gone
    assert b.state is BreakerState.OPEN and b.share(20) == 0.0
    assert b.fail_back_in(20) is None  # nothing to count down until it serves again
    b.record_probe(30, answered=True, serving=True)  # t=30: Serve restarted them, serving
    assert b.state is BreakerState.HALF_OPEN and b.share(30) == pytest.approx(0.05)
    assert b.fail_back_in(30) == pytest.approx(120 + 30)
    for t in range(31, 150):  # t=31..149: the probe share answers, probes see it serving
        b.record_success(t)
        b.record_probe(t, answered=True, serving=True)
    assert b.state is BreakerState.HALF_OPEN and b.share(149.9) == pytest.approx(0.05)
    assert b.share(150) == pytest.approx(0.05)  # t=150: window over: the ramp starts
    assert b.state is BreakerState.RAMPING and b.since == 150
    assert b.share(165) == pytest.approx(0.05 + 0.95 / 2)  # t=165: half way up
    assert b.fail_back_in(165) == pytest.approx(15)
    assert b.share(180) == 1.0 and b.state is BreakerState.CLOSED  # t=180: all back


def test_a_failure_inside_the_window_resets_it_no_flapping() -> None:
    b = opened_at(0)
    b.record_probe(10, answered=True, serving=True)  # t=10: back: half-open
    b.record_failure(100, "ActorDiedError")  # t=100: one probe-share request fails
    assert b.state is BreakerState.OPEN and b.opened == 2
    assert "failed again while failing back" in b.reason
    assert b.share(131) == 0.0  # t=131: would have ramped from the first recovery: does not
    b.record_probe(140, answered=True, serving=True)  # t=140: serving again
    assert b.state is BreakerState.HALF_OPEN
    assert b.share(259) == pytest.approx(0.05)  # the window counts from t=140 ...
    assert b.share(260) == pytest.approx(0.05) and b.state is BreakerState.RAMPING  # ... to 260


def test_a_failure_while_ramping_or_an_unanswered_probe_opens_it_again() -> None:
    b = opened_at(0)
    b.record_probe(1, answered=True, serving=True)
    assert b.share(141) > 0.05 and b.state is BreakerState.RAMPING  # t=141: ramping
    b.record_failure(141, "TimeoutError")  # one failure, not five: while failing back
    assert b.state is BreakerState.OPEN and b.share(142) == 0.0

    c = opened_at(0)
    c.record_probe(1, answered=True, serving=True)
    c.record_probe(50, answered=False, serving=False)  # one probe nobody answered
    assert c.state is BreakerState.OPEN


def test_an_open_cohort_stays_open_for_min_open_s_however_its_probes_answer() -> None:
    """A cohort whose probes answer while its calls fail would otherwise go half-open at
    every probe, fail again and flap."""
    b = breaker(CONFIG.model_copy(update={"min_open_s": 5}))
    for _ in range(5):
        b.record_failure(10, "InjectedFault")  # t=10: open
    for t in (10.5, 12, 14.9):  # probes find it serving: too soon
        b.record_probe(t, answered=True, serving=True)
        assert b.state is BreakerState.OPEN
    b.record_probe(15, answered=True, serving=True)  # t=15: open long enough
    assert b.state is BreakerState.HALF_OPEN


def test_zero_window_and_zero_ramp_fail_back_at_once() -> None:
    b = breaker(CONFIG.model_copy(update={"fail_back_after_s": 0, "ramp_s": 0}))
    for _ in range(5):
        b.record_failure(0, "TimeoutError")
    b.record_probe(1, answered=True, serving=True)
    assert b.share(1) == 1.0 and b.state is BreakerState.CLOSED


def test_the_view_says_state_share_and_time_to_fail_back() -> None:
    b = opened_at(0)
    b.record_probe(10, answered=True, serving=True)
    view = b.view(40)
    assert (view.cohort, view.state, view.in_state_s) == ("stable", "half_open", 30)
    assert view.share == 0.05 and view.fail_back_in_s == pytest.approx(90 + 30)
    assert view.opened == 1 and "in a row failed" in (view.reason or "")


def test_the_view_stays_within_the_contract_on_a_host_up_for_weeks() -> None:
    """The router's clock is time since boot: a breaker that never opened has been closed
    that long. The view caps durations at the contract's bound rather than failing."""
    uptime = 40 * 24 * 3600.0
    b = PrimaryBreaker("stable", CONFIG, since=0.0)
    assert b.view(uptime).in_state_s == 7 * 24 * 3600.0
    fresh = PrimaryBreaker("stable", CONFIG, since=uptime)
    assert fresh.view(uptime + 5).in_state_s == 5


def test_a_failure_of_a_call_sent_before_the_last_change_of_state_is_ignored() -> None:
    b = opened_at(0)
    in_flight = b.epoch  # a call sent while it was open (a last resort, say) ...
    b.record_probe(10, answered=True, serving=True)  # t=10: half-open
    b.record_failure(11, "TimeoutError", sent_in=in_flight)  # ... times out after it
    assert b.state is BreakerState.HALF_OPEN  # not evidence about the cohort since t=10
    b.record_failure(12, "TimeoutError", sent_in=b.epoch)  # one sent in half-open: counts
    assert b.state is BreakerState.OPEN


def test_an_answered_call_clears_the_count_of_unanswered_probes() -> None:
    b = breaker()
    b.record_probe(0, answered=False, serving=False)  # probes time out under load ...
    b.record_probe(1, answered=False, serving=False)
    b.record_success(1.5)  # ... while calls are answered: slow, not gone
    b.record_probe(2, answered=False, serving=False)
    assert b.state is BreakerState.CLOSED


# --------------------------------------------------------------------------- admission


def test_a_partly_open_cohort_admits_by_key_and_keeps_the_users_it_took() -> None:
    b = opened_at(0)
    b.record_probe(1, answered=True, serving=True)
    users = [f"u:{i}" for i in range(20_000)]
    early = {u for u in users if b.admits(2, u, never_random)}  # half-open: 5%
    assert 0.04 < len(early) / len(users) < 0.06
    assert early == {u for u in users if b.admits(3, u, never_random)}  # the same users
    later = {u for u in users if b.admits(121 + 15, u, never_random)}  # ramp half way
    assert early <= later and 0.49 < len(later) / len(users) < 0.56
    assert all(0 <= admission_point(u) < 10_000 for u in users[:100])


def test_a_request_without_a_key_is_admitted_at_random() -> None:
    b = opened_at(0)
    b.record_probe(1, answered=True, serving=True)
    assert b.admits(2, None, lambda: 499) and not b.admits(2, None, lambda: 500)


# --------------------------------------------------------------------------- accuracy guard


def test_the_guard_allows_a_fallback_within_the_margin_only() -> None:
    config = StandbyConfig(accuracy_metric="ndcg_at_10", accuracy_margin=0.05)
    ok = accuracy_verdict(config, {"ndcg_at_10": 0.40}, {"ndcg_at_10": 0.412})
    assert ok.allowed and "within 5%" in ok.reason and "0.3914" in ok.reason
    worse = accuracy_verdict(config, {"ndcg_at_10": 0.35}, {"ndcg_at_10": 0.412})
    assert not worse.allowed and "outside 5%" in worse.reason
    assert (worse.fallback_metric, worse.stable_metric) == (0.35, 0.412)


@pytest.mark.parametrize(
    ("fallback", "stable", "words"),
    [
        (None, {"ndcg_at_10": 0.4}, "the fallback has not served a model yet"),
        ({"auc": 0.7}, {"ndcg_at_10": 0.4}, "the fallback's model reports no offline"),
        ({"ndcg_at_10": 0.4}, None, "stable's model has reported no offline ndcg_at_10"),
    ],
)
def test_the_guard_refuses_when_it_cannot_compare(fallback, stable, words) -> None:
    verdict = accuracy_verdict(StandbyConfig(), fallback, stable)
    assert not verdict.allowed and words in verdict.reason


def test_the_operator_overrides_the_guard_either_way() -> None:
    worse = ({"ndcg_at_10": 0.1}, {"ndcg_at_10": 0.4})
    assert accuracy_verdict(StandbyConfig(policy="always"), *worse).allowed
    better = ({"ndcg_at_10": 0.5}, {"ndcg_at_10": 0.4})
    refused = accuracy_verdict(StandbyConfig(policy="never"), *better)
    assert not refused.allowed and "policy never" in refused.reason


# Audit N7: the guard compares by each metric's direction, for any sign of the numbers.


def test_a_lower_is_better_metric_ten_times_worse_is_refused() -> None:
    config = StandbyConfig(accuracy_metric="logloss", accuracy_margin=0.05)
    worse = accuracy_verdict(config, {"logloss": 3.0}, {"logloss": 0.3})
    assert not worse.allowed and "outside 5%" in worse.reason
    assert "lower is better" in worse.reason and "at most 0.315" in worse.reason
    assert accuracy_verdict(config, {"logloss": 0.31}, {"logloss": 0.3}).allowed
    assert accuracy_verdict(config, {"logloss": 0.1}, {"logloss": 0.3}).allowed


@pytest.mark.parametrize(
    ("metric", "higher_is_better", "value"),
    [
        ("r2", None, -0.2),  # known, higher is better, negative for a poor model
        ("neg_log_loss", None, -0.35),  # scikit-learn's negated loss: higher is better
        ("log_likelihood", True, -1.5),  # unknown, declared by the operator
        ("energy", False, -2.0),  # unknown, declared lower is better
        ("ndcg_at_10", None, 0.0),
        ("rmse", None, 0.0),
    ],
)
def test_an_equal_metric_is_accepted_whatever_its_sign(metric, higher_is_better, value) -> None:
    config = StandbyConfig(accuracy_metric=metric, accuracy_higher_is_better=higher_is_better)
    verdict = accuracy_verdict(config, {metric: value}, {metric: value})
    assert verdict.allowed and "within 5%" in verdict.reason, verdict.reason


@pytest.mark.parametrize(
    ("metric", "higher_is_better", "fallback", "stable", "allowed"),
    [
        # The margin is 5% of |stable's value|, on the worse side of it.
        ("auc", None, 0.70, 0.78, False),
        ("auc", None, 0.75, 0.78, True),
        ("r2", None, -0.30, -0.20, False),  # 0.1 worse, 0.01 allowed
        ("r2", None, -0.205, -0.20, True),
        ("r2", None, 0.10, -0.20, True),  # better
        ("score", True, -1.10, -1.00, False),
        ("score", True, -1.04, -1.00, True),
        ("mae", None, 1.10, 1.00, False),
        ("mae", None, 1.04, 1.00, True),
        ("energy", False, -0.90, -1.00, False),  # higher, so worse
        ("energy", False, -0.96, -1.00, True),
        ("error_rate", None, 0.001, 0.0, False),  # 5% of nothing: only equal or better
        ("error_rate", None, 0.0, 0.0, True),
    ],
)
def test_a_metric_worse_by_more_than_the_margin_is_refused_in_either_direction_and_sign(
    metric, higher_is_better, fallback, stable, allowed
) -> None:
    config = StandbyConfig(
        accuracy_metric=metric, accuracy_margin=0.05, accuracy_higher_is_better=higher_is_better
    )
    verdict = accuracy_verdict(config, {metric: fallback}, {metric: stable})
    assert verdict.allowed is allowed, verdict.reason
    assert ("within 5%" if allowed else "outside 5%") in verdict.reason


def test_a_metric_of_unknown_direction_is_refused_naming_it() -> None:
    config = StandbyConfig(accuracy_metric="freshness")
    for fallback in ({"freshness": 0.5}, None):
        verdict = accuracy_verdict(config, fallback, {"freshness": 0.5})
        assert not verdict.allowed and "'freshness'" in verdict.reason
        assert "accuracy_higher_is_better" in verdict.reason
        # A setting to fix, not a cold fallback to wait for.
        assert not verdict.fallback_unknown
    declared = config.model_copy(update={"accuracy_higher_is_better": True})
    assert accuracy_verdict(declared, {"freshness": 0.5}, {"freshness": 0.5}).allowed
    # The operator's policy needs no direction.
    assert accuracy_verdict(
        StandbyConfig(accuracy_metric="freshness", policy="always"), None, None
    ).allowed


@pytest.mark.parametrize(
    ("metric", "higher_is_better"),
    [
        ("ndcg_at_10", True),
        ("NDCG@5", True),
        ("map_at_20", True),
        ("recall@100", True),
        ("f1", True),
        ("logloss", False),
        ("log_loss", False),
        ("rmse", False),
        ("neg_mean_squared_error", True),  # scikit-learn's scorers negate a loss
        ("neg_r2", False),
        ("freshness", None),
        ("ndcg_top", None),
    ],
)
def test_the_table_of_known_metrics(metric, higher_is_better) -> None:
    assert metric_direction(metric) is higher_is_better


def test_the_operators_direction_wins_over_the_table() -> None:
    # A "loss" that some team reports as a gain: the operator knows, the table guesses.
    config = StandbyConfig(accuracy_metric="loss", accuracy_higher_is_better=True)
    assert not accuracy_verdict(config, {"loss": 0.5}, {"loss": 1.0}).allowed
    assert accuracy_verdict(config, {"loss": 1.5}, {"loss": 1.0}).allowed


# --------------------------------------------------------------------------- routes


def breakers(stable: PrimaryBreaker, canary: PrimaryBreaker | None = None) -> dict:
    return {"stable": stable, "canary": canary or PrimaryBreaker("canary", CONFIG)}


ALLOWED = accuracy_verdict(StandbyConfig(policy="always"), None, None)
REFUSED = accuracy_verdict(StandbyConfig(), {"ndcg_at_10": 0.1}, {"ndcg_at_10": 0.4})
NOT_REPORTED = accuracy_verdict(StandbyConfig(), None, {"ndcg_at_10": 0.4})
UP = {"stable": True, "canary": True}
DOWN = {"stable": False, "canary": False}


def route(primaries, states, *, now=1.0, key="u:a", serving=DOWN, ready=True, verdict=ALLOWED):
    return route_with_standby(
        primaries, states, now=now, key=key, random_bp=never_random, serving=serving,
        fallback_ready=ready, verdict=verdict,
    )  # fmt: skip


def half_open_at(t: float) -> PrimaryBreaker:
    b = opened_at(0)
    b.record_probe(t, answered=True, serving=True)
    return b


def test_the_fallback_comes_last_and_alone_when_no_primary_admits() -> None:
    healthy = breakers(breaker())
    assert route(("stable", "canary"), healthy, serving=UP).destinations == (
        "stable", "canary", "fallback",
    )  # fmt: skip
    down = breakers(opened_at(0), opened_at(0))
    assert route(("stable", "canary"), down).destinations == ("fallback",)


def test_hysteresis_holds_users_back_only_while_the_fallback_answers_for_them() -> None:
    users = [f"u:{i}" for i in range(4000)]
    # Both primaries down, stable half-open, the fallback ready and allowed: stable takes
    # its share of users, the fallback the rest.
    states = breakers(half_open_at(5), opened_at(0))
    first = [route(("stable",), states, now=6, key=u).destinations[0] for u in users]
    assert 0.03 < first.count("stable") / len(users) < 0.07  # half_open_share 0.05
    assert set(first) == {"stable", "fallback"}
    # The canary healthy beside it: stable takes all its traffic back at once (no traffic
    # moved from one primary to the other for hysteresis).
    with_canary = breakers(half_open_at(5))
    serving = {"stable": True, "canary": True}
    assert all(
        route(("stable", "canary"), with_canary, now=6, key=u, serving=serving).destinations[0]
        == "stable"
        for u in users
    )
    # The fallback refused, or cold: holding users back would only make 503s.
    assert all(
        route(("stable",), states, now=6, key=u, verdict=REFUSED).destinations == ("stable",)
        for u in users
    )
    assert all(
        route(("stable",), states, now=6, key=u, ready=False).destinations == ("stable",)
        for u in users
    )


def test_no_destination_when_the_guard_refuses_or_the_fallback_is_cold() -> None:
    down = breakers(opened_at(0), opened_at(0))
    refused = route(("stable",), down, verdict=REFUSED)
    assert refused.destinations == () and "outside 5%" in (refused.refused or "")
    assert not refused.wait_for_fallback
    cold = route(("stable",), down, ready=False)
    assert cold.destinations == () and cold.wait_for_fallback
    # Cold since the router started (no evaluation reported yet): waited for, not refused;
    # the guard decides once it serves.
    never_served = route(("stable",), down, ready=False, verdict=NOT_REPORTED)
    assert never_served.destinations == () and never_served.wait_for_fallback
    assert not route(("stable",), down, ready=True, verdict=NOT_REPORTED).destinations
    # With a primary left, a cold fallback is no reason to wait: the primary answers.
    warm_primary = route(("stable",), breakers(breaker()), ready=False, serving=UP)
    assert warm_primary.destinations == ("stable",) and not warm_primary.wait_for_fallback


def test_primaries_are_down_only_after_one_served_and_while_none_takes_all_traffic() -> None:
    serving = {"stable": True, "canary": None}
    healthy = breakers(breaker())
    assert not primaries_down(healthy, serving, served_before=True)
    # A deploy whose first load still runs: nothing served yet, no outage to report.
    assert not primaries_down(healthy, {"stable": None, "canary": None}, served_before=False)
    down = opened_at(0)
    assert primaries_down(breakers(down), serving, served_before=True)  # canary: no model
    assert not primaries_down(breakers(down), UP, served_before=True)
    down.record_probe(2, answered=True, serving=True)  # half-open: not back yet
    assert primaries_down(breakers(down), serving, served_before=True)


# --------------------------------------------------------------------------- config and reports


def test_standby_fields_are_validated_by_name() -> None:
    with pytest.raises(ConfigError) as caught:
        RouterConfig.from_user_config({"standby": {"half_open_share": 0}})
    assert caught.value.ids["field"] == "user_config.standby.half_open_share"
    with pytest.raises(ConfigError) as caught:
        RouterConfig.from_user_config({"standby": {"policy": "sometimes"}})
    assert caught.value.ids["field"] == "user_config.standby.policy"
    with pytest.raises(ConfigError) as caught:
        RouterConfig.from_user_config({"standby": {"trip_after_failure": 3}})
    assert caught.value.ids["field"] == "user_config.standby.trip_after_failure"


def test_a_manifest_reports_the_numbers_of_its_offline_evaluation_only() -> None:
    manifest = Manifest.model_validate(
        {
            "model": "ranker",
            "artifact_id": "a",
            "runtime": "safetensors",
            "architecture": {"name": "ranker-mlp", "version": 1, "params": {}},
            "feature_schema": "f",
            "precision": "fp32",
            "files": [{"path": "w", "sha256": "0" * 64, "bytes": 1}],
            "metadata": {
                "offline_evaluation": {
                    "dataset": "holdout",
                    "ndcg_at_10": 0.41,
                    "auc": 1,
                    "flag": True,
                    "nan": float("nan"),
                    "nested": {"x": 1},
                }
            },
        }
    )
    assert manifest.offline_evaluation() == {"auc": 1.0, "ndcg_at_10": 0.41}
    assert manifest.offline_evaluation(limit=1) == {"auc": 1.0}
