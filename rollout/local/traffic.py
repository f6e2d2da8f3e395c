"""Synthetic ranking traffic against a local service, recorded request by request.

Used by ``rollout demo``, the e2e tests, bench/loadgen.py (its command line) and the other
benches. Bounded in count and in time, and loopback only: the target must be 127.0.0.0/8,
``localhost`` or ``[::1]``.

Two modes: open loop (requests start on a fixed schedule, ``rate`` per second, whatever the
answers do; late starts are recorded) and closed loop (``concurrency`` workers, each sending
its next request when the previous answer came back). Every request is recorded: start time,
latency, status, the cohort/artifact/revision/replica that answered, and the user key, so
shares, switches and failures can be counted afterwards.

Two clients: a plain one (the default: one attempt per request, every non-2xx recorded as it
came) and, with ``TrafficSpec.retry``, app/client.py's retrying client (429/5xx answers and
connection errors retried, ``Retry-After`` honoured); a record is then one call, with the
attempts it took.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from app.api import RankResponse
from app.client import AsyncRankerClient, RetryPolicy
from app.contracts import CANARY, COHORTS
from app.errors import RankerHTTPError, RetriesExhausted
from app.model_family import SHIPPED_FAMILIES, families_for
from app.request_bodies import DEFAULT_CANDIDATES, DEFAULT_SEED, DEFAULT_TOP_N, rank_bodies


@dataclass(frozen=True)
class RequestRecord:
    start_s: float  # since the run began
    latency_ms: float
    status: int  # 0: no HTTP answer (connection error, timeout; a retrying client gave up)
    user: str
    cohort: str | None = None
    artifact_id: str | None = None
    revision: int | None = None
    failover: bool = False
    error: str | None = None
    replica: str | None = None
    attempts: int = 1  # HTTP attempts of the call (more than 1 only with a retrying client)
    backbone: str | None = None  # the backbone artifact a head that answered runs on


@dataclass
class TrafficSpec:
    url: str = "http://127.0.0.1:8000"
    rate: float | None = 50.0  # requests/s (open loop); None for closed loop
    concurrency: int = 8  # closed loop workers; open loop: max in flight
    max_requests: int = 10_000
    max_seconds: float = 60.0
    users: int = 1000
    user_prefix: str = "user"  # user keys are f"{user_prefix}-{n}", 0 <= n < users
    candidates: int = DEFAULT_CANDIDATES
    top_n: int = DEFAULT_TOP_N
    seed: int = DEFAULT_SEED
    # The request schema of the bodies (a shipped family's); None: the default family's.
    feature_schema: str | None = None
    timeout_s: float = 10.0  # per HTTP attempt
    # None: a plain client. Else app.client.AsyncRankerClient with this policy.
    retry: RetryPolicy | None = None


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"traffic only goes to loopback addresses, not {host!r}")


def _request_bodies(spec: TrafficSpec, count: int = 64) -> list[tuple[bytes, bytes]]:
    """Pre-encoded bodies (prefix, suffix) around the user id: JSON encoding per request would
    cost the generator more CPU than the service it measures. The bodies are
    ``app.request_bodies.rank_bodies`` (which ``rollout replay`` sends offline too)."""
    schema = (
        None
        if spec.feature_schema is None
        else families_for(SHIPPED_FAMILIES).schema(spec.feature_schema)
    )
    bodies = []
    shape = {"seed": spec.seed, "candidates": spec.candidates, "top_n": spec.top_n}
    for body in rank_bodies(count, schema=schema, **shape):
        rest = json.dumps(body, separators=(",", ":"))
        bodies.append((b'{"user_id":"', b'",' + rest[1:].encode()))
    return bodies


_Client = httpx.AsyncClient | AsyncRankerClient


class TrafficRun:
    """One bounded run, in a background thread (``start``/``stop``) or awaited (``run``)."""

    def __init__(self, spec: TrafficSpec) -> None:
        check_loopback(spec.url)
        self.spec = spec
        self.records: list[RequestRecord] = []
        self.started_at: float | None = None  # time.time() of the first request
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bodies = _request_bodies(spec)
        self._rng = random.Random(spec.seed + 1)
        self._sent = 0

    # ------------------------------------------------------------------ control

    def start(self) -> TrafficRun:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> list[RequestRecord]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.records

    def join(self, timeout: float | None = None) -> list[RequestRecord]:
        """Wait for the run to end by its own bounds."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.records

    def now_s(self) -> float:
        return 0.0 if self.started_at is None else time.time() - self.started_at

    # ------------------------------------------------------------------ the run

    async def run(self) -> list[RequestRecord]:
        spec = self.spec
        limits = httpx.Limits(
            max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency
        )
        client: _Client
        if spec.retry is None:
            client = httpx.AsyncClient(base_url=spec.url, timeout=spec.timeout_s, limits=limits)
        else:
            client = AsyncRankerClient(
                spec.url, policy=spec.retry, timeout_s=spec.timeout_s, limits=limits
            )
        async with client:
            self.started_at = time.time()
            t0 = time.monotonic()
            deadline = t0 + spec.max_seconds
            if spec.rate is None:
                workers = [
                    self._closed_worker(client, t0, deadline) for _ in range(spec.concurrency)
                ]
                await asyncio.gather(*workers)
            else:
                await self._open_loop(client, t0, deadline)
        return self.records

    def _take(self) -> bool:
        if self._stop.is_set() or self._sent >= self.spec.max_requests:
            return False
        self._sent += 1
        return True

    async def _closed_worker(self, client: _Client, t0: float, deadline: float) -> None:
        while time.monotonic() < deadline and self._take():
            await self._one(client, t0)

    async def _open_loop(self, client: _Client, t0: float, deadline: float) -> None:
        assert self.spec.rate is not None
        interval = 1.0 / self.spec.rate
        in_flight: set[asyncio.Task[None]] = set()
        gate = asyncio.Semaphore(self.spec.concurrency * 8)
        i = 0
        while self._take():
            due = t0 + i * interval
            if due >= deadline:
                break
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await gate.acquire()
            task = asyncio.create_task(self._one(client, t0))
            task.add_done_callback(lambda t: (gate.release(), in_flight.discard(t)))
            in_flight.add(task)
            i += 1
        if in_flight:
            await asyncio.gather(*in_flight)

    async def _one(self, client: _Client, t0: float) -> None:
        user = f"{self.spec.user_prefix}-{self._rng.randrange(self.spec.users)}"
        prefix, suffix = self._bodies[self._rng.randrange(len(self._bodies))]
        content = prefix + user.encode() + suffix
        started = time.monotonic()
        if isinstance(client, AsyncRankerClient):
            record = await self._call(client, content, user, started, t0)
        else:
            record = await self._post(client, content, user, started, t0)
        self.records.append(record)

    @staticmethod
    async def _post(
        client: httpx.AsyncClient, content: bytes, user: str, started: float, t0: float
    ) -> RequestRecord:
        """One attempt with the plain client."""
        start_s = started - t0
        try:
            response = await client.post(
                "/v1/rank", content=content, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            return RequestRecord(
                start_s, (time.monotonic() - started) * 1e3, 0, user, error=repr(exc)
            )
        latency = (time.monotonic() - started) * 1e3
        if response.status_code == 200:
            return _answered(start_s, latency, response.status_code, user, response.json())
        return RequestRecord(
            start_s, latency, response.status_code, user, error=response.text[:300]
        )

    @staticmethod
    async def _call(
        client: AsyncRankerClient, content: bytes, user: str, started: float, t0: float
    ) -> RequestRecord:
        """One call with the retrying client, its retries included."""
        start_s = started - t0
        try:
            result = await client.rank(json.loads(content))
        except RetriesExhausted as exc:
            latency = (time.monotonic() - started) * 1e3
            return RequestRecord(start_s, latency, 0, user, error=str(exc), attempts=exc.attempts)
        except Exception as exc:  # a non-retryable answer (RankerHTTPError) or another error
            latency = (time.monotonic() - started) * 1e3
            status = exc.status if isinstance(exc, RankerHTTPError) else 0
            return RequestRecord(start_s, latency, status, user, error=repr(exc))
        latency = (time.monotonic() - started) * 1e3
        return _answered(start_s, latency, result.status, user, result.body, result.attempts)


def _answered(
    start_s: float, latency_ms: float, status: int, user: str, body: Any, attempts: int = 1
) -> RequestRecord:
    """The record of a 2xx answer, read as the service's public answer (``app.api.RankResponse``):
    who answered, and whether by failover. A 2xx that is not such an answer is recorded with
    what was wrong with it and no model."""
    try:
        answer = RankResponse.model_validate(body)
    except ValidationError as exc:
        return RequestRecord(
            start_s, latency_ms, status, user, error=f"not a rank answer: {exc}"[:300],
            attempts=attempts,
        )  # fmt: skip
    model = answer.model
    return RequestRecord(
        start_s,
        latency_ms,
        status,
        user,
        cohort=model.cohort,
        artifact_id=model.artifact_id,
        revision=model.revision,
        failover=answer.failover,
        replica=model.replica,
        attempts=attempts,
        backbone=model.backbone_artifact_id,
    )


# ---------------------------------------------------------------------- analysis


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class TrafficSummary:
    requests: int
    non_2xx: int
    statuses: dict[str, int]
    failovers: int
    by_cohort: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    by_artifact: dict[str, int] = field(default_factory=dict)
    # 2xx answers that were not rank answers (the record says what was wrong with each).
    invalid_answers: int = 0


def summarize(records: Sequence[RequestRecord]) -> TrafficSummary:
    statuses = Counter(str(r.status) for r in records)
    latencies: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.status == 200 and r.cohort:
            latencies[r.cohort].append(r.latency_ms)
    by_cohort = {
        cohort: {
            "requests": len(values),
            "p50_ms": percentile(values, 0.5),
            "p99_ms": percentile(values, 0.99),
        }
        for cohort, values in sorted(latencies.items())
    }
    return TrafficSummary(
        requests=len(records),
        non_2xx=sum(1 for r in records if not 200 <= r.status < 300),
        statuses=dict(statuses),
        failovers=sum(1 for r in records if r.failover),
        by_cohort=by_cohort,
        by_artifact=dict(Counter(r.artifact_id for r in records if r.artifact_id)),
        invalid_answers=sum(1 for r in records if 200 <= r.status < 300 and r.error is not None),
    )


def cohort_share(
    records: Sequence[RequestRecord], start_s: float, end_s: float
) -> dict[str, float]:
    """Share of answered requests per cohort among those started in [start_s, end_s)."""
    window = [r for r in records if start_s <= r.start_s < end_s and r.cohort]
    if not window:
        return {}
    counts = Counter(r.cohort for r in window)
    return {cohort: n / len(window) for cohort, n in counts.items()}


def switches_per_user(records: Sequence[RequestRecord]) -> dict[str, list[str]]:
    """For each user, the sequence of distinct cohorts it was answered by, in start order."""
    seen: dict[str, list[str]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r.start_s):
        if r.cohort is None or r.failover:
            continue
        path = seen[r.user]
        if not path or path[-1] != r.cohort:
            path.append(r.cohort)
    return dict(seen)


def write_records(records: Sequence[RequestRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in records]))


def plot_timeline(
    records: Sequence[RequestRecord],
    path: Path,
    *,
    weights: Sequence[tuple[float, float]] = (),
    phases: Sequence[tuple[float, str]] = (),
    title: str = "rollout timeline",
    bin_s: float = 1.0,
) -> Path:
    """Weights (canary %, as set), observed canary share, latency p50/p99 per cohort, and
    failed requests over time, in one PNG. ``weights``: (t, canary percent) steps;
    ``phases``: (t, label) markers; t in seconds since the run began."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((r.start_s for r in records), default=0.0) + bin_s
    bins = max(1, int(end / bin_s))
    share_t, share_v = [], []
    lat: dict[str, tuple[list[float], list[float], list[float]]] = defaultdict(lambda: ([], [], []))
    for b in range(bins):
        lo, hi = b * bin_s, (b + 1) * bin_s
        window = [r for r in records if lo <= r.start_s < hi]
        answered = [r for r in window if r.cohort]
        if answered:
            share_t.append(lo + bin_s / 2)
            share_v.append(100.0 * sum(r.cohort == CANARY for r in answered) / len(answered))
        for cohort in COHORTS:
            values = [r.latency_ms for r in answered if r.cohort == cohort]
            ts, p50, p99 = lat[cohort]
            ts.append(lo + bin_s / 2)
            # NaN where a cohort had no traffic: the line breaks instead of bridging the gap.
            p50.append(percentile(values, 0.5) if values else math.nan)
            p99.append(percentile(values, 0.99) if values else math.nan)
    failed = [r for r in records if not 200 <= r.status < 300]

    fig, (ax_w, ax_l) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    if weights:
        wt = [t for t, _ in weights] + [end]
        wv = [w for _, w in weights] + [weights[-1][1]]
        ax_w.step(
            wt, wv, where="post", color="tab:orange", linewidth=2, label="canary weight (set)"
        )
    ax_w.plot(
        share_t, share_v, ".", color="tab:blue", markersize=4, label="canary share (observed)"
    )
    for i, (t, label) in enumerate(phases):
        for ax in (ax_w, ax_l):
            ax.axvline(t, color="grey", linewidth=0.6, linestyle=":")
        # Staggered heights keep labels of phases that follow each other quickly readable.
        ax_w.annotate(label, (t, 103 + 9 * (i % 3)), fontsize=7, annotation_clip=False)
    ax_w.set_ylabel("% of traffic to canary")
    ax_w.set_ylim(-5, 105)
    ax_w.legend(loc="center right", fontsize=8)
    colors = {"stable": "tab:green", "canary": "tab:red"}
    for cohort, (ts, p50, p99) in lat.items():
        if all(math.isnan(v) for v in p50):
            continue
        ax_l.plot(ts, p50, "-", color=colors.get(cohort), linewidth=1, label=f"{cohort} p50")
        ax_l.plot(ts, p99, "--", color=colors.get(cohort), linewidth=1, label=f"{cohort} p99")
    if failed:
        ax_l.plot(
            [r.start_s for r in failed],
            [r.latency_ms for r in failed],
            "x",
            color="black",
            label=f"failed ({len(failed)})",
        )
    ax_l.set_ylabel("latency (ms)")
    ax_l.set_xlabel("seconds since traffic started")
    ax_l.legend(loc="upper right", fontsize=8, ncol=3)
    ok = sum(1 for r in records if 200 <= r.status < 300)
    fig.suptitle(f"{title}: {len(records)} requests, {ok} ok, {len(failed)} failed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
