"""``rollout demo``: the whole system on embedded defaults, end to end, under load.

Local Ray + Serve on free ports, an SQLite registry, a local artifact store. It packs and
registers ranker-v41 and the shadow phase's candidates, deploys with v41 stable and drives
steady synthetic traffic. First a candidate with v41's weights and a feature-order bug (it
loads, verifies and passes its dry run) is rolled out: its shadow phase compares its rankings
with stable's on mirrored requests and stops it before any user is answered by it. Then
ranker-v43, whose divergence from v41 was recorded offline (``rollout replay``), passes its
shadow phase on that expectation and is rolled out step by step with analysis and promoted;
then stable is rolled back to v41 on request. It prints progress while it runs, then a
summary, writes a timeline picture, and ends with one JSON line. Exit status 1 if any request
failed or the story did not end as told.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from app.polling import wait_until
from rollout.local.stack import BASELINE, LocalStack
from rollout.local.traffic import (
    RequestRecord,
    TrafficRun,
    TrafficSpec,
    cohort_share,
    plot_timeline,
    summarize,
)

DEMO_PLAN: dict[str, Any] = {
    # The default judge: evidence over the rollout. Its first step takes the few hundred canary
    # requests that showing a 1% tail within bounds needs; later steps pass on a window each.
    "judge": "sequential",
    "steps": [20, 50, 100],
    "interval_s": 5,
    "min_requests": 8,
    "progress_deadline_s": 180,
    "promotion": "shift",
    # A shared 2-core machine is noisy: absolute ceilings and ratios leave room for that.
    "checks": {
        "success_rate_min": 0.99,
        "p99_max_ms": 2000,
        "error_rate_max_ratio": 3.0,
        "error_rate_floor": 0.01,
        "p99_max_ratio": 3.0,
        "p99_slack_ms": 100,
    },
    "canary_scaling": {"min_replicas": 1, "max_replicas": 1, "idle_replicas": 1},
    # Before the first step: half of stable's requests copied to the canary and compared.
    # The tolerance is wider than the default 0.05, so the demo's few hundred copies a
    # window show a candidate within its band in a few windows.
    "shadow": {"fraction": 0.5, "max_in_flight": 16, "min_compared": 100, "tolerance": 0.1},
}
# The candidate stopped in its shadow phase, and the one rolled out.
BROKEN_CANDIDATE = "ranker-v41-permuted"
CANDIDATE = "ranker-v43"


@dataclass
class Timeline:
    """What the demo saw of the controller, on the traffic's clock (seconds since start)."""

    clock: Callable[[], float]
    weights: list[tuple[float, float]] = field(default_factory=list)
    phases: list[tuple[float, str]] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)  # the demo's own steps

    def observe(self, view: dict[str, Any]) -> bool:
        now = self.clock()
        changed = False
        bp = (view.get("weights") or {}).get("canary_bp", 0)
        if not self.weights or self.weights[-1][1] != bp / 100:
            self.weights.append((now, bp / 100))
            changed = True
        phase = view.get("phase") or "idle"
        if phase == "progressing":
            phase = f"step {view.get('step', 0) + 1} ({view.get('step_percent')}%)"
        if not self.phases or self.phases[-1][1] != phase:
            self.phases.append((now, phase))
            changed = True
        return changed

    def mark(self, label: str) -> None:
        self.marks.append((self.clock(), label))

    def labels(self) -> list[tuple[float, str]]:
        return sorted(self.phases + self.marks)

    def adopt_events(self, events: list[dict[str, Any]], started_at: float) -> None:
        """Replace what polling saw with the controller's own record of when it set each
        weight and entered each phase (polling lags when the machine is busy)."""
        weights = [self.weights[0]] if self.weights else []
        phases = [self.phases[0]] if self.phases else []
        for event in events:
            t = float(event["at"]) - started_at
            if event["event"] == "weights" and event.get("canary_bp") is not None:
                weights.append((t, event["canary_bp"] / 100))
            elif event["event"] == "step":
                # The machine counts steps from 0; people (and `rollout status`) from 1.
                found = re.search(r"step (\d+) \((.*)\)", event["message"])
                label = f"step {int(found[1]) + 1} ({found[2]})" if found else event["message"]
                phases.append((t, label))
            elif event["event"] not in ("analysis", "weights", "created", "command_ignored"):
                phases.append((t, event["event"]))
        self.weights = weights
        self.phases = phases


def _echo(message: str) -> None:
    click.echo(message, err=True)


def step_shares(
    records: list[RequestRecord], weights: list[tuple[float, float]], settle_s: float = 1.0
) -> list[dict[str, Any]]:
    """Observed canary share during each weight segment (after ``settle_s`` of propagation)."""
    rows = []
    for i, (start, percent) in enumerate(weights):
        end = weights[i + 1][0] if i + 1 < len(weights) else float("inf")
        share = cohort_share(records, start + settle_s, end)
        n = sum(1 for r in records if start + settle_s <= r.start_s < end and r.cohort)
        rows.append(
            {
                "canary_weight_pct": percent,
                "from_s": round(start, 1),
                "to_s": None if end == float("inf") else round(end, 1),
                "requests": n,
                "canary_share_pct": round(100 * share.get("canary", 0.0), 1) if n else None,
            }
        )
    return rows


def shadow_line(view: dict[str, Any]) -> str:
    shadow = view.get("shadow") or {}
    compared = shadow.get("compared") or 0
    rbo = shadow.get("rbo_mean")
    top1 = shadow.get("top1_change_rate")
    return (
        f"{compared} copies compared, {shadow.get('dropped', 0)} dropped"
        + (f", mean RBO {rbo:.3f}" if rbo is not None else "")
        + (f", top-1 changed {top1 * 100:.1f}%" if top1 is not None else "")
        + f" | gate: {shadow.get('basis', '-')}"
    )


def run_demo(workdir: Path, *, rate: float, keep: bool) -> int:
    from app.demo_artifacts import make_shadow_artifacts

    started = time.monotonic()
    stack = LocalStack.up(workdir, fresh=not keep, echo=_echo)
    workdir = stack.workdir
    run: TrafficRun | None = None
    try:
        shadow_packed = make_shadow_artifacts(workdir / "artifacts", stack.packed[BASELINE])
        for artifact_id in (BROKEN_CANDIDATE, CANDIDATE):
            stack.register(shadow_packed[artifact_id])
            _echo(f"   registered + approved {artifact_id} "
                  f"({shadow_packed[artifact_id].manifest_sha256[:12]}...)")  # fmt: skip

        def status() -> dict[str, Any]:
            return stack.call("status")

        _echo(f"== steady traffic: {rate:g} requests/s from 1000 users")
        run = TrafficRun(
            TrafficSpec(
                url=stack.cluster.http_url, rate=rate, concurrency=16, max_requests=100_000,
                max_seconds=260,
            )
        ).start()  # fmt: skip
        wait_until(lambda: len(run.records) >= 20, 60, "first answers")
        timeline = Timeline(clock=run.now_s)
        timeline.observe({"weights": {"canary_bp": 0}, "phase": f"stable {BASELINE}"})

        _echo(f"== rollout of {BROKEN_CANDIDATE} (v41's weights, a feature-order bug in its "
              "first layer: it loads, verifies and passes its dry run)")  # fmt: skip
        stack.call("start_rollout", BROKEN_CANDIDATE, DEMO_PLAN, "demo")

        def broken_done() -> bool:
            view = status()
            timeline.observe(view)
            return bool(view.get("finished"))

        wait_until(broken_done, 90, f"the shadow phase to stop {BROKEN_CANDIDATE}", every=0.5)
        broken = status()
        timeline.mark(f"{BROKEN_CANDIDATE} stopped in shadow")
        _echo(f"   {broken.get('phase')}: {broken.get('reason')}")
        _echo(f"   shadow: {shadow_line(broken)}")
        broken_answers = sum(1 for r in run.records if r.artifact_id == BROKEN_CANDIDATE)
        _echo(f"   answers to users from {BROKEN_CANDIDATE}: {broken_answers}")

        _echo(f"== rollout of {CANDIDATE} (steps {DEMO_PLAN['steps']}%, "
              f"{DEMO_PLAN['interval_s']}s windows)")  # fmt: skip
        stack.call("start_rollout", CANDIDATE, DEMO_PLAN, "demo")

        verdicts_shown = 0
        shadow_shown = False

        def progress() -> bool:
            nonlocal verdicts_shown, shadow_shown
            view = status()
            if not shadow_shown and view.get("phase") not in ("pending", "preparing", "shadowing"):
                if view.get("shadow"):
                    _echo(f"       shadow passed: {shadow_line(view)}")
                shadow_shown = True
            if timeline.observe(view):
                recent = [r for r in run.records if r.start_s >= run.now_s() - 2]
                share = cohort_share(recent, 0, float("inf")).get("canary", 0.0)
                failed = sum(1 for r in run.records if not 200 <= r.status < 300)
                w = view.get("weights") or {}
                _echo(
                    f"   [{run.now_s():6.1f}s] {view.get('phase'):<12} "
                    f"step {view.get('step', -1) + 1}/{len(view.get('steps') or [])} "
                    f"weights stable {w.get('stable_bp', 0) / 100:g}% "
                    f"canary {w.get('canary_bp', 0) / 100:g}% | canary share (2s) "
                    f"{100 * share:.0f}% | {len(run.records)} requests, {failed} failed"
                )
            verdicts = view.get("verdicts") or []
            for verdict in verdicts[verdicts_shown:]:
                _echo(f"       verdict: {verdict['outcome']}: {'; '.join(verdict['reasons'])}")
            verdicts_shown = len(verdicts)
            return bool(view.get("finished"))

        wait_until(progress, 180, "the rollout to finish", every=0.5)
        final = status()
        final_phase = final.get("phase")
        _echo(f"== rollout finished: {final_phase} ({final.get('reason')})")

        _echo(f"== rolling stable back to {BASELINE} on request")
        rollback_at = run.now_s()
        timeline.mark("rollback requested")
        target = stack.call("rollback_stable", BASELINE, "demo", "demo: rollback on request")

        def back_on_baseline() -> bool:
            recent = [r for r in run.records if r.start_s >= run.now_s() - 1.5 and r.artifact_id]
            return len(recent) >= 10 and all(r.artifact_id == BASELINE for r in recent)

        wait_until(back_on_baseline, 60, f"every answer coming from {BASELINE}")
        rollback_s = run.now_s() - rollback_at
        timeline.mark(f"stable {BASELINE} again")
        _echo(f"   all traffic on {BASELINE} (revision {target['revision']}) "
              f"{rollback_s:.1f}s after the request")  # fmt: skip
        time.sleep(2)  # a little steady traffic on the restored baseline for the picture
        records = run.stop()
        assert run.started_at is not None
        rollout = stack.registry.list_rollouts("ranker", "default", limit=1)[0]
        timeline.adopt_events(rollout.state.get("events", []), run.started_at)
        run = None
        current_stable = stack.registry.get_target("ranker", "default", "stable").artifact_id
    finally:
        if run is not None:
            run.stop()
        stack.down()

    summary = summarize(records)
    shares = step_shares(records, timeline.weights)
    picture = plot_timeline(
        records,
        workdir / "timeline.png",
        weights=timeline.weights,
        phases=timeline.labels(),
        title=f"rollout demo: {BROKEN_CANDIDATE} stopped in shadow; {BASELINE} -> {CANDIDATE} "
        "-> rollback",
    )
    (workdir / "records.json").write_text(json.dumps([r.__dict__ for r in records]))

    _echo("== summary")
    _echo(f"   requests {summary.requests}, non-2xx {summary.non_2xx}, "
          f"not a rank answer {summary.invalid_answers}, "
          f"failovers {summary.failovers}, statuses {summary.statuses}")  # fmt: skip
    for cohort, stats in summary.by_cohort.items():
        _echo(f"   {cohort:<7} {stats['requests']:>6} answers  p50 {stats['p50_ms']:.1f} ms  "
              f"p99 {stats['p99_ms']:.1f} ms")  # fmt: skip
    _echo("   canary weight -> observed canary share (after 1 s to propagate):")
    for row in shares:
        observed = "-" if row["canary_share_pct"] is None else f"{row['canary_share_pct']:.1f}%"
        _echo(f"     {row['canary_weight_pct']:>5g}%  -> {observed:>6} of {row['requests']} "
              f"requests  [{row['from_s']}s, {row['to_s'] or 'end'}]")  # fmt: skip
    _echo("   phases (seconds since traffic started):")
    for t, label in timeline.labels():
        _echo(f"     {t:7.1f}s  {label}")
    _echo(f"   answers by artifact: {summary.by_artifact}")
    _echo(f"   timeline picture: {picture}")
    _echo(f"   took {time.monotonic() - started:.0f}s")

    result = {
        "shadow_stopped": {
            "candidate": BROKEN_CANDIDATE,
            "phase": broken.get("phase"),
            "answers_to_users": broken_answers,
            "shadow": broken.get("shadow"),
        },
        "requests": summary.requests,
        "non_2xx": summary.non_2xx,
        "invalid_answers": summary.invalid_answers,
        "failovers": summary.failovers,
        "final_phase": final_phase,
        "stable_artifact": current_stable,
        "rollback_to_baseline_s": round(rollback_s, 2),
        "by_cohort": summary.by_cohort,
        "step_shares": shares,
        "timeline": str(picture),
    }
    click.echo(json.dumps(result, sort_keys=True))
    ok = (
        summary.non_2xx == 0
        and summary.invalid_answers == 0
        and final_phase == "succeeded"
        and current_stable == BASELINE
        and broken.get("phase") == "rolled_back"
        and broken_answers == 0
    )
    return 0 if ok else 1


@click.command("demo")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=Path("var/demo"),
    show_default=True,
    help="Registry, cache, artifacts and outputs go here.",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=1, max=200),
    default=40.0,
    show_default=True,
    help="Steady traffic, requests per second.",
)
@click.option("--keep", is_flag=True, help="Keep the registry and cache of a previous run.")
def demo_command(workdir: Path, rate: float, keep: bool) -> None:
    """Run a full rollout under load on a local cluster, then roll back; print a summary."""
    code = run_demo(workdir, rate=rate, keep=keep)
    if code:
        raise click.exceptions.Exit(code)
