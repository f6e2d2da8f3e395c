"""The serving data plane on a real Ray Serve cluster, under concurrent load.

Every test that changes a target or a weight does it through the declarative config (REST PUT
of a user_config change), as the rollout controller will, and requires ZERO non-2xx answers -
except where a test makes every cohort fail on purpose and checks the honest 503s.
"""

from __future__ import annotations

import pytest

from app.contracts import InstanceReport
from app.polling import wait_until
from tests.e2e.harness import APP, STABLE_REPLICAS, Cluster, assert_all_ok, client_load

pytestmark = pytest.mark.e2e


def replica_ids(cluster: Cluster, deployment: str) -> set[tuple[str, int]]:
    return {(r["replica_id"], r["pid"]) for r in cluster.rest.replicas(APP, deployment)}


def test_hot_swap_v41_to_v42_in_place_under_load(serving: Cluster) -> None:
    cluster = serving
    before = replica_ids(cluster, "stable")
    revision = cluster.revision()
    with client_load(cluster.http_url) as load:
        wait_until(lambda: len(load.records) >= 20, 60, "traffic on v41")
        cluster.set_target("stable", cluster.target(cluster.demo["ranker-v42"], revision))
        cluster.wait_cohort_serving("stable", "ranker-v42", revision)
        swapped_at = len(load.records)
        wait_until(lambda: len(load.records) >= swapped_at + 20, 60, "traffic after the swap")
    assert_all_ok(load.records)
    served = [(a.artifact_id, a.revision) for a in load.records]
    assert served[0][0] == "ranker-v41"
    assert ("ranker-v42", revision) in served
    # After every replica reported v42, nothing answers with v41 any more.
    assert {a.artifact_id for a in load.records[swapped_at:]} == {"ranker-v42"}
    # In place: the same replicas (ids and PIDs) before and after; no restart.
    assert replica_ids(cluster, "stable") == before


def test_same_config_again_is_a_no_op(serving: Cluster) -> None:
    cluster = serving
    reports = cluster.latest_reports("stable")
    installs_before = {rid: rep.actual_revision for rid, rep in reports.items()}
    # Re-PUT the identical user_config: nothing reloads, nothing restarts.
    cluster.rest.update_user_configs(APP, {"stable": lambda cfg: cfg})
    after = cluster.latest_reports("stable")
    assert {rid: rep.actual_revision for rid, rep in after.items()} == installs_before


# --------------------------------------------------------------------------- bad candidates

BAD_CANDIDATES = [
    # (builder, tampering, expected rejection categories)
    ("wrong_schema", None, {"schema"}),
    ("wrong_shape", None, {"load"}),
    ("nan_weights", None, {"dry_run"}),
    ("good", "truncate", {"size", "missing"}),
    ("good", "flip", {"digest"}),
]


def build_bad(cluster: Cluster, kind: str, tamper: str | None, n: int):
    from tests import artifacts

    root = cluster.work / f"bad-{n}"
    if kind == "good":
        packed = artifacts.good_artifact(root, artifact_id=f"ranker-tampered-{n}", seed=100 + n)
    else:
        packed = getattr(artifacts, f"{kind}_artifact")(root)
    if tamper == "truncate":
        artifacts.truncate_file(packed, "weights.safetensors")
    elif tamper == "flip":
        artifacts.flip_byte(packed, "weights.safetensors")
    return packed


def test_bad_candidates_leave_v41_serving_and_are_reported(serving: Cluster) -> None:
    cluster = serving
    baseline = {rid: rep.actual_revision for rid, rep in cluster.latest_reports("stable").items()}
    with client_load(cluster.http_url) as load:
        for n, (kind, tamper, categories) in enumerate(BAD_CANDIDATES):
            packed = build_bad(cluster, kind, tamper, n)
            revision = cluster.revision()
            cluster.set_target("stable", cluster.target(packed, revision))

            def failed_everywhere(revision: int = revision, categories=categories) -> bool:
                reports = cluster.latest_reports("stable")
                assert len(reports) == len(baseline)
                for rep in reports.values():
                    err = rep.last_error
                    assert rep.phase == "failed" and err and err.revision == revision, rep
                    assert err.category in categories, err
                    assert rep.actual_artifact == "ranker-v41", rep
                return True

            wait_until(
                failed_everywhere,
                60,
                f"{kind}/{tamper} rejected on every replica",
                retry_on=(Exception,),
            )
        seen = len(load.records)
        wait_until(lambda: len(load.records) >= seen + 10, 60, "traffic after the last rejection")
    assert_all_ok(load.records)
    assert {a.artifact_id for a in load.records} == {"ranker-v41"}
    # Nothing restarted: the same replicas still serve.
    assert set(cluster.latest_reports("stable")) == set(baseline)


# --------------------------------------------------------------------------- slow candidate


def test_slow_candidate_overtaken_by_a_rollback_never_installs(serving: Cluster) -> None:
    from tests import artifacts
    from tests.e2e.artifact_server import GatedArtifactServer

    cluster = serving
    store = cluster.work / "http-store"
    store.mkdir(exist_ok=True)
    slow = artifacts.good_artifact(store, artifact_id="ranker-slow", seed=7)
    server = GatedArtifactServer(store)
    try:
        server.hold("ranker-slow")
        slow_rev, rollback_rev = cluster.revision(), cluster.revision()
        slow_target = {
            **cluster.target(slow, slow_rev),
            "manifest_uri": server.manifest_uri("ranker-slow"),
        }
        with client_load(cluster.http_url) as load:
            cluster.set_target("stable", slow_target)
            wait_until(lambda: server.waiting("ranker-slow") >= 1, 60, "slow download started")

            def stable_reports() -> list[InstanceReport]:
                # Every stable replica, never none: an empty set would pass any "all of them".
                reports = list(cluster.latest_reports("stable").values())
                assert len(reports) == STABLE_REPLICAS, f"{len(reports)} stable reports"
                return reports

            def loading() -> bool:
                for rep in stable_reports():
                    assert rep.desired_revision == slow_rev and rep.phase == "loading", rep
                return True

            wait_until(
                loading,
                30,
                "every stable replica loading the slow candidate",
                retry_on=(Exception,),
            )
            # Rollback while the candidate is still downloading.
            cluster.set_target("stable", cluster.target(cluster.demo["ranker-v41"], rollback_rev))
            wait_until(
                lambda: all(r.desired_revision == rollback_rev for r in stable_reports()),
                30,
                "rollback target recorded",
                retry_on=(Exception,),
            )
            server.release("ranker-slow")
            cluster.wait_cohort_serving("stable", "ranker-v41", rollback_rev)
            for rep in stable_reports():
                # Never installed: stopped at its first chunk once released (or, had it
                # been done already, loaded and dropped).
                assert slow_rev in rep.cancelled_revisions + rep.discarded_revisions, rep
        assert_all_ok(load.records)
        assert "ranker-slow" not in {a.artifact_id for a in load.records}
        history = ray_history(cluster)
        assert not [h for h in history if h.actual_artifact == "ranker-slow"]
    finally:
        server.close()


def ray_history(cluster: Cluster) -> list[InstanceReport]:
    import ray

    return [InstanceReport.model_validate(r) for r in ray.get(cluster.reports.get_history.remote())]


# --------------------------------------------------------------------------- router split


def rank_many(cluster: Cluster, users: list[str | None]) -> list[dict]:
    """POST one request per user (concurrently); return (user, cohort, artifact, headers)."""
    import asyncio

    import httpx

    from tests.e2e.harness import rank_body

    async def main() -> list[dict]:
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=30) as client:

            async def one(user: str | None) -> dict:
                async with sem:
                    r = await client.post("/v1/rank", json=rank_body(user, n=4, top_n=2))
                assert r.status_code == 200, r.text
                body = r.json()
                assert r.headers["X-Model-Cohort"] == body["model"]["cohort"]
                assert r.headers["X-Model-Artifact"] == body["model"]["artifact_id"]
                assert r.headers["X-Model-Revision"] == str(body["model"]["revision"])
                return {"user": user, **body["model"], "failover": body["failover"]}

            return await asyncio.gather(*(one(u) for u in users))

    return asyncio.run(main())


def set_weight(cluster: Cluster, canary_bp: int) -> None:
    cluster.set_router(canary_bp=canary_bp)
    wait_until(
        lambda: cluster.status()["canary_bp"] == canary_bp,
        30,
        f"router at {canary_bp} bp",
        retry_on=(Exception,),
    )


def test_bucketing_is_deterministic_and_monotone(serving: Cluster) -> None:
    cluster = serving
    # 300 keyed users place the 5% and 25% shares within their bounds below; 100 of them asked
    # again are enough to see a split that is not deterministic (a random one changes about
    # 10% of the users' cohorts at 5%: all 100 alike by chance about once in 20,000).
    users = [f"user-{i}" for i in range(300)]
    canary_at: dict[int, set[str]] = {}
    for weight in (500, 2500):
        set_weight(cluster, weight)
        first = rank_many(cluster, users)
        again = rank_many(cluster, users[:100])
        assert [a["cohort"] for a in first[:100]] == [a["cohort"] for a in again], (
            "not deterministic"
        )
        assert not any(a["failover"] for a in first)
        for a in first:
            expected = "ranker-v42" if a["cohort"] == "canary" else "ranker-v41"
            assert a["artifact_id"] == expected, a
        canary_at[weight] = {a["user"] for a in first if a["cohort"] == "canary"}
    assert canary_at[500] <= canary_at[2500], "a user left the canary when its weight grew"
    assert 3 <= len(canary_at[500]) <= 35  # ~5% of 300
    assert 45 <= len(canary_at[2500]) <= 110  # ~25% of 300
    # No key: a random split, so both cohorts answer (at 25%, 40 requests all on stable by
    # chance about once in 100,000).
    anonymous = rank_many(cluster, [None] * 40)
    assert {a["cohort"] for a in anonymous} == {"stable", "canary"}


def test_a_triton_client_is_routed_by_weight_and_answered_as_v1_rank_answers(
    serving: Cluster,
) -> None:
    """The Open Inference Protocol through the running app, by its own client library
    (binary tensors, its defaults): each of 100 users lands in the cohort /v1/rank puts it in
    at 25% (both cohorts, with near certainty, and about a quarter in the canary), and gets
    the same top-N, with the same scores, from the same artifact. 200 requests."""
    import httpx
    import numpy as np
    import tritonclient.http as triton

    from tests.e2e.harness import rank_body

    cluster = serving
    set_weight(cluster, 2500)
    client = triton.InferenceServerClient(url=cluster.http_url.removeprefix("http://"))
    assert client.is_model_ready("ranker-mlp")
    canary = 0
    with httpx.Client(base_url=cluster.http_url, timeout=30) as http:
        for i in range(100):
            user = f"oip-user-{i}"
            body = rank_body(user, n=4, top_n=2)
            v1 = http.post("/v1/rank", json=body)
            assert v1.status_code == 200, v1.text
            expected = v1.json()
            rows = np.array(
                [[np.nan if x is None else x for x in c["features"]] for c in body["candidates"]],
                dtype=np.float32,
            )
            features = triton.InferInput("features", list(rows.shape), "FP32")
            features.set_data_from_numpy(rows)
            ids = triton.InferInput("candidate_ids", [len(rows)], "BYTES")
            ids.set_data_from_numpy(
                np.array([c["id"].encode() for c in body["candidates"]], dtype=object)
            )
            result = client.infer(
                "ranker-mlp", [features, ids],
                parameters={"user_id": user, "top_n": 2, **body["context"]},
            )  # fmt: skip
            tags = result.get_response()["parameters"]
            assert tags["cohort"] == expected["model"]["cohort"], (user, tags, expected)
            assert tags["artifact_id"] == expected["model"]["artifact_id"]
            assert [x.decode() for x in result.as_numpy("candidate_ids")] == [
                c["id"] for c in expected["ranking"]
            ]
            np.testing.assert_allclose(
                result.as_numpy("scores"), [c["score"] for c in expected["ranking"]], atol=1e-4
            )
            canary += tags["cohort"] == "canary"
    assert 8 <= canary <= 42, canary  # 25 of 100, within 4 sigma


def test_failover_when_the_canary_pool_is_gone(serving: Cluster) -> None:
    import ray

    cluster = serving
    set_weight(cluster, 5000)
    with client_load(cluster.http_url, concurrency=4) as load:
        wait_until(lambda: any(a.cohort == "canary" for a in load.records), 60, "canary traffic")
        killed = cluster.rest.replicas(APP, "canary")
        # Marked before the kill: the requests in flight to the killed replicas fail over at
        # once, often before the kill loop returns, and they are the failovers to see.
        mark = len(load.records)
        for rep in killed:
            actor = ray.get_actor(rep["actor_name"], namespace="serve")
            ray.kill(actor, no_restart=True)
        # Serve replaces the killed replica; the canary takes its share back.
        gone = {r["replica_id"] for r in killed}

        def canary_back() -> bool:
            fresh = [
                a for a in load.records[mark:] if a.cohort == "canary" and a.replica not in gone
            ]
            return len(fresh) >= 3

        wait_until(canary_back, 120, "a new canary replica answering")
    # Every request that reached a killed replica failed over to stable, and none failed.
    # Whether any did is up to the moment of the kill: with none in flight then, Serve's
    # handle learns of the death first and holds canary calls for the new replica (the run
    # that waited for a failover record waited in vain). A failover that stopped working
    # fails a request here; tests/inprocess/test_router_standby.py pins the failover itself
    # (every call to the canary raising, each request answered by stable, marked failover).
    assert_all_ok(load.records)
    failovers = [a for a in load.records[mark:] if a.failover]
    assert all(a.cohort == "stable" for a in failovers), failovers


# --------------------------------------------------------------------------- drain, errors


def test_readyz_503_while_draining_and_the_client_rides_it_out(serving: Cluster) -> None:
    import httpx

    from app.client import RankerClient, RetryPolicy
    from tests.e2e.harness import rank_body

    cluster = serving
    assert httpx.get(f"{cluster.http_url}/readyz").status_code == 200
    cluster.set_router(draining=True)
    wait_until(
        lambda: httpx.get(f"{cluster.http_url}/readyz").status_code == 503,
        30,
        "readyz 503",
        retry_on=(Exception,),
    )
    ready = httpx.get(f"{cluster.http_url}/readyz")
    assert ready.headers["Retry-After"] == "1" and ready.json()["reason"] == "draining"
    rank = httpx.post(f"{cluster.http_url}/v1/rank", json=rank_body("u"))
    assert rank.status_code == 503 and rank.headers["Retry-After"] == "1"
    assert rank.json()["error"] == "draining"
    assert httpx.get(f"{cluster.http_url}/livez").status_code == 200
    assert httpx.get(f"{cluster.http_url}/startupz").status_code == 200

    undrained = []

    def sleep_and_undrain(seconds: float) -> None:
        # The operator ends the drain while the client is waiting out Retry-After.
        if not undrained:
            cluster.set_router(draining=False)
            undrained.append(True)
        import time

        time.sleep(seconds)

    policy = RetryPolicy(max_attempts=20, deadline_s=60)
    with RankerClient(cluster.http_url, policy=policy, sleep=sleep_and_undrain) as client:
        result = client.rank(rank_body("u"))
    assert result.status == 200 and result.attempts >= 2
    assert httpx.get(f"{cluster.http_url}/readyz").status_code == 200


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["candidates"][1].update(features=[0.0] * 79), "candidates[1].features"),
        (
            lambda b: b["candidates"][0]["features"].__setitem__(5, "NaN"),
            "candidates[0].features[5]",
        ),
        (lambda b: b.update(candidates=[]), "candidates"),
        (lambda b: b.update(candidates=b["candidates"] * 300), "candidates"),
        (lambda b: b.update(context={"surface": "moon"}), "context.surface"),
        (lambda b: b.update(top_n=0), "top_n"),
        (lambda b: b.update(colour="red"), "colour"),
        # Strict numbers: beyond float32's range, strings and booleans are no features, and
        # a boolean is no hour nor top_n.
        (
            lambda b: b["candidates"][0]["features"].__setitem__(5, 1e39),
            "candidates[0].features[5]",
        ),
        (
            lambda b: b["candidates"][2]["features"].__setitem__(7, -3.5e38),
            "candidates[2].features[7]",
        ),
        (
            lambda b: b["candidates"][0]["features"].__setitem__(2, "1.5"),
            "candidates[0].features[2]",
        ),
        (
            lambda b: b["candidates"][1]["features"].__setitem__(0, True),
            "candidates[1].features[0]",
        ),
        (lambda b: b["context"].update(hour_of_day=True), "context.hour_of_day"),
        (lambda b: b.update(top_n=True), "top_n"),
        (lambda b: b.update(top_n="5"), "top_n"),
    ],
)
def test_client_mistakes_get_422_naming_the_field(cluster: Cluster, mutate, field: str) -> None:
    import json

    import httpx

    from tests.e2e.harness import rank_body

    body = rank_body("u")
    mutate(body)
    raw = json.dumps(body).replace('"NaN"', "NaN")
    r = httpx.post(
        f"{cluster.http_url}/v1/rank", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field, r.json()


def test_protocol_mistakes_are_4xx_never_500(cluster: Cluster) -> None:
    import httpx

    from tests.e2e.harness import rank_body

    url = cluster.http_url
    assert httpx.post(f"{url}/v1/rank", content=b"{not json").status_code == 422
    assert httpx.post(f"{url}/v1/rank", content=b"").status_code == 422
    assert httpx.get(f"{url}/v1/rank").status_code == 405
    assert httpx.get(f"{url}/nowhere").status_code == 404
    r = httpx.post(f"{url}/v1/rank", json=rank_body("u"), headers={"X-Ranker-Cohort": "blue"})
    assert r.status_code == 422 and r.json()["field"] == "x-ranker-cohort"
    forced = httpx.post(
        f"{url}/v1/rank", json=rank_body("u"), headers={"X-Ranker-Cohort": "canary"}
    )
    assert forced.status_code == 200 and forced.json()["model"]["cohort"] == "canary"


def test_status_and_metrics_carry_the_cohorts(serving: Cluster) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from app import telemetry as t

    cluster = serving
    set_weight(cluster, 5000)
    rank_many(cluster, [f"m-{i}" for i in range(40)])
    status = cluster.status()
    cohorts = {c["cohort"]: c for c in status["cohorts"]}
    assert cohorts["canary"]["weight_bp"] == 5000 and cohorts["stable"]["weight_bp"] == 5000
    assert cohorts["stable"]["serving"] and cohorts["canary"]["serving"]
    assert all(r["actual_artifact"] == "ranker-v41" for r in cohorts["stable"]["replicas"])

    def exported() -> bool:
        text = httpx.get(cluster.metrics_url, timeout=10).text
        seen: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                seen.setdefault(sample.name, set()).add(sample.labels.get(t.COHORT, ""))
        requests = seen.get(t.exported_name(t.ROUTER_REQUESTS, kind="counter"), set())
        assert {"stable", "canary"} <= requests, sorted(seen)[:50]
        assert {"stable", "canary"} <= seen.get(
            t.exported_name(t.REPLICA_ACTUAL_REVISION, kind="gauge"), set()
        )
        assert seen.get(t.exported_name(t.ROUTER_LATENCY_MS, kind="histogram") + "_bucket")
        return True

    wait_until(
        exported,
        60,
        "router and replica metrics exported with cohort labels",
        retry_on=(Exception,),
    )


# --------------------------------------------------------------------------- fault injection


def router_samples(cluster: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's series (name, labels without Ray's replica tags) -> value, summed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    text = httpx.get(cluster.metrics_url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("ray_ranker_router_"):
                continue
            labels = tuple(
                sorted(
                    (k, v)
                    for k, v in sample.labels.items()
                    if k in ("cohort", "outcome", "from_cohort", "le")
                )
            )
            key = (sample.name, labels)
            out[key] = out.get(key, 0.0) + sample.value
    return out


def router_count(samples: dict, cohort: str, outcome: str) -> float:
    from app import telemetry as t

    name = t.exported_name(t.ROUTER_REQUESTS, kind="counter")
    return samples.get((name, (("cohort", cohort), ("outcome", outcome))), 0.0)


def router_slower_than(samples: dict, cohort: str, outcome: str, bound_ms: float) -> float:
    """Observations of the router's latency histogram above ``bound_ms`` (a bucket bound)."""
    from app import telemetry as t

    name = t.exported_name(t.ROUTER_LATENCY_MS, kind="histogram") + "_bucket"
    buckets = {
        float(dict(labels)["le"]): value
        for (sample, labels), value in samples.items()
        if sample == name
        and dict(labels).get("cohort") == cohort
        and dict(labels).get("outcome") == outcome
    }
    assert not buckets or bound_ms in buckets, f"{bound_ms} ms is no bucket bound: {buckets}"
    return buckets.get(float("inf"), 0.0) - buckets.get(bound_ms, 0.0)


def test_canary_faults_show_in_its_router_metrics_and_clients_see_only_2xx(
    serving: Cluster,
) -> None:
    cluster = serving
    delay_ms = 300.0
    set_weight(cluster, 5000)
    with client_load(cluster.http_url, concurrency=6) as load:
        wait_until(lambda: any(a.cohort == "canary" for a in load.records), 60, "canary traffic")
        before = router_samples(cluster)
        cluster.set_faults("canary", {"extra_latency_ms": delay_ms, "error_rate": 0.3})

        def faults_live() -> bool:
            reports = cluster.latest_reports("canary")
            assert reports and all(r.faults for r in reports.values()), reports
            assert all(r.last_error is None for r in reports.values()), reports
            return True

        wait_until(faults_live, 30, "faults in effect on the canary", retry_on=(Exception,))
        live_at = load.now_s()
        mark = len(load.records)
        wait_until(
            lambda: any(a.failover and a.cohort == "stable" for a in load.records[mark:]),
            60,
            "failed canary calls answered by stable",
        )

        def metrics_show_it() -> bool:
            now = router_samples(cluster)
            errors = router_count(now, "canary", "error") - router_count(before, "canary", "error")
            slow = router_slower_than(now, "canary", "ok", delay_ms) - router_slower_than(
                before, "canary", "ok", delay_ms
            )
            assert errors >= 3 and slow >= 5, (errors, slow)
            return True

        wait_until(
            metrics_show_it,
            60,
            "canary errors and slow canary answers in the metrics",
            retry_on=(Exception,),
        )
        slow_after = [a for a in load.records if a.cohort == "canary" and a.start_s >= live_at]
    assert_all_ok(load.records)
    assert slow_after, "no canary answers after the faults took effect"
    # Every canary answer to a request sent after the faults took effect waited for them.
    assert min(a.latency_ms for a in slow_after) >= delay_ms
    # Stable is untouched: no stable errors from the canary's faults.
    assert router_count(router_samples(cluster), "stable", "error") == router_count(
        before, "stable", "error"
    )


# --------------------------------------------------------------------------- bad user_config


def test_an_invalid_user_config_on_serving_replicas_is_refused_not_fatal(
    serving: Cluster,
) -> None:
    cluster = serving
    before = replica_ids(cluster, "stable")
    good = cluster.rest.current_user_config(APP, "stable")
    try:
        with client_load(cluster.http_url) as load:
            wait_until(lambda: len(load.records) >= 20, 60, "traffic on v41")
            cluster.rest.update_user_configs(
                APP, {"stable": lambda cfg: {**cfg, "batching": {"max_batch_size": 0}}}
            )

            def refused_everywhere() -> bool:
                reports = cluster.latest_reports("stable")
                assert len(reports) == len(before), reports
                for rep in reports.values():
                    err = rep.last_error
                    assert err and err.category == "config", rep
                    assert err.field == "user_config.batching.max_batch_size", err
                    assert rep.actual_artifact == "ranker-v41", rep
                return True

            wait_until(
                refused_everywhere,
                60,
                "the bad config refused on every stable replica",
                retry_on=(Exception,),
            )
            mark = len(load.records)
            wait_until(lambda: len(load.records) >= mark + 20, 60, "traffic after the bad config")
            assert cluster.rest.app_status(APP) == "RUNNING"
    finally:
        cluster.rest.update_user_configs(APP, {"stable": lambda cfg: good})
    assert_all_ok(load.records)
    assert {a.artifact_id for a in load.records} == {"ranker-v41"}
    assert replica_ids(cluster, "stable") == before  # no replica died or restarted

    def error_cleared() -> bool:
        reports = cluster.latest_reports("stable")
        assert reports and all(r.last_error is None for r in reports.values()), reports
        return True

    wait_until(error_cleared, 30, "the good config clears the error", retry_on=(Exception,))


# --------------------------------------------------------------------------- cleared target


def test_a_cleared_canary_target_retires_its_model_and_takes_no_failover(
    serving: Cluster,
) -> None:
    """Canary on v42 at 0% weight; stable made to fail every call. While the canary serves,
    stable's failures fail over to it (the control). Once its target is cleared, the canary
    serves nothing: status says so, and no request is answered by it any more."""
    cluster = serving
    canary_before = replica_ids(cluster, "canary")
    try:
        with client_load(cluster.http_url, concurrency=4) as load:
            wait_until(lambda: len(load.records) >= 10, 60, "traffic on stable")
            cluster.set_faults("stable", {"error_rate": 1.0})
            mark = len(load.records)
            wait_until(
                lambda: any(a.failover and a.cohort == "canary" for a in load.records[mark:]),
                60,
                "stable's failures failing over to the serving canary (control)",
            )
            cluster.set_target("canary", None)

            def canary_idle() -> bool:
                reports = cluster.latest_reports("canary")
                assert reports, "no canary report"
                for rep in reports.values():
                    assert rep.phase == "idle", rep
                    assert rep.actual_revision is None and rep.actual_artifact is None, rep
                    assert rep.desired_revision is None, rep
                return True

            wait_until(canary_idle, 30, "canary replicas idle with no model", retry_on=(Exception,))

            def status_not_serving() -> bool:
                cohorts = {c["cohort"]: c for c in cluster.status()["cohorts"]}
                assert cohorts["canary"]["serving"] is False, cohorts["canary"]
                return True

            wait_until(
                status_not_serving, 30, "router status: canary not serving", retry_on=(Exception,)
            )
            cleared_at = load.now_s()
            mark = len(load.records)
            wait_until(lambda: len(load.records) >= mark + 30, 60, "requests after the clear")
            after = [a for a in load.records if a.start_s >= cleared_at]
            assert after
            assert not [a for a in after if a.cohort == "canary"], "canary answered after clear"
            # Stable fails every call and there is nowhere to fail over to: honest 503s.
            assert {a.status for a in after} == {503}

            # A later target (higher revision) loads normally and takes failovers again.
            revision = cluster.revision()
            cluster.set_target("canary", cluster.target(cluster.demo["ranker-v42"], revision))
            cluster.wait_cohort_serving("canary", "ranker-v42", revision)
            mark = len(load.records)
            wait_until(
                lambda: any(a.failover and a.cohort == "canary" for a in load.records[mark:]),
                60,
                "failover to the canary once it serves again",
            )
    finally:
        cluster.set_faults("stable", None)
    assert replica_ids(cluster, "canary") == canary_before  # retired in place, no restart
    no_answer = [a for a in load.records if a.status == 0]  # transport errors
    assert not no_answer, no_answer[:5]


# --------------------------------------------------------------------------- body size cap

# A generous bound on waiting for an answer: without the cap the router waits for a body that
# never comes (Content-Length) or reads all of it first (chunked).
ANSWER_BOUND_S = 60.0


def _host_port(cluster: Cluster) -> tuple[str, int]:
    import httpx

    url = httpx.URL(cluster.http_url)
    return url.host, int(url.port or 80)


def test_a_declared_body_over_the_cap_gets_413_without_sending_it(cluster: Cluster) -> None:
    import http.client
    import json

    from app.api import MAX_BODY_BYTES

    host, port = _host_port(cluster)
    conn = http.client.HTTPConnection(host, port, timeout=ANSWER_BOUND_S)
    try:
        conn.putrequest("POST", "/v1/rank")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(1 << 30))  # 1 GiB announced, nothing sent
        conn.endheaders()
        response = conn.getresponse()
        answer = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 413, answer
    assert answer["error"] == "body_too_large" and answer["field"] == "body", answer
    assert answer["limit_bytes"] == MAX_BODY_BYTES
    assert str(MAX_BODY_BYTES) in answer["detail"] and str(1 << 30) in answer["detail"], answer
    # The service is unharmed.
    assert cluster.status()["cohorts"]


def test_a_chunked_body_is_cut_off_at_the_cap_with_413(cluster: Cluster) -> None:
    """Through the real proxy, a chunked body over the cap gets 413, not a 500 or a hang.

    Whether the answer arrives before the client has sent everything depends on timing: Ray's
    proxy buffers whatever the client sends until the answer goes out. That the router stops
    reading at the cap is pinned without timing in tests/unit/test_router.py (and the
    ranker's handler in test_ranker_http.py)."""
    import http.client
    import json
    import select
    import socket

    from app.api import MAX_BODY_BYTES

    host, port = _host_port(cluster)
    chunk = b"[" + b" " * (64 * 1024 - 1)  # JSON-ish garbage, never complete
    framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    give_up_after = 2 * MAX_BODY_BYTES  # what the client sends if nothing stops it
    sock = socket.create_connection((host, port), timeout=ANSWER_BOUND_S)
    sent = 0
    try:
        sock.sendall(
            b"POST /v1/rank HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % host.encode()
        )
        while sent < give_up_after:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:  # the server answered while the body was still coming
                break
            try:
                sock.sendall(framed)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server closed the connection: it stopped reading
            sent += len(chunk)
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
    finally:
        sock.close()
    assert response.status == 413, answer
    assert answer["error"] == "body_too_large" and answer["limit_bytes"] == MAX_BODY_BYTES
    assert cluster.status()["cohorts"]


# --------------------------------------------------------------------------- bad router config


def test_an_invalid_router_config_is_refused_and_the_last_good_one_serves(
    serving: Cluster,
) -> None:
    cluster = serving
    set_weight(cluster, 2500)
    good = cluster.rest.current_user_config(APP, "router")
    assert good is not None
    routers_before = replica_ids(cluster, "router")

    def refused(field: str) -> bool:
        status = cluster.status()
        error = status.get("config_error")
        assert error and error["category"] == "config" and error["field"] == field, status
        assert field.removeprefix("user_config.") in error["message"], error
        assert status["canary_bp"] == 2500, status  # the last good weights still apply
        return True

    try:
        with client_load(cluster.http_url) as load:
            for bad, field in (
                ({**good, "canary_pb": 5000}, "user_config.canary_pb"),  # a typo
                ({**good, "canary_bp": 10001}, "user_config.canary_bp"),  # out of range
            ):
                cluster.rest.update_user_configs(APP, {"router": lambda cfg, bad=bad: bad})
                wait_until(
                    lambda field=field: refused(field),
                    60,
                    f"router refuses {field}",
                    retry_on=(Exception,),
                )
                mark = len(load.records)
                wait_until(lambda mark=mark: len(load.records) >= mark + 20, 60, "traffic after it")
                assert cluster.rest.app_status(APP) == "RUNNING"
            served = {a.cohort for a in load.records}
    finally:
        cluster.rest.update_user_configs(APP, {"router": lambda cfg: {**good, "canary_bp": 5000}})

    def cleared() -> bool:
        status = cluster.status()
        assert status.get("config_error") is None and status["canary_bp"] == 5000, status
        return True

    wait_until(cleared, 60, "a good config clears the refusal", retry_on=(Exception,))
    assert_all_ok(load.records)
    assert served == {"stable", "canary"}  # 25% canary all along
    assert replica_ids(cluster, "router") == routers_before  # no router died or restarted


# --------------------------------------------------------------------------- observability


def test_every_metric_the_dashboard_queries_is_exported(serving: Cluster) -> None:
    """Scrape the running app (Ray's metrics export port) after traffic that makes every
    panel's series exist: requests on both cohorts, a rejection, failovers from a failing
    canary, a refused candidate; then every metric name the dashboard queries is there."""
    import json
    import re
    from pathlib import Path

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from app import telemetry as t

    cluster = serving
    dashboard = json.loads(
        (
            Path(__file__).resolve().parents[2]
            / "configs/observability/grafana-rollout-dashboard.json"
        ).read_text()
    )
    # The controller's own series (the judge's evidence) need a rollout: they are checked on
    # one in tests/e2e/test_acceptance.py. The hot standby's need an app with a fallback:
    # tests/e2e/test_standby.py.
    standby = {t.exported_name(n, kind="gauge") for n in t.STANDBY_GAUGES}
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(ray_[a-z0-9_]+)\b", target["expr"])
        if not name.startswith("ray_ranker_rollout_") and name not in standby
    }
    assert len(queried) >= 10, queried

    set_weight(cluster, 5000)
    # Every stable answer mirrored to the canary: the shadow panels' series.
    cluster.set_router(shadow={"fraction_bp": 10_000})
    wait_until(lambda: cluster.status()["shadow_bp"] == 10_000, 30, "router mirroring")
    rank_many(cluster, [f"obs-{i}" for i in range(40)])
    assert httpx.post(f"{cluster.http_url}/v1/rank", content=b"{").status_code == 422
    cluster.set_target("canary", cluster.target(build_bad(cluster, "good", "flip", 99)))
    cluster.set_faults("canary", {"error_rate": 1.0})
    wait_until(
        lambda: all(r.faults for r in cluster.latest_reports("canary").values()),
        30,
        "canary failing its calls",
        retry_on=(Exception,),
    )
    rank_many(cluster, [f"obs-{i}" for i in range(40)])  # canary-bucketed ones fail over

    missing: list[set[str]] = [queried]

    def all_exported() -> bool:
        text = httpx.get(cluster.metrics_url, timeout=10).text
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        missing[0] = queried - names
        assert not missing[0], f"queried by the dashboard, not exported: {sorted(missing[0])}"
        return True

    wait_until(all_exported, 60, "every dashboard metric exported", retry_on=(Exception,))


def test_rollout_standby_on_an_app_without_a_fallback_exits_5(cluster: Cluster, tmp_path) -> None:
    """The installed binary, on this data-plane app (stable, canary, router; no fallback
    deployment): a not-found error naming what is missing, not a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import ray

    done = subprocess.run(
        [str(Path(sys.executable).with_name("rollout")), "standby", "--app", APP,
         "--address", ray.get_runtime_context().gcs_address, "--timeout", "60"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert "has no fallback deployment" in done.stderr and "Traceback" not in done.stderr
