"""The shadow phase on the real stack under load: candidates that are healthy but rank wrong
are stopped before any user sees them; a legitimately different one goes on to live steps.

Each scenario drives the real controller on the session's ``rollout-e2e`` application under
open-loop traffic of the live load's shape (rollout.local.traffic: 20 candidates, top 10), the same
shape ``ranker-v43``'s expected divergence was recorded with. The router
mirrors half of stable's requests to the canary; the controller judges the comparisons from
Ray's metrics. Asserted: counts (no failed request, no answer from the candidate, copies
compared), phases and the reason given, never timings.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.demo_artifacts import make_shadow_artifacts
from app.packing import PackResult
from tests.e2e.dsl import Scenario, plan
from tests.e2e.harness import BASELINE, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.shadow]

SHADOW_PLAN = plan(
    judge="sequential",
    steps=[50, 100],
    interval_s=4,
    progress_deadline_s=150,
    shadow={
        "fraction": 0.5,
        "max_in_flight": 16,
        "min_compared": 100,
        # Wider than the default 0.05, so a band is shown within a few hundred copies.
        "tolerance": 0.1,
    },
)
BAD = {
    "ranker-v41-renorm": "another training run's normalization",
    "ranker-v41-permuted": "a permuted feature order in the first layer",
}


@pytest.fixture(scope="module")
def shadow_artifacts(serve_cluster: Cluster) -> dict[str, PackResult]:
    return make_shadow_artifacts(serve_cluster.work / "shadow-store", serve_cluster.demo[BASELINE])


def shadow_of(s: Scenario) -> dict[str, Any]:
    view = s.env.status()
    return view.get("shadow") or {}


@pytest.mark.parametrize("artifact", list(BAD))
def test_a_candidate_that_ranks_wrong_is_stopped_in_shadow_before_any_user_sees_it(
    scenario: Scenario, shadow_artifacts: dict[str, PackResult], artifact: str
) -> None:
    s = scenario
    s.note(f"candidate {artifact}: stable's weights with {BAD[artifact]}")
    s.given.stable_on(BASELINE).candidate(shadow_artifacts[artifact]).steady_traffic(rate=35)
    s.when.start_rollout(artifact, SHADOW_PLAN).wait_for_event("shadow")
    # It loaded, verified and passed its dry run: only the comparison can stop it.
    s.then.expect_event("canary_ready")
    s.when.wait_for_finish(timeout=150).stop_traffic()
    s.then.expect_phase(
        "rolled_back", reason_has=("shadow divergence before any user traffic", "mean RBO")
    )
    s.then.expect_failed_requests(at_most=0).expect_no_answer_from(artifact)
    s.then.expect_no_event("step").expect_stable_target(BASELINE)
    record = s.rollout_record()
    assert record is not None
    failed = [v for v in record.verdicts if v["outcome"] == "fail"]
    s.check(
        len(failed) == 1 and failed[0]["step"] == -1,
        f"one failed shadow verdict: {record.verdicts}",
    )
    shadow = record.state["machine"]["shadow_evidence"]
    s.check(shadow["compared"] > 0, f"nothing compared: {shadow}")
    s.check("absolute limits" in shadow["basis"], f"no expectation recorded: {shadow['basis']}")
    s.note(
        f"stopped after {shadow['compared']} copies ({shadow['dropped']} dropped): "
        f"mean RBO {shadow['rbo_sum'] / shadow['compared']:.3f}"
    )
    # Mirroring was turned off on the way out.
    config = s.env.control.current_user_config("rollout-e2e", "router") or {}
    s.check(not (config.get("shadow") or {}).get("fraction_bp"), f"still mirroring: {config}")


def test_a_legitimate_candidate_passes_shadow_on_its_recorded_expectation_then_goes_live(
    scenario: Scenario, shadow_artifacts: dict[str, PackResult]
) -> None:
    s = scenario
    v43 = shadow_artifacts["ranker-v43"]
    s.given.stable_on(BASELINE).candidate(v43).steady_traffic(rate=35)
    s.when.start_rollout(v43.artifact_id, SHADOW_PLAN).wait_for_event("shadow")
    shown = s.wait("shadow progress in status", lambda: shadow_of(s).get("compared"), 60)
    s.note(f"status while shadowing: {shadow_of(s)}")
    assert shown > 0

    # What the dashboard's shadow panels plot, from the running router.
    def shadow_series() -> set[str]:
        text = httpx.get(s.env.cluster.metrics_url, timeout=10).text
        names = {
            sample.name
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("artifact") == v43.artifact_id
        }
        return names if "ray_ranker_router_shadow_rbo_sum" in names else set()

    s.wait("shadow series exported for the candidate", shadow_series, 60)
    s.when.wait_for_event("shadow_passed", timeout=150).wait_for_event("step", timeout=30)
    s.when.wait_for_answers(
        "answers from the candidate at its first live step",
        lambda r: r.artifact_id == v43.artifact_id and r.cohort == "canary",
        count=20,
    )
    record = s.rollout_record()
    assert record is not None
    shadow = record.state["machine"]["shadow_evidence"]
    s.check(
        "expected vs ranker-v41" in shadow["basis"], f"not judged on its band: {shadow['basis']}"
    )
    mean_rbo = shadow["rbo_sum"] / shadow["compared"]
    # Outside the absolute limits (it ranks differently on purpose), within its band.
    s.check(mean_rbo < 0.9, f"ranker-v43 ranks too much like stable: mean RBO {mean_rbo:.3f}")
    s.note(f"shadow passed after {shadow['compared']} copies: mean RBO {mean_rbo:.3f}")
    s.when.stop_traffic()
    s.then.expect_failed_requests(at_most=0)
