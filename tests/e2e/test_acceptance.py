"""Acceptance scenarios under steady load and faults: the failures a rollout must survive.

Each scenario drives the real controller on the ``rollout-e2e`` application
(tests/e2e/harness.py) through tests/e2e/dsl.py's Given / When / Then, under open-loop
traffic from ``rollout.local.traffic.TrafficRun`` (500 users keyed by user id, a plain client
without retries unless a scenario says otherwise), and asserts counts, never timings: failed
requests, answers by generation, cohort shares against weights, switches per user, phases and
reasons. Every scenario starts with stable on ranker-v41 and no rollout, and ends the same way.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from app.contracts import InstanceReport, RouterConfig
from app.errors import NotFound
from app.polling import wait_until
from app.registry import Registry, open_registry
from rollout.actor import get_controller
from rollout.metrics import parse_exposition
from tests import artifacts, postgres
from tests.e2e.artifact_server import GatedArtifactServer
from tests.e2e.dsl import Scenario, plan
from tests.e2e.harness import (
    BASELINE,
    CANDIDATE,
    ROLLOUT_APP,
    rank_body,
    register,
)
from tests.e2e.slow_uploads import SlowUploads, canary_users

pytestmark = [pytest.mark.e2e, pytest.mark.acceptance]


def replica_report(deployment: str) -> InstanceReport:
    """The instance report of the deployment's replica (one replica each here), asked
    directly as the router's probes do."""
    handle = serve.get_deployment_handle(deployment, app_name=ROLLOUT_APP)
    return InstanceReport.model_validate(handle.status.remote().result(timeout_s=30))


# ---------------------------------------------------------------------------------------------
# 1. Full rollout v41 -> v42 -> promotion -> rollback to v41, under steady load.


def test_full_rollout_promotion_and_rollback_lose_nothing(scenario: Scenario) -> None:
    s = scenario
    stable_ids = s.env.replica_ids("stable")
    audited = s.env.registry.history("ranker", "default", limit=1)[0].id
    # Longer steps than FAST_PLAN's so every weight has a couple of hundred requests to count
    # (two passing 3 s windows and the metrics' wait at 35 req/s): the share check below
    # sizes its tolerance to the count.
    s.given.stable_on(BASELINE).steady_traffic(rate=35)
    s.when.start_rollout(CANDIDATE, plan(interval_s=3)).wait_for_finish(timeout=180)
    s.then.expect_phase("succeeded").expect_stable_target(CANDIDATE).expect_event("finished")
    # Promotion by shift (FAST_PLAN's) moved stable by hot swap: the same replicas, with an
    # audit row for the change (the canary's generations have theirs: every answer's is
    # published, below; an earlier rollout of v42 may have published its canary target).
    said = [e["message"] for e in s.events() if e["event"] == "promoting"]
    s.check(said == [f"promoting {CANDIDATE} by shift"], f"promotion events: {said}")
    s.check(s.env.replica_ids("stable") == stable_ids, "stable's replicas were replaced")
    history = [h for h in s.env.registry.history("ranker", "default") if h.id > audited]
    s.check(
        any(h.cohort == "stable" and h.new_artifact_id == CANDIDATE for h in history),
        f"no audit row for stable -> {CANDIDATE}: {history}",
    )
    s.then.expect_no_answer(cohort="canary", artifact=BASELINE)
    s.when.wait_for_answers(
        "stable on v42",
        lambda r: (r.cohort, r.artifact_id) == ("stable", CANDIDATE),
        after="phase succeeded",
    )
    s.when.rollback_stable(BASELINE, "acceptance: back to v41")
    rollback_rev = s.found["rollback_target"]["revision"]
    s.when.wait_for_answers(
        f"stable on v41 at revision {rollback_rev}",
        lambda r: (r.cohort, r.artifact_id, r.revision) == ("stable", BASELINE, rollback_rev),
        after="stable rollback",
    ).stop_traffic()

    s.then.expect_failed_requests(at_most=0).expect_stable_target(BASELINE)
    s.then.expect_published_generations_only().expect_generations_never_go_back()
    s.then.expect_users_switch_at_most_once_per_direction()
    # Shares per weight: within 4 sigma, sigma^2 = p(1-p)(1/n + 1/500) (binomial noise of
    # n requests plus which of the 500 users the hash puts under the weight; ~0.13 at 20%
    # with ~200 answers), exact at 0% and 100%; and no request routed against its bucket.
    s.then.expect_cohort_shares_follow_weights(weights=(0, 2000, 5000, 10_000))


# ---------------------------------------------------------------------------------------------
# 2. Bad candidates: the canary never becomes ready, nothing answers from them.


def _truncated(root: Path) -> Any:
    packed = artifacts.good_artifact(root, artifact_id="ranker-truncated", seed=11)
    artifacts.truncate_file(packed, _weights_file(packed))
    return packed


def _tampered(root: Path) -> Any:
    packed = artifacts.good_artifact(root, artifact_id="ranker-tampered", seed=12)
    artifacts.flip_byte(packed, _weights_file(packed))
    return packed


def _weights_file(packed: Any) -> str:
    import json

    manifest = json.loads((packed.out_dir / "manifest.json").read_text())
    return next(f["path"] for f in manifest["files"] if f["path"].startswith("weights"))


BAD_CANDIDATES = {
    # name: (builder, the rejection category the rollout's reason must name)
    "truncated": (_truncated, "size"),
    "tampered": (_tampered, "digest"),
    "wrong_schema": (artifacts.wrong_schema_artifact, "schema"),
    "wrong_shape": (artifacts.wrong_shape_artifact, "load"),
    "nan_weights": (artifacts.nan_weights_artifact, "dry_run"),
}


@pytest.mark.parametrize("kind", list(BAD_CANDIDATES))
def test_bad_candidate_never_serves_and_fails_the_rollout(
    scenario: Scenario, kind: str, tmp_path: Path
) -> None:
    s = scenario
    build, category = BAD_CANDIDATES[kind]
    bad = build(tmp_path / "store")
    s.given.stable_on(BASELINE).candidate(bad).steady_traffic(rate=30)
    s.when.start_rollout(bad.artifact_id).wait_for_finish(timeout=120)
    s.then.expect_phase("failed", reason_has=(bad.artifact_id, f"{category}:"))
    s.when.wait_for_answers(
        "stable still answering", lambda r: r.cohort == "stable", after="phase failed"
    ).stop_traffic()

    s.then.expect_no_event("canary_ready").expect_no_answer_from(bad.artifact_id)
    s.then.expect_failed_requests(at_most=0).expect_stable_target(BASELINE)
    s.then.expect_answers_only_from("stable", BASELINE, after="rollout started")
    reports = s.env.registry.list_replica_reports("ranker", "default", cohort="canary")
    s.check(
        all(r.actual_artifact_id != bad.artifact_id for r in reports),
        f"a canary replica reports {bad.artifact_id} as actual: {reports}",
    )


# ---------------------------------------------------------------------------------------------
# 4. A candidate that passes its dry run but regresses under traffic is rolled back.


REGRESSIONS = {
    # name: (faults in the canary's rank calls, what the threshold judge's reason must name)
    "latency": ({"extra_latency_ms": 1500.0}, "canary p99"),
    "errors": ({"error_rate": 0.5}, "canary success rate"),
}
# The sequential judge (the default) on FAST_PLAN's steps, windows and hypotheses: its
# progress deadline leaves the first step time for the few hundred canary requests it takes
# to show a 1% tail within bounds at this traffic.
SEQUENTIAL = plan(judge="sequential", progress_deadline_s=150)
# What shows a canary no worse than its bounds with zero errors and no slow answer is the
# count of its requests: about 440 for "p99 <= ceiling" (1% of requests allowed over it; the
# mixture's weight on "never over" is a quarter, so (1/0.99)^n must pass 4/beta = 80), and as
# many for the success rate. Carried from step to step, so the first step pays for them. The
# evidence for the canary's latency against stable's p99 also waits for 1000 of stable's
# requests at the step (its p99 placed at that weight). At 50 requests a second, 30% is where
# the two meet: 440 canary requests at 15 a second and 1000 stable ones at 35, about 29 s each
# (at 50%: 18 s and 40 s). Two steps still carry the evidence over a step.
A_A_PLAN = plan(judge="sequential", progress_deadline_s=150, steps=[30, 100])


def judged(s: Scenario) -> tuple[int, float]:
    """Windows the finished rollout judged, and seconds from its first step to its end."""
    record = s.rollout_record()
    assert record is not None
    events = {e["event"]: float(e["at"]) for e in reversed(s.events())}
    return len(record.verdicts), events[record.phase] - events["step"]


@pytest.mark.parametrize("kind", list(REGRESSIONS))
def test_canary_regression_rolls_back_to_stable(scenario: Scenario, kind: str) -> None:
    """The same regression under both judges, one rollout each: both roll it back, the
    sequential judge on its first failing window (no consecutive-window counter) and in no
    more windows than the threshold judge."""
    s = scenario
    faults, failed_check = REGRESSIONS[kind]
    s.given.stable_on(BASELINE).canary_faults(**faults).steady_traffic(rate=35)
    s.when.start_rollout(CANDIDATE).wait_for_event("canary_ready")
    # The dry run passed (every canary replica serves v42) and the controller's target write
    # kept the injected faults beside the target.
    canary_config = s.env.control.current_user_config(ROLLOUT_APP, "canary") or {}
    s.check(
        (canary_config.get("target") or {}).get("artifact_id") == CANDIDATE
        and canary_config.get("faults") == faults,
        f"canary user_config lost a field: {canary_config}",
    )
    s.when.wait_for_finish(timeout=120)
    s.then.expect_phase("rolled_back", reason_has=("consecutive failed checks", failed_check))
    threshold_windows, threshold_s = judged(s)

    s.when.start_rollout(CANDIDATE, SEQUENTIAL).wait_for_finish(timeout=120)
    s.then.expect_phase("rolled_back", reason_has=("evidence against the canary", "e-value"))
    sequential_windows, sequential_s = judged(s)
    record = s.rollout_record()
    assert record is not None
    outcomes = [v["outcome"] for v in record.verdicts]
    s.check(outcomes.count("fail") == 1 and outcomes[-1] == "fail", f"verdicts {outcomes}")
    s.note(
        f"{kind}: threshold judge rolled back after {threshold_windows} windows "
        f"({threshold_s:.1f}s from the first step), sequential after {sequential_windows} "
        f"({sequential_s:.1f}s)"
    )
    s.check(
        sequential_windows <= threshold_windows,
        f"sequential judge needed {sequential_windows} windows, threshold {threshold_windows}",
    )
    s.when.wait_for_answers(
        "stable only", lambda r: r.cohort == "stable", after="phase rolled_back"
    )
    s.when.stop_traffic()

    s.then.expect_router_weight(0).expect_stable_target(BASELINE)
    s.then.expect_answers_only_from("stable", BASELINE, after="phase rolled_back")
    # The router fails a canary error over to stable: no client sees it.
    s.then.expect_failed_requests(at_most=0)
    failovers = sum(r.failover for r in s.records or [])
    s.note(f"failovers absorbed: {failovers}")
    if kind == "errors":
        s.check(failovers > 0, "the canary's injected errors never reached the router")


def _twin_of_baseline(root: Path) -> Any:
    """ranker-v41's very bytes (the same seed) packed as another artifact: an A/A rollout."""
    from app.demo_artifacts import DEMO_MODEL, FEATURE_SCHEMA, write_ranker_source
    from app.packing import pack_artifact

    write_ranker_source(root / "src", seed=41, evaluation={"ndcg_at_10": 0.412, "auc": 0.781})
    return pack_artifact(
        root / "src",
        root / "out",
        model=DEMO_MODEL,
        artifact_id="ranker-v41-twin",
        feature_schema=FEATURE_SCHEMA,
    )


def test_sequential_judge_promotes_an_a_a_rollout_and_exports_its_evidence(
    scenario: Scenario, tmp_path: Path
) -> None:
    s = scenario
    twin = _twin_of_baseline(tmp_path)
    s.given.stable_on(BASELINE).candidate(twin).steady_traffic(rate=50)
    # Slow uploads aimed at the canary: one a second, its body 3.5 s on the way, from users
    # in the canary at 20% (and so at every step). At 15 canary answers a second (30% of 50),
    # the two in each 2 s window would put its p99 over the 3000 ms ceiling, were the upload
    # counted as the canary's latency (it was: an audit got good candidates rolled back this
    # way).
    salt = (s.env.control.current_user_config(ROLLOUT_APP, "router") or {}).get(
        "salt", RouterConfig().salt
    )
    uploads = SlowUploads(s.env.url, canary_users(salt, 2000, 20), pause_s=3.5, every_s=1.0).start()
    try:
        s.when.start_rollout(twin.artifact_id, A_A_PLAN).wait_for_finish(timeout=300)
    finally:
        slow = uploads.stop()
    s.then.expect_phase("succeeded").expect_stable_target(twin.artifact_id)
    s.check(all(u.status == 200 for u in slow), f"slow uploads refused: {slow}")
    to_canary = [u for u in slow if u.cohort == "canary" and u.seconds >= 3.5]
    s.check(len(to_canary) >= 10, f"too few slow uploads reached the canary: {slow}")
    s.note(f"{len(to_canary)} slow uploads answered by the canary during the rollout")
    record = s.rollout_record()
    assert record is not None
    passes = [v for v in record.verdicts if v["outcome"] == "pass"]
    s.check(
        len(passes) == len(A_A_PLAN["steps"]), f"one passing window per step: {record.verdicts}"
    )
    s.check(all(v["outcome"] != "fail" for v in record.verdicts), f"failed: {record.verdicts}")
    for verdict in passes:
        s.check(
            all(
                "within bound: e-value" in r or r == "no stable traffic to compare"  # at 100%
                for r in verdict["reasons"]
            ),
            f"a pass not explained by its evidence: {verdict['reasons']}",
        )
        s.check(
            {e["check"] for e in verdict["evidence"]} >= {"success_rate", "p99_ceiling"},
            f"evidence missing from the record: {verdict['evidence']}",
        )
    s.note(f"A/A promoted after {len(record.verdicts)} windows")

    # What the dashboard's evidence panel plots, from the running controller: the evidence
    # and its bounds per check and side, set back to 1 (no evidence) now the rollout is over.
    def exported(name: str) -> dict[tuple[str, str, str], float]:
        text = httpx.get(s.env.cluster.metrics_url, timeout=10).text
        return {
            (sample.labels.get("model", ""), sample.labels.get("check", ""),
             sample.labels.get("side", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        }  # fmt: skip

    def evidence_after_the_end() -> dict[tuple[str, str, str], float] | None:
        # Per exporting process (the labels Ray adds): a controller killed by an earlier
        # test of the session may linger in the node's export with the values it died on.
        text = httpx.get(s.env.cluster.metrics_url, timeout=10).text
        by_process: dict[frozenset, dict[tuple[str, str, str], float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != "ray_ranker_rollout_evidence":
                    continue
                labels = dict(sample.labels)
                key = tuple(labels.pop(k, "") for k in ("model", "check", "side"))
                by_process.setdefault(frozenset(labels.items()), {})[key] = sample.value
        for found in by_process.values():
            if ("ranker", "success_rate", "for") in found and set(found.values()) == {1.0}:
                return found
        return None

    series = s.wait("evidence gauges exported, at 1 after the end", evidence_after_the_end, 90)
    s.check(("ranker", "sample_ratio", "against") in series, f"no sample-ratio series: {series}")
    bounds = exported("ray_ranker_rollout_evidence_bound")
    s.check(set(bounds) >= set(series), f"bounds missing: {set(series) - set(bounds)}")
    fail_at = bounds.get(("ranker", "success_rate", "against"), 0.0)
    pass_at = bounds.get(("ranker", "success_rate", "for"), 0.0)
    s.check(fail_at > pass_at > 1, f"the bounds exported: {bounds}")
    s.when.stop_traffic()
    s.then.expect_failed_requests(at_most=0)


# ---------------------------------------------------------------------------------------------
# 6. Controller killed and restarted; duplicate and late target notifications; then KubeRay
# resubmits its cached serveConfigV2 mid-rollout (an operator restart, a new head pod): the
# targets and weights the controller set are replaced by the manifest's. One rollout, held at
# a gate, goes through both and then on to promotion (each had a rollout of its own before).


DRIFT_REPAIRS = "ray_ranker_rollout_drift_repairs_total"


def drift_repairs_by_process(s: Scenario) -> dict[frozenset, float]:
    """The controllers' ``canary.target`` drift repairs, per exporting process (what an alert
    on drift reads; a controller killed earlier may linger in the node's export)."""
    text = httpx.get(s.env.cluster.metrics_url, timeout=10).text
    found: dict[frozenset, float] = {}
    for (_, labels), value in parse_exposition(text, [DRIFT_REPAIRS]).items():
        rest = dict(labels)
        if rest.pop("drift", "") == "canary.target":
            key = frozenset(rest.items())
            found[key] = found.get(key, 0.0) + value
    return found


def test_controller_restart_late_notifications_and_a_resubmitted_config_converge(
    scenario: Scenario,
) -> None:
    s = scenario
    gated = plan(gates={"pause_before_steps": [50]})
    s.given.stable_on(BASELINE).steady_traffic(rate=35)
    # What KubeRay holds: the config as deployed before the rollout (no canary target, the
    # router at 0%, stable at the registry's revision).
    deployed = s.env.control.declarative_config()
    s.when.start_rollout(CANDIDATE, gated).wait_for_phase("paused")
    canary_target = s.env.registry.get_target("ranker", "default", "canary")
    before = replica_report("canary")

    # ---- the controller killed; duplicate and late notifications while it is gone
    s.when.kill_controller()
    # Duplicate notifications: the same config PUT again (Serve: nothing to do), then a change
    # of another field that hands the replica the same target again (it must not reload).
    original_interval = (s.env.control.current_user_config(ROLLOUT_APP, "canary") or {})[
        "report_interval_s"
    ]
    s.when.reput_same_config().edit_user_config("canary", report_interval_s=0.4)
    s.on_cleanup(
        "canary report interval",
        lambda: s.when.edit_user_config("canary", report_interval_s=original_interval),
    )
    # A late notification: an older revision (the baseline artifact) arrives after the newer.
    # On a new registry (this test run alone) the canary's revision is 1 and the late one 0,
    # a target every replica refuses: the replica keeps its model all the same, and the
    # controller's repair replaces the target it cannot parse (rollout/serve_port.py).
    late = {
        "revision": canary_target.revision - 1,
        "artifact_id": BASELINE,
        "manifest_uri": s.env.cluster.demo[BASELINE].manifest_uri,
        "manifest_sha256": s.env.cluster.demo[BASELINE].manifest_sha256,
        "feature_schema": canary_target.feature_schema,
    }
    s.when.edit_user_config("canary", target=late)
    late_config = s.env.control.current_user_config(ROLLOUT_APP, "canary")
    s.when.wait_until(
        "canary replica reconfigured with the late target",
        lambda: s.env.control.wait_applied(
            ROLLOUT_APP, "canary", user_config=late_config, timeout_s=5
        ),
    )
    report = replica_report("canary")
    s.check(
        (report.desired_revision, report.actual_revision)
        == (canary_target.revision, canary_target.revision),
        f"the canary replica took the late target: {report}",
    )
    s.when.wait_for_answers(
        "canary still answering on v42",
        lambda r: (r.cohort, r.artifact_id) == ("canary", CANDIDATE),
        count=10,
        after="controller killed",
    )

    s.when.start_controller()
    s.check(
        any("canary target" in line for line in s.found["repaired"]),
        f"the restarted controller did not repair the late canary target: {s.found['repaired']}",
    )
    s.when.wait_for_phase("paused")  # resumed where it was
    after = replica_report("canary")
    s.check(
        (after.actual_artifact, after.actual_revision, after.timings)
        == (before.actual_artifact, before.actual_revision, before.timings),
        f"the canary replica reloaded or moved: before {before}, after {after}",
    )
    served = (s.env.control.current_user_config(ROLLOUT_APP, "canary") or {}).get("target") or {}
    s.check(
        (served.get("artifact_id"), served.get("revision")) == (CANDIDATE, canary_target.revision),
        f"Serve's canary target not repaired: {served}",
    )

    # ---- KubeRay resubmits the config it holds, from before the rollout
    repairs_before = drift_repairs_by_process(s)
    s.when.resubmit(deployed)

    def since_resubmitted(event: str) -> list[str]:
        return [
            e["message"]
            for e in s.events()
            if e["event"] == event
            and s.wall_to_traffic(float(e["at"])) >= s.marks["config resubmitted"] - 1.0
        ]

    s.wait("a drift event after the resubmission", lambda: since_resubmitted("drift"))
    s.wait("drift restored after it", lambda: since_resubmitted("drift_restored"))
    drift = since_resubmitted("drift")
    s.check(
        any(f"canary target -> {CANDIDATE} (rev {canary_target.revision})" in m for m in drift),
        f"the drift event does not name the canary target put back: {drift}",
    )
    s.check(
        any("withdrawn" in m for m in drift),
        f"the canary weight was not withdrawn while the canary reloaded: {drift}",
    )
    s.when.wait_until(
        "Serve's config repaired (canary target and 20% back)",
        lambda: (
            (
                (s.env.control.current_user_config(ROLLOUT_APP, "canary") or {}).get("target") or {}
            ).get("revision")
            == canary_target.revision
            and (s.env.control.current_user_config(ROLLOUT_APP, "router") or {}).get("canary_bp")
            == 2000
        ),
        timeout=60,
    )
    s.when.wait_for_answers(
        "canary answering on v42 again",
        lambda r: (r.cohort, r.artifact_id) == ("canary", CANDIDATE),
        count=10,
        after="config resubmitted",
    )
    s.when.wait_for_phase("paused")  # still at the gate: nothing was judged or skipped

    # What an alert on drift reads: the running controller's counter, by what drifted (the
    # restart's own repair counted one already: this one must add to it).
    def counted_again() -> dict[frozenset, float] | None:
        now = drift_repairs_by_process(s)
        grew = any(v > repairs_before.get(k, 0.0) for k, v in now.items())
        return now if grew else None

    repairs = s.wait("the resubmission's repair exported by the controller", counted_again, 60)
    s.note(f"canary.target drift repairs exported: {sorted(repairs.values())}")

    s.when.command("resume").wait_for_finish(timeout=150)
    s.when.stop_traffic()
    s.then.expect_phase("succeeded").expect_stable_target(CANDIDATE)
    s.then.expect_failed_requests(at_most=0).expect_published_generations_only()
    s.then.expect_generations_never_go_back()
    s.then.expect_no_answer(cohort="canary", artifact=BASELINE)


# ---------------------------------------------------------------------------------------------
# 3. A slow canary load overtaken by a rollback and a newer target never installs.


def test_slow_candidate_overtaken_by_rollback_never_installs(
    scenario: Scenario, tmp_path: Path
) -> None:
    s = scenario
    store = tmp_path / "http-store"
    slow = artifacts.good_artifact(store, artifact_id="ranker-slow", seed=21)
    server = GatedArtifactServer(store)
    s.on_cleanup("gated artifact store", server.close)
    server.hold("ranker-slow")  # its files wait at the gate until released
    s.given.stable_on(BASELINE).candidate(slow, manifest_uri=server.manifest_uri("ranker-slow"))
    s.given.steady_traffic(rate=30)

    s.when.start_rollout(slow.artifact_id).wait_until(
        "canary download of ranker-slow held at the store",
        lambda: server.waiting("ranker-slow") >= 1,
    )
    slow_rev = s.env.registry.get_target("ranker", "default", "canary").revision
    s.when.command("rollback", "operator: the candidate takes too long").wait_for_finish()
    s.then.expect_phase("rolled_back", reason_has=("the candidate takes too long",))
    # A newer canary target (a rollout of v42, at a higher revision) while the slow download
    # is still held; it holds at a gate once the canary is ready.
    s.when.start_rollout(CANDIDATE, plan(gates={"pause_before_steps": [20]})).wait_until(
        "canary target published for v42",
        lambda: s.env.registry.get_target("ranker", "default", "canary").artifact_id == CANDIDATE,
    )
    newer_rev = s.env.registry.get_target("ranker", "default", "canary").revision
    s.when.wait_until(
        "canary replica desires the newer target",
        lambda: replica_report("canary").desired_revision == newer_rev,
    )
    s.check(server.waiting("ranker-slow") >= 1, "the slow download was not held")
    server.release("ranker-slow")
    s.when.wait_for_phase("paused")  # the canary serves v42: ready
    report = replica_report("canary")
    s.check(
        # Stopped at its first chunk once released (or, had it been done, loaded and dropped).
        slow_rev in report.cancelled_revisions + report.discarded_revisions
        and (report.actual_artifact, report.actual_revision) == (CANDIDATE, newer_rev),
        f"ranker-slow (rev {slow_rev}) was not dropped, or v42 not installed: {report}",
    )
    s.when.command("abort", "acceptance: done").wait_for_finish()
    s.when.stop_traffic()

    s.then.expect_phase("aborted").expect_no_answer_from(slow.artifact_id)
    s.then.expect_failed_requests(at_most=0).expect_stable_target(BASELINE)
    reports = s.env.registry.list_replica_reports("ranker", "default", cohort="canary")
    s.check(
        all(r.actual_artifact_id != slow.artifact_id for r in reports),
        f"a canary replica reports ranker-slow as actual: {reports}",
    )


# ---------------------------------------------------------------------------------------------
# 5. Killed replicas: failover absorbs them, Serve replaces them, capacity comes back.


def _replaced(s: Scenario, deployment: str, artifact: str) -> bool:
    """A RUNNING replica of ``deployment`` other than the killed one, reporting ``artifact``
    as both desired and actual (its startup load finished before it ran)."""
    killed = s.found["killed"][deployment]
    running = s.env.replica_ids(deployment) - {killed}
    assert running, f"no new {deployment} replica running yet"
    view = {r["replica"]: r for r in s.env.status()["replicas"]}
    for rid in running:
        r = view.get(rid)
        assert r and (r["desired"], r["actual"]) == (artifact, artifact), f"{rid}: {r}"
    return True


def test_killed_canary_and_stable_replicas_cost_no_request(scenario: Scenario) -> None:
    s = scenario
    # Held at 20% by a gate, with a threshold no test window reaches: this scenario is about
    # replica deaths, not about the judge.
    held = plan(gates={"pause_before_steps": [50]}, threshold=1000)
    s.given.stable_on(BASELINE).steady_traffic(rate=30, timeout_s=60)
    s.when.start_rollout(CANDIDATE, held).wait_for_phase("paused")
    s.when.wait_for_answers(
        "canary answering", lambda r: r.cohort == "canary", count=10, after="phase paused"
    )

    s.when.kill_replica("canary").wait_until(
        "a new canary replica serving v42", lambda: _replaced(s, "canary", CANDIDATE), 120
    )
    s.mark("canary replaced")
    s.when.wait_for_answers(
        "canary answering again",
        lambda r: (r.cohort, r.failover) == ("canary", False),
        count=10,
        after="canary replaced",
    )
    s.when.kill_replica("stable").wait_until(
        "a new stable replica serving v41", lambda: _replaced(s, "stable", BASELINE), 120
    )
    s.mark("stable replaced")
    s.when.wait_for_answers(
        "stable answering again",
        lambda r: (r.cohort, r.failover) == ("stable", False),
        count=10,
        after="stable replaced",
    )
    s.when.command("abort", "acceptance: done").wait_for_finish().stop_traffic()

    # Failover (the other cohort serves a verified model) absorbs both deaths.
    s.then.expect_failed_requests(at_most=0).expect_published_generations_only()
    s.then.expect_phase("aborted").expect_stable_target(BASELINE)
    s.note(f"failovers: {sum(r.failover for r in s.records or [])}")


# ---------------------------------------------------------------------------------------------
# 7. Draining and scale-down during a traffic shift.


def test_drain_and_scale_down_during_a_shift_lose_no_retried_request(scenario: Scenario) -> None:
    s = scenario
    # Held at 20% by an operator pause, with a threshold no test window reaches: this scenario
    # is about draining and scaling, not about the judge.
    # A slow canary keeps requests in flight when the drain begins: at 300 ms a CI run once
    # had no canary request started in the 0.5 s before it (about 1 in 20 runs by chance).
    s.given.stable_on(BASELINE).canary_faults(extra_latency_ms=1000.0)
    s.given.steady_traffic(rate=30).retrying_clients(concurrency=4)
    s.when.start_rollout(CANDIDATE, plan(threshold=1000)).wait_for_weight(2000)
    s.when.command("pause", "acceptance: hold the shift").wait_for_phase("paused")
    s.when.wait_for_answers(
        "slow canary answering", lambda r: r.cohort == "canary", count=10, after="phase paused"
    )

    s.on_cleanup("router draining off", lambda: s.when.edit_user_config("router", draining=False))
    s.when.edit_user_config("router", draining=True)
    s.mark("draining")
    s.when.wait_for_answers("503 while draining", lambda r: r.status == 503, after="draining")
    refused = httpx.post(f"{s.env.url}/v1/rank", json=rank_body("probe-user"), timeout=30)
    s.check(
        refused.status_code == 503 and refused.headers.get("retry-after", "").isdigit(),
        f"draining answer: {refused.status_code} {dict(refused.headers)}",
    )
    s.when.edit_user_config("router", draining=False)
    s.mark("undrained")
    s.when.wait_for_answers("answers after draining", lambda r: r.status == 200, after="undrained")
    # Scale-down while stable carries 80% of the traffic: the removed replica finishes what
    # it holds (graceful shutdown), new requests go to the one left.
    s.on_cleanup("stable back to 1 replica", lambda: s.when.scale("stable", 1))
    s.when.scale("stable", 2).scale("stable", 1)
    s.when.wait_for_answers(
        "stable answering after the scale-down",
        lambda r: r.cohort == "stable",
        after="stable scaled to 1",
    )
    s.when.command("abort", "acceptance: done").wait_for_finish().stop_traffic()

    records = s.records or []
    refusals = [r for r in records if not 200 <= r.status < 300]
    answered_at = {id(r): r.start_s + r.latency_ms / 1000 for r in records}
    # The plain client saw 503 "draining" (with Retry-After, above) and nothing else, each
    # answered while the router drained (a refusal is answered on arrival; the undrain takes
    # a moment to reach the router).
    s.check(
        all(r.status == 503 and "draining" in (r.error or "") for r in refusals)
        and all(
            s.marks["draining"] <= answered_at[id(r)] <= s.marks["undrained"] + 5 for r in refusals
        ),
        f"unexpected failures: {refusals[:5]}",
    )
    first_refusal = min(answered_at[id(r)] for r in refusals)
    crossed = [
        r for r in records if r.status == 200 and r.start_s < first_refusal < answered_at[id(r)]
    ]
    s.check(bool(crossed), "no request was in flight when the router began to refuse")
    calls = s.found["retrying"].records
    retried = [c for c in calls if c.attempts > 1]
    failed = [c for c in calls if c.status != 200]
    s.note(
        f"plain client: {len(records)} requests, {len(refusals)} refused with 503 while "
        f"draining, {len(crossed)} in flight across the first refusal answered 200; retrying "
        f"client: {len(calls)} calls, {len(retried)} retried, {len(failed)} failed"
    )
    s.check(not failed, f"the retrying client failed {len(failed)} calls: {failed[:3]}")
    s.check(bool(retried), "no retrying call met the drain")
    s.then.expect_phase("aborted").expect_stable_target(BASELINE)


# ---------------------------------------------------------------------------------------------
# 8. The registry (PostgreSQL) goes down mid-rollout and comes back.


def mirror_targets(source: Registry, dest: Registry, artifacts_ids: tuple[str, str]) -> None:
    """Bring ``dest``'s targets up to ``source``'s revisions, ending on the same artifacts
    (publishing the two artifacts alternately): replicas ignore lower revisions than they
    have seen, so a registry that takes over must not start below them."""
    for cohort in ("stable", "canary"):
        try:
            wanted = source.get_target("ranker", "default", cohort)
        except NotFound:
            continue
        try:
            revision = dest.get_target("ranker", "default", cohort).revision
        except NotFound:
            revision = 0
        other = next(a for a in artifacts_ids if a != wanted.artifact_id)
        while revision < wanted.revision:
            artifact = wanted.artifact_id if (wanted.revision - revision) % 2 == 1 else other
            dest.publish(
                "ranker", "default", cohort, artifact, revision, actor="acceptance",
                reason="registry takes over at the same revisions",
            )  # fmt: skip
            revision += 1


def test_registry_down_holds_the_rollout_and_serving_goes_on(scenario: Scenario) -> None:
    s = scenario
    env = s.env
    server = postgres.start_server()
    s.on_cleanup("PostgreSQL server", lambda: postgres.stop_server(server))
    url = server.create_database("rollout_acceptance")
    pg = open_registry(url)
    s.on_cleanup("PostgreSQL registry", pg.close)
    for name in (BASELINE, CANDIDATE):
        register(pg, env.cluster.demo[name])
    mirror_targets(env.registry, pg, (BASELINE, CANDIDATE))

    # One controller per cluster: the SQLite one goes, a PostgreSQL one takes over; the
    # cleanup brings the SQLite one back, its registry brought up to what replicas saw.
    s.when.kill_controller()

    def restore() -> None:
        if not server.is_running():
            server.start()
        handle = get_controller()
        if handle is not None:
            ray.kill(handle, no_restart=True)
            wait_until(
                lambda: get_controller() is None,
                30,
                "PostgreSQL controller gone",
                retry_on=(Exception,),
            )
        mirror_targets(pg, env.registry, (BASELINE, CANDIDATE))
        s.env = env
        ray.get(env.controller.reconcile.remote(), timeout=60)

    s.on_cleanup("SQLite controller back", restore)
    s.env = dataclasses.replace(
        env, registry=pg, settings=env.settings.model_copy(update={"registry_url": url})
    )
    s.when.start_controller()

    s.given.stable_on(BASELINE).steady_traffic(rate=30)
    # The outage outlasts the progress deadline: a rollout that counted it would roll back.
    # 10 s: room for three of the step's 2 s windows (about 12 canary requests each at 20% of
    # 30 a second, against min_requests 5) on a busy machine, and an outage of 15 s.
    deadline_s = 10
    # Two steps: the outage falls in the first; the gate before the second shows that the
    # rollout went on after it (its 20% window judged) without another step's window.
    s.when.start_rollout(
        CANDIDATE,
        plan(steps=[20, 100], gates={"pause_before_steps": [100]}, progress_deadline_s=deadline_s),
    )
    s.when.wait_for_phase("progressing")
    ticks = ray.get(get_controller().ping.remote(), timeout=30)["ticks"]
    server.stop()
    s.mark("registry down")
    down_at = time.monotonic()
    # Two ticks end while it is down (at least one ran wholly without the registry), and the
    # outage lasts longer than the step's progress deadline.
    s.when.wait_until(
        "controller ticked twice without its registry, past the progress deadline",
        lambda: (
            time.monotonic() - down_at > deadline_s + 5
            and ray.get(get_controller().ping.remote(), timeout=30)["ticks"] >= ticks + 2
        ),
        240,
    )
    held = s.env.status()["held"]
    s.check(held is not None and "registry" in held["reason"], f"rollout not held: {held}")
    s.when.wait_for_answers(
        "serving while the registry is down", lambda r: r.status == 200, after="registry down"
    )
    server.start()
    s.mark("registry back")
    # Up once pg_ctl's start returns; the first reads may still go to a pool that reconnects.
    s.when.wait_until("registry answering again", lambda: pg.list_targets("ranker", "default"))
    s.when.wait_for_phase("paused", timeout=240)  # resumed: step 20% judged
    s.when.command("abort", "acceptance: done").wait_for_finish().stop_traffic()

    # A second inside each end: the controller may reach PostgreSQL a moment before pg_ctl
    # (and so this test) knows it is back, and act at once.
    outage = (s.marks["registry down"] + 1.0, s.marks["registry back"] - 1.0)
    events = s.events()
    # The hold's own two events bracket the outage.
    during = [
        e
        for e in events
        if outage[0] < s.wall_to_traffic(float(e["at"])) < outage[1]
        and e["event"] not in ("held", "resumed")
    ]
    s.check(not during, f"the rollout changed while its registry was down: {during}")
    s.check(
        [e["event"] for e in events if e["event"] in ("held", "resumed")] == ["held", "resumed"],
        f"no held/resumed pair in the rollout's events: {events}",
    )
    errors = s.env.status()["errors"]
    s.check(any("registry" in e for e in errors), f"no registry error seen: {errors}")
    s.then.expect_failed_requests(at_most=0).expect_phase("aborted")
    s.then.expect_cohort_shares_follow_weights(weights=(2000,))
