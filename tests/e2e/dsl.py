"""Given / When / Then over one acceptance scenario, in the manner of Argo Rollouts' e2e test
fixtures.

A ``Scenario`` holds what one scenario knows: the rollout environment (tests/e2e/harness.py),
the traffic run, the rollout it started, named moments on the traffic clock, and the undo steps
of what it changed. ``Given``, ``When`` and ``Then`` are three views of it; every verb returns
its receiver so that steps chain and read like the runbook.

- When verbs are operator actions and call what the CLI calls: the controller actor's methods
  (``rollout start / pause / resume / promote / abort / rollback``, ``controller start``), the
  registry (``rollout registry register / approve``) and ServeControl, the read-modify-write of
  Serve's declarative config that the controller itself writes through.
- Waits are named and poll a condition against a deadline; there is no sleeping verb.
- Then verbs are single expectations that count: failed requests, shares, switches, answers
  by generation.
- A failed wait or expectation raises with a dump: the rollout's events and verdicts (from
  the registry record), the registry's targets, audit rows and replica reports, the
  controller's errors and alerts, and the traffic summary.

Times are seconds since the scenario's traffic began (``TrafficRun.now_s``); the controller's
events carry wall-clock times and are mapped onto that clock through ``TrafficRun.started_at``.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import ray

from app.contracts import BASIS_POINTS, RouterConfig
from app.errors import WaitTimeout
from app.ingress.routing import choose_cohort, request_key
from app.packing import PackResult
from app.polling import wait_until
from rollout.actor import ensure_controller, get_controller
from rollout.local.traffic import (
    RequestRecord,
    TrafficRun,
    summarize,
    switches_per_user,
    write_records,
)
from tests.e2e.harness import (
    FAST_PLAN,
    ROLLOUT_APP,
    RolloutEnv,
    failed,
    retrying_clients,
    steady_traffic,
)

TERMINAL = ("succeeded", "rolled_back", "failed", "aborted")
_WEIGHT_MESSAGE = re.compile(r"canary (?P<percent>[0-9.]+)%")


@dataclass(frozen=True)
class WeightSegment:
    """Traffic started while the router applied one canary weight (settled margins cut off)."""

    start_s: float
    end_s: float
    canary_bp: int


@dataclass(frozen=True)
class ShareCheck:
    """One segment's observed canary share against its weight."""

    segment: WeightSegment
    answered: int
    canary: int
    tolerance: float
    misrouted: int  # answers from another cohort than the user's bucket says (no failover)

    @property
    def share(self) -> float:
        return self.canary / self.answered if self.answered else math.nan

    @property
    def weight(self) -> float:
        return self.segment.canary_bp / BASIS_POINTS

    def describe(self) -> str:
        return (
            f"[{self.segment.start_s:6.1f}s, {self.segment.end_s:6.1f}s) weight "
            f"{self.weight:.0%}: canary {self.canary}/{self.answered} = {self.share:.3f} "
            f"(tolerance +/-{self.tolerance:.3f}), misrouted {self.misrouted}"
        )


@dataclass
class Scenario:
    env: RolloutEnv
    name: str
    run: TrafficRun | None = None
    records: list[RequestRecord] | None = None  # set once the traffic stopped
    rollout_id: str | None = None
    marks: dict[str, float] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    found: dict[str, Any] = field(default_factory=dict)  # what verbs learnt (replica ids...)
    _undo: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    _t0: float = field(default_factory=time.monotonic)

    @property
    def given(self) -> Given:
        return Given(self)

    @property
    def when(self) -> When:
        return When(self)

    @property
    def then(self) -> Then:
        return Then(self)

    # ------------------------------------------------------------------ bookkeeping

    def now_s(self) -> float:
        """The traffic clock (0 before traffic started)."""
        return self.run.now_s() if self.run is not None else 0.0

    def note(self, line: str) -> None:
        self.log.append(
            f"[{time.monotonic() - self._t0:6.1f}s | traffic {self.now_s():6.1f}s] {line}"
        )

    def mark(self, name: str) -> float:
        self.marks[name] = self.now_s()
        self.note(f"mark {name!r}")
        return self.marks[name]

    def on_cleanup(self, what: str, undo: Callable[[], None]) -> None:
        self._undo.append((what, undo))

    def current_records(self) -> list[RequestRecord]:
        if self.records is not None:
            return self.records
        return list(self.run.records) if self.run is not None else []

    def wall_to_traffic(self, wall: float) -> float:
        assert self.run is not None and self.run.started_at is not None, "no traffic yet"
        return wall - self.run.started_at

    # ------------------------------------------------------------------ waits and failure

    def wait(self, desc: str, predicate: Callable[[], Any], timeout: float = 90.0) -> Any:
        """A named wait: polls ``predicate`` until truthy (returned); on timeout, fails with
        the name, the predicate's last error and the dump."""
        self.note(f"waiting for {desc}")
        started = time.monotonic()
        try:
            value = wait_until(predicate, timeout, desc, retry_on=(Exception,))
        except WaitTimeout as exc:
            self.fail(str(exc))
        self.note(f"{desc}: met after {time.monotonic() - started:.1f}s")
        return value

    def fail(self, message: str) -> NoReturn:
        raise AssertionError(f"{message}\n{self.dump()}")

    def check(self, ok: bool, message: str | Callable[[], str]) -> None:
        if not ok:
            self.fail(message() if callable(message) else message)

    def rollout_record(self) -> Any | None:
        if self.rollout_id is None:
            return None
        return self.env.registry.get_rollout(self.rollout_id)

    def events(self) -> list[dict[str, Any]]:
        record = self.rollout_record()
        return list((record.state or {}).get("events") or []) if record is not None else []

    def dump(self) -> str:
        """Everything an operator would look at, each part on its own (one failing read must
        not hide the others)."""
        out = [f"==== scenario {self.name}: what happened ===="]
        out += self.log[-60:]

        def part(title: str, read: Callable[[], Iterable[str]]) -> None:
            out.append(f"---- {title}")
            try:
                out.extend(read())
            except Exception as exc:
                out.append(f"<unavailable: {type(exc).__name__}: {exc}>")

        def rollout() -> Iterable[str]:
            record = self.rollout_record()
            if record is None:
                return ["<no rollout started>"]
            lines = [f"{record.id}: phase={record.phase} step={record.step} reason={record.reason}"]
            for e in (record.state or {}).get("events") or []:
                at = e.get("at")
                when = f"{self.wall_to_traffic(at):6.1f}s" if at and self.run else "      "
                lines.append(f"  event {when} {e.get('event')}: {e.get('message')}")
            for v in record.verdicts or []:
                lines.append(
                    f"  verdict step={v.get('step')} bp={v.get('canary_bp')} "
                    f"{v.get('outcome')}: {'; '.join(v.get('reasons') or [])}"
                )
            return lines

        def targets() -> Iterable[str]:
            reg = self.env.registry
            lines = [
                f"  {t.cohort}: {t.artifact_id} rev {t.revision}"
                for t in reg.list_targets("ranker", "default")
            ]
            lines += [
                f"  audit {h.cohort} {h.old_artifact_id}@{h.old_revision} -> "
                f"{h.new_artifact_id}@{h.new_revision} by {h.actor}: {h.reason}"
                for h in reg.history("ranker", "default", limit=12)
            ]
            return lines

        def reports() -> Iterable[str]:
            return [
                f"  {r.cohort} {r.replica_id}: {r.state} desired {r.desired_artifact_id}@"
                f"{r.desired_revision} actual {r.actual_artifact_id}@{r.actual_revision} "
                f"error={r.last_error}"
                for r in self.env.registry.list_replica_reports("ranker", "default")
            ]

        def controller() -> Iterable[str]:
            handle = get_controller()
            if handle is None:
                return ["<no controller actor>"]
            view = ray.get(handle.status.remote(), timeout=30)
            return [
                f"  errors: {view.get('errors')}",
                f"  alerts: {view.get('alerts')}",
                f"  replicas: {view.get('replicas')}",
            ]

        def traffic() -> Iterable[str]:
            records = self.current_records()
            summary = summarize(records)
            bad = failed(records)[:5]
            return [
                f"  {summary.requests} requests, statuses {summary.statuses}, failovers "
                f"{summary.failovers}, by artifact {summary.by_artifact}",
                *(f"  failed: {r}" for r in bad),
                f"  marks: {self.marks}",
            ]

        def records_file() -> Iterable[str]:
            path = self.env.cluster.work / f"{self.name}-records.json"
            write_records(self.current_records(), path)
            return [f"  every request: {path}"]

        part("rollout (registry record)", rollout)
        part("registry targets and audit", targets)
        part("replica reports (registry)", reports)
        part("controller", controller)
        part("traffic", traffic)
        part("records", records_file)
        return "\n".join(out)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if self.run is not None and self.records is None:
            self.records = self.run.stop()
        # The scenario's own account (counts, shares, failovers): pytest shows it with -rA.
        print(f"==== scenario {self.name}\n" + "\n".join(self.log))
        errors = []
        for what, undo in reversed(self._undo):
            try:
                undo()
            except Exception as exc:  # every undo gets its chance
                errors.append(f"{what}: {type(exc).__name__}: {exc}")
        self._undo.clear()
        if errors:
            raise AssertionError("scenario cleanup failed: " + "; ".join(errors))


# ====================================================================== Given


class Given:
    def __init__(self, s: Scenario) -> None:
        self.s = s

    def steady_traffic(
        self, rate: float = 35.0, *, timeout_s: float = 30.0, connections: int = 32
    ) -> Given:
        """Open-loop traffic at ``rate`` requests/s from 500 users keyed by user id; a plain
        client (no retries): every non-2xx the service returns is counted."""
        s = self.s
        assert s.run is None, "one traffic run per scenario"
        s.run = steady_traffic(
            s.env.url,
            rate,
            concurrency=connections,  # open loop: connections, and 8x that in flight
            timeout_s=timeout_s,
        )
        s.wait("traffic flowing (20 answers)", lambda: len(s.run.records) >= 20, 60)
        s.note(f"steady traffic at {rate:g} req/s")
        return self

    def candidate(self, packed: PackResult, *, manifest_uri: str | None = None) -> Given:
        """Registered and approved (``rollout registry register`` + ``approve``), from its
        packed location or from ``manifest_uri`` (another store serving the same bytes)."""
        registry = self.s.env.registry
        registry.register_artifact(manifest_uri or packed.manifest_uri, packed.manifest_sha256)
        registry.approve_artifact("ranker", packed.artifact_id, actor="acceptance")
        self.s.note(f"candidate {packed.artifact_id} registered and approved")
        return self

    def retrying_clients(self, concurrency: int = 4) -> Given:
        """Closed-loop clients using app/client.py's retrying client (Retry-After honoured,
        backoff with jitter); every call is recorded with its attempts."""
        s = self.s
        assert "retrying" not in s.found, "one retrying load per scenario"
        run = retrying_clients(s.env.url, concurrency)
        s.found["retrying"] = run
        s.on_cleanup("retrying clients", lambda: run.stop(90))
        s.wait("retrying clients answered (10 calls)", lambda: len(run.records) >= 10, 60)
        return self

    def canary_faults(self, **faults: float) -> Given:
        """Test-only fault injection in the canary's rank calls (app.replica), written into
        the canary's user_config beside whatever else is there; removed at cleanup."""
        When(self.s).edit_user_config("canary", faults=dict(faults))
        self.s.on_cleanup(
            "canary faults",
            lambda: self.s.env.control.update_deployment(
                ROLLOUT_APP,
                "canary",
                user_config={
                    **(self.s.env.control.current_user_config(ROLLOUT_APP, "canary") or {}),
                    "faults": None,
                },
            ),
        )
        return self

    def stable_on(self, artifact: str) -> Given:
        self.s.then.expect_stable_target(artifact)
        return self


# ====================================================================== When


class When:
    def __init__(self, s: Scenario) -> None:
        self.s = s

    # ---- operator verbs (the CLI's functions) ------------------------------------------

    def start_rollout(self, candidate: str, plan: Mapping[str, Any] | None = None) -> When:
        """``rollout start ranker CANDIDATE --plan ... --force``. The scenarios' plans are
        about what a rollout does once it runs, and the traffic of the minutes before them is
        an earlier scenario's (its injected faults, failovers and latency tails): the start's
        estimate is shown, never allowed to refuse them. tests/e2e/test_rollout.py has the
        binary's refusal."""
        s = self.s
        summary = ray.get(
            s.env.controller.start_rollout.remote(
                candidate, dict(plan or FAST_PLAN), "acceptance", True
            ),
            timeout=60,
        )
        s.rollout_id = summary["rollout"]
        s.mark("rollout started")
        s.note(f"started rollout {s.rollout_id} of {candidate}")
        estimate = summary.get("estimate")
        if estimate is not None:
            first = (estimate.get("steps") or [{}])[0]
            s.note(
                f"estimate at {estimate['rps']} req/s: step 1 in ~{first.get('pass_s')} s "
                f"(99.5% within {first.get('pass_late_s')} s), deadline {estimate['deadline_s']} s"
            )
        return self

    def command(self, name: str, reason: str = "") -> When:
        """``rollout pause|resume|promote|abort|rollback --reason ...``"""
        ray.get(self.s.env.controller.command.remote(name, reason), timeout=60)
        self.s.mark(name)
        return self

    def rollback_stable(self, to: str, reason: str = "acceptance rollback") -> When:
        """``rollout rollback --to ARTIFACT`` with no rollout in progress: stable goes back to
        an earlier artifact at a higher revision."""
        target = ray.get(
            self.s.env.controller.rollback_stable.remote(to, "acceptance", reason), timeout=60
        )
        self.s.found["rollback_target"] = target
        self.s.mark("stable rollback")
        self.s.note(f"stable rolled back to {target['artifact_id']} rev {target['revision']}")
        return self

    def kill_controller(self) -> When:
        """A crash of the controller's process; Ray is told not to restart it."""
        handle = get_controller()
        assert handle is not None, "no controller to kill"
        ray.kill(handle, no_restart=True)
        self.s.wait("controller actor gone", lambda: get_controller() is None, 30)
        self.s.mark("controller killed")
        return self

    def start_controller(self) -> When:
        """``rollout controller start``: the named controller, created if absent; it resumes
        the active rollout from the registry and repairs drift in Serve's config."""
        handle = ensure_controller(self.s.env.settings)

        def repaired() -> tuple[list[str]] | None:
            ping = ray.get(handle.ping.remote(), timeout=30)
            return None if ping["repaired"] is None else (ping["repaired"],)

        (self.s.found["repaired"],) = self.s.wait("controller reconciled Serve", repaired, 60)
        self.s.mark("controller started")
        self.s.note(f"controller repaired: {self.s.found['repaired']}")
        return self

    # ---- Serve's declarative config (what the controller writes through) ----------------

    def edit_user_config(self, deployment: str, **changes: Any) -> When:
        """Read-modify-write of one deployment's user_config (other fields kept)."""
        control = self.s.env.control
        current = control.current_user_config(ROLLOUT_APP, deployment) or {}
        control.update_deployment(ROLLOUT_APP, deployment, user_config={**current, **changes})
        self.s.note(f"{deployment} user_config: {sorted(changes)} changed")
        return self

    def reput_same_config(self) -> When:
        """A duplicate notification: the deployed config PUT again, unchanged."""
        control = self.s.env.control
        control.apply(control.declarative_config())
        self.s.note("same Serve config PUT again")
        return self

    def resubmit(self, config: Mapping[str, Any]) -> When:
        """What KubeRay does when its cached copy of ``serveConfigV2`` is empty (an operator
        restart, a new head pod): the manifest's whole config PUT again over what the
        controller set since."""
        self.s.env.control.apply(config)
        self.s.mark("config resubmitted")
        self.s.note("the config deployed before the rollout PUT again (a KubeRay resubmission)")
        return self

    def kill_replica(self, deployment: str) -> When:
        """``ray.kill`` of one RUNNING replica actor of the deployment (found by its actor name
        in Serve's replica details); Serve is left to replace it."""
        status = self.s.env.control.deployment_status(ROLLOUT_APP, deployment)
        running = [r for r in status["replicas"] if r["state"] == "RUNNING"]
        assert running, f"no RUNNING {deployment} replica to kill"
        victim = running[0]
        actor = ray.get_actor(victim["actor_name"], namespace="serve")
        ray.kill(actor, no_restart=True)
        self.s.found.setdefault("killed", {})[deployment] = victim["replica_id"]
        self.s.mark(f"{deployment} replica killed")
        self.s.note(f"killed {deployment} replica {victim['replica_id']} ({victim['actor_name']})")
        return self

    def scale(self, deployment: str, replicas: int) -> When:
        """``num_replicas`` of a deployment through Serve's declarative config; waits until
        Serve runs exactly that many, healthy."""
        control = self.s.env.control
        control.update_deployment(ROLLOUT_APP, deployment, num_replicas=replicas)
        self.s.mark(f"{deployment} scaled to {replicas}")
        self.s.wait(
            f"{deployment} running {replicas} replicas",
            lambda: control.wait_applied(
                ROLLOUT_APP, deployment, num_replicas=replicas, timeout_s=5
            ),
            120,
        )
        return self

    def stop_traffic(self) -> When:
        s = self.s
        assert s.run is not None
        s.records = s.run.stop()
        if "retrying" in s.found:
            s.found["retrying"].stop(90)
        s.mark("traffic stopped")
        return self

    # ---- named waits ---------------------------------------------------------------------

    def wait_for_phase(self, *phases: str, finished: bool = False, timeout: float = 120) -> When:
        s = self.s

        def reached() -> dict[str, Any] | None:
            view = s.env.status()
            if view.get("rollout") != s.rollout_id:
                return None
            if view.get("phase") in phases and (view.get("finished") or not finished):
                return view
            return None

        desc = f"rollout phase {'/'.join(phases)}{' (finished)' if finished else ''}"
        s.found["view"] = s.wait(desc, reached, timeout)
        s.mark(f"phase {s.found['view']['phase']}")
        return self

    def wait_for_finish(self, timeout: float = 150) -> When:
        return self.wait_for_phase(*TERMINAL, finished=True, timeout=timeout)

    def wait_for_weight(self, canary_bp: int, timeout: float = 90) -> When:
        """The rollout has set the router's canary weight to ``canary_bp``."""
        s = self.s

        def reached() -> bool:
            view = s.env.status()
            return (
                view.get("rollout") == s.rollout_id
                and (view.get("weights") or {}).get("canary_bp") == canary_bp
            )

        s.wait(f"rollout weight canary {canary_bp / 100:g}%", reached, timeout)
        s.mark(f"weight {canary_bp}")
        return self

    def wait_for_event(self, event: str, timeout: float = 90) -> When:
        s = self.s
        s.wait(
            f"rollout event {event!r}",
            lambda: any(e.get("event") == event for e in s.events()),
            timeout,
        )
        s.mark(f"event {event}")
        return self

    def wait_for_answers(
        self,
        desc: str,
        match: Callable[[RequestRecord], bool],
        count: int = 20,
        *,
        after: str | None = None,
        timeout: float = 60,
    ) -> When:
        """``count`` answered requests matching ``match`` that started after mark ``after``."""
        s = self.s
        if after is not None and after not in s.marks:
            s.fail(f"no mark {after!r} to count answers after")
        since = s.marks[after] if after else 0.0

        def enough() -> bool:
            n = sum(1 for r in s.current_records() if r.start_s >= since and match(r))
            assert n >= count, f"{n} of {count}"
            return True

        s.wait(f"{count} answers: {desc}", enough, timeout)
        return self

    def wait_until(self, desc: str, predicate: Callable[[], Any], timeout: float = 90) -> When:
        self.s.found[desc] = self.s.wait(desc, predicate, timeout)
        return self


# ====================================================================== Then


class Then:
    def __init__(self, s: Scenario) -> None:
        self.s = s

    # ---- the rollout ---------------------------------------------------------------------

    def expect_phase(self, phase: str, *, reason_has: Iterable[str] = ()) -> Then:
        s = self.s
        record = s.rollout_record()
        s.check(
            record is not None and record.phase == phase,
            lambda: f"expected rollout phase {phase!r}, got {record and record.phase!r}",
        )
        reason = record.reason or ""
        for needle in reason_has:
            s.check(needle in reason, f"rollout reason lacks {needle!r}: {reason!r}")
        s.note(f"rollout {phase}: {reason}")
        return self

    def expect_event(self, event: str) -> Then:
        s = self.s
        s.check(any(e.get("event") == event for e in s.events()), f"no {event!r} event")
        return self

    def expect_no_event(self, event: str) -> Then:
        s = self.s
        found = [e for e in s.events() if e.get("event") == event]
        s.check(not found, f"unexpected {event!r} event: {found}")
        return self

    def expect_stable_target(self, artifact: str) -> Then:
        s = self.s
        target = s.env.registry.get_target("ranker", "default", "stable")
        s.check(
            target.artifact_id == artifact,
            f"stable target is {target.artifact_id}@{target.revision}, not {artifact}",
        )
        return self

    def expect_router_weight(self, canary_bp: int) -> Then:
        s = self.s
        config = s.env.control.current_user_config(ROLLOUT_APP, "router") or {}
        s.check(
            int(config.get("canary_bp", 0)) == canary_bp,
            f"router canary_bp {config.get('canary_bp')} != {canary_bp}",
        )
        return self

    # ---- traffic ---------------------------------------------------------------------------

    def expect_failed_requests(self, at_most: int = 0) -> Then:
        s = self.s
        records = s.current_records()
        bad = failed(records)
        s.check(
            len(bad) <= at_most,
            lambda: (
                f"{len(bad)} of {len(records)} requests failed (allowed {at_most}): "
                f"{Counter(r.status for r in bad)} first {bad[:3]}"
            ),
        )
        s.note(f"{len(records)} requests, {len(bad)} failed (allowed {at_most})")
        return self

    def expect_no_answer_from(self, artifact: str) -> Then:
        s = self.s
        hits = [r for r in s.current_records() if r.artifact_id == artifact]
        s.check(not hits, lambda: f"{len(hits)} answers from {artifact}: {hits[:3]}")
        return self

    def expect_no_answer(self, *, cohort: str, artifact: str) -> Then:
        s = self.s
        hits = [r for r in s.current_records() if (r.cohort, r.artifact_id) == (cohort, artifact)]
        s.check(not hits, lambda: f"{len(hits)} answers from {cohort} on {artifact}: {hits[:3]}")
        return self

    def expect_answers_only_from(self, cohort: str, artifact: str, *, after: str) -> Then:
        """Every answer to a request started after mark ``after`` came from ``cohort`` on
        ``artifact`` (at least 10 such answers)."""
        s = self.s
        since = s.marks[after]
        answered = [r for r in s.current_records() if r.start_s >= since and r.cohort]
        others = Counter(
            (r.cohort, r.artifact_id)
            for r in answered
            if (r.cohort, r.artifact_id) != (cohort, artifact)
        )
        s.check(
            len(answered) >= 10 and not others,
            f"after {after!r}: {len(answered)} answers, not from {cohort}/{artifact}: "
            f"{dict(others)}",
        )
        return self

    def expect_published_generations_only(self) -> Then:
        """Every answer names a (cohort, artifact, revision) that the registry published for
        that cohort: a request in flight across a switch finishes on one generation, never
        a mix (artifact of one target, revision of another) or something unpublished."""
        s = self.s
        published = {
            (h.cohort, h.new_artifact_id, h.new_revision)
            for h in s.env.registry.history("ranker", "default", limit=1000)
        }
        seen = Counter(
            (r.cohort, r.artifact_id, r.revision) for r in s.current_records() if r.status == 200
        )
        unknown = {k: n for k, n in seen.items() if k not in published}
        s.check(not unknown, f"answers from unpublished generations: {unknown}")
        s.note(f"answers by generation: {dict(seen)}")
        return self

    def expect_generations_never_go_back(self) -> Then:
        """Per cohort (one replica each here): no request got an older revision than an
        answer the client had already received before sending it."""
        s = self.s
        bad = []
        for cohort in ("stable", "canary"):
            answers = [
                r
                for r in s.current_records()
                if r.status == 200 and r.cohort == cohort and r.revision is not None
            ]
            ends = sorted((r.start_s + r.latency_ms / 1000, int(r.revision)) for r in answers)
            newest, j = 0, 0
            for r in sorted(answers, key=lambda r: r.start_s):
                while j < len(ends) and ends[j][0] < r.start_s:
                    newest = max(newest, ends[j][1])
                    j += 1
                if int(r.revision) < newest:  # type: ignore[arg-type]
                    bad.append((cohort, r.start_s, r.revision, newest))
        s.check(not bad, f"{len(bad)} answers older than one already received: {bad[:5]}")
        return self

    def expect_users_switch_at_most_once_per_direction(
        self, *, settle_s: float = 2.0, guard_s: float = 0.5, min_settled: int = 200
    ) -> Then:
        """Every user key moves stable -> canary at most once and canary -> stable at most
        once, and canary -> stable only when the canary weight falls (never while it grows).

        Counted over the requests whose routing weight is known: those sent and answered
        within one settled stretch between weight changes (see ``_settled``). A request in
        flight across a change may have been routed under either weight, and the client's
        send order is not the router's arrival order (requests wait for a pooled
        connection), so those are left out rather than guessed.

        A vacuous pass is refused: at least ``min_settled`` requests of settled routing (200:
        a few hundred keyed users seen at two or more weights, about 6 s of 35 req/s), and at
        least one user seen moving stable -> canary (else there was no switch to count)."""
        s = self.s
        settled = self._settled(settle_s, guard_s)
        records = [r for r, _ in settled]
        s.check(
            len(records) >= min_settled,
            f"only {len(records)} requests of settled routing (at least {min_settled} needed)",
        )
        paths = switches_per_user(records)
        twice = {
            u: p
            for u, p in paths.items()
            if _transitions(p, "stable", "canary") > 1 or _transitions(p, "canary", "stable") > 1
        }
        s.check(
            not twice,
            lambda: f"{len(twice)} users switched twice one way: {dict(list(twice.items())[:5])}",
        )
        backwards = []
        last: dict[str, tuple[RequestRecord, WeightSegment]] = {}
        for r, segment in sorted(settled, key=lambda pair: pair[0].start_s):
            if r.cohort is None or r.failover:
                continue
            prev = last.get(r.user)
            if (
                prev is not None
                and (prev[0].cohort, r.cohort) == ("canary", "stable")
                and segment.canary_bp >= prev[1].canary_bp
            ):
                backwards.append((r.user, prev[0].start_s, r.start_s, segment.canary_bp))
            last[r.user] = (r, segment)
        s.check(
            not backwards,
            f"{len(backwards)} users sent back to stable while the weight did not fall: "
            f"{backwards[:5]}",
        )
        moved = sum(1 for p in paths.values() if p[:2] == ["stable", "canary"])
        s.check(moved > 0, f"no user moved stable -> canary among {len(paths)} users")
        s.note(
            f"{len(records)} requests of settled routing from {len(paths)} users; {moved} "
            "moved stable -> canary; none moved twice one way"
        )
        return self

    def expect_cohort_shares_follow_weights(
        self,
        *,
        users: int = 500,
        settle_s: float = 2.0,
        guard_s: float = 0.5,
        sigmas: float = 4.0,
        min_answers: int = 40,
        weights: Iterable[int] = (),
    ) -> list[ShareCheck]:
        """For each stretch between weight changes (the controller's ``weights`` events;
        requests of settled routing only, see ``_settled``): the observed
        canary share is within ``sigmas`` standard deviations of the weight, and no request
        was answered by another cohort than its user's bucket says (failovers aside).

        The tolerance is binomial noise at the sample size: with weight p, n answers, and
        U users drawn uniformly per request and bucketed by a hash, the share's variance is
        p(1-p)/n (which requests) + p(1-p)/U (which users fall under the weight). At 0% and
        100% bucketing is exact: tolerance 0. ``weights``: those that must have been judged.
        """
        s = self.s
        salt = (s.env.control.current_user_config(ROLLOUT_APP, "router") or {}).get(
            "salt", RouterConfig().salt
        )
        checks = []
        settled = self._settled(settle_s, guard_s)
        for segment in self._segments(settle_s, guard_s):
            window = [
                r
                for r, seg in settled
                if seg == segment and r.status == 200 and r.cohort and not r.failover
            ]
            if len(window) < min_answers:
                continue
            p = segment.canary_bp / BASIS_POINTS
            n = len(window)
            misrouted = sum(
                1
                for r in window
                if r.cohort
                != choose_cohort(
                    canary_bp=segment.canary_bp,
                    salt=salt,
                    key=request_key(r.user, None),
                    random_bp=lambda: 0,
                )
            )
            tolerance = sigmas * math.sqrt(p * (1 - p) * (1 / n + 1 / users))
            checks.append(
                ShareCheck(
                    segment, n, sum(r.cohort == "canary" for r in window), tolerance, misrouted
                )
            )
        report = "\n".join(c.describe() for c in checks)
        s.note("cohort shares:\n" + report)
        judged = {c.segment.canary_bp for c in checks}
        missing = set(weights) - judged
        s.check(
            not missing,
            f"no settled stretch of {min_answers}+ answers at weights "
            f"{sorted(missing)} bp:\n{report}",
        )
        off = [c for c in checks if abs(c.share - c.weight) > c.tolerance + 1e-9 or c.misrouted]
        s.check(not off, "cohort shares off their weights:\n" + report)
        return checks

    def _settled(
        self, settle_s: float, guard_s: float
    ) -> list[tuple[RequestRecord, WeightSegment]]:
        """Records sent at least ``settle_s`` after a weight change (the router has applied
        it) and answered at least ``guard_s`` before the next one was written (the router
        cannot have applied it yet), with the stretch they fall in."""
        segments = self._segments(settle_s, guard_s)
        out = []
        for r in self.s.current_records():
            end = r.start_s + r.latency_ms / 1000
            for segment in segments:
                if segment.start_s <= r.start_s and end < segment.end_s:
                    out.append((r, segment))
                    break
        return out

    def _segments(self, settle_s: float, guard_s: float) -> list[WeightSegment]:
        s = self.s
        changes: list[tuple[float, int]] = [(0.0, 0)]
        for e in s.events():
            if e.get("event") != "weights":
                continue
            if e.get("canary_bp") is not None:
                bp = int(e["canary_bp"])
            else:  # events written before they carried the weight as data
                match = _WEIGHT_MESSAGE.search(str(e.get("message")))
                s.check(match is not None, f"unreadable weights event {e}")
                assert match is not None
                bp = round(float(match["percent"]) * 100)
            changes.append((s.wall_to_traffic(float(e["at"])), bp))
        end = max((r.start_s for r in s.current_records()), default=0.0) + 1
        segments = []
        for i, (at, bp) in enumerate(changes):
            until = changes[i + 1][0] - guard_s if i + 1 < len(changes) else end
            start = at + (settle_s if i else 0.0)
            if until > start:
                segments.append(WeightSegment(start, until, bp))
        return segments


def _transitions(path: list[str], a: str, b: str) -> int:
    return sum(1 for x, y in itertools.pairwise(path) if (x, y) == (a, b))


def plan(**changes: Any) -> dict[str, Any]:
    """FAST_PLAN with changes (a deep copy; nested dicts are replaced, not merged)."""
    out = copy.deepcopy(FAST_PLAN)
    out.update(changes)
    return out


__all__ = [
    "Given",
    "Scenario",
    "ShareCheck",
    "Then",
    "WeightSegment",
    "When",
    "plan",
]
