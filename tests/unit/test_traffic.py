"""The traffic generator against a real local HTTP server answering like the router."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.client import RetryPolicy
from rollout.local.traffic import (
    RequestRecord,
    TrafficRun,
    TrafficSpec,
    check_loopback,
    cohort_share,
    plot_timeline,
    summarize,
    switches_per_user,
)


@pytest.fixture
def fake_router():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append(body)
            cohort = "canary" if body["user_id"].endswith("7") else "stable"
            status = 503 if body["user_id"] == "user-13" else 200
            # The service's own answer (app.api.RankResponse), as the load generator reads it.
            payload = json.dumps(
                {
                    "ranking": [
                        {"id": c["id"], "score": 0.5, "label": "relevant"}
                        for c in body["candidates"][:3]
                    ],
                    "model": {
                        "artifact_id": f"a-{cohort}",
                        "revision": 1,
                        "runtime_build": "torch-test",
                        "replica": f"r-{cohort}",
                        "backbone_artifact_id": None,
                        "cohort": cohort,
                    },
                    "failover": False,
                }
            ).encode()
            self.send_response(status)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()
    httpd.server_close()


def test_closed_loop_is_bounded_by_count_and_records_every_request(fake_router):
    url, seen = fake_router
    run = TrafficRun(TrafficSpec(url=url, rate=None, concurrency=4, max_requests=120, users=50))
    records = run.start().join(timeout=60)
    assert len(records) == 120 == len(seen)
    body = seen[0]
    assert len(body["candidates"]) == 20 and len(body["candidates"][0]["features"]) == 80
    summary = summarize(records)
    assert summary.requests == 120
    assert summary.non_2xx == sum(1 for r in records if r.user == "user-13")
    assert set(summary.by_cohort) <= {"stable", "canary"}


def test_open_loop_is_bounded_by_time(fake_router):
    url, _ = fake_router
    run = TrafficRun(TrafficSpec(url=url, rate=40, max_requests=10_000, max_seconds=1.0))
    records = run.start().join(timeout=30)
    assert 20 <= len(records) <= 45
    starts = sorted(r.start_s for r in records)
    assert starts[-1] < 1.5


def test_user_keys_carry_the_prefix_and_records_the_replica(fake_router):
    url, seen = fake_router
    spec = TrafficSpec(url=url, rate=None, concurrency=2, max_requests=30, user_prefix="probe")
    records = TrafficRun(spec).start().join(timeout=60)
    assert len(records) == 30
    assert all(b["user_id"].startswith("probe-") for b in seen)
    assert all(r.replica == f"r-{r.cohort}" and r.attempts == 1 for r in records)


def test_retrying_client_counts_attempts_and_records_a_call_it_gave_up(fake_router):
    url, seen = fake_router
    policy = RetryPolicy(max_attempts=3, initial_s=0.01, cap_s=0.02, deadline_s=10)
    spec = TrafficSpec(url=url, rate=None, concurrency=2, max_requests=60, users=14, retry=policy)
    records = TrafficRun(spec).start().join(timeout=60)
    assert len(records) == 60
    gave_up = [r for r in records if r.user == "user-13"]  # the fake answers it 503, always
    assert gave_up, "the seeded users include user-13"
    for r in gave_up:
        assert (r.status, r.attempts) == (0, 3) and "gave up after 3 attempts" in (r.error or "")
    answered = [r for r in records if r.user != "user-13"]
    assert all(r.status == 200 and r.attempts == 1 and r.cohort for r in answered)
    assert len(seen) == len(answered) + 3 * len(gave_up)


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "http://example.com", "http://192.168.1.2"]
)
def test_only_loopback_targets(url):
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(url)


def test_shares_and_switches():
    recs = [
        RequestRecord(0.1, 1, 200, "u1", "stable"),
        RequestRecord(0.2, 1, 200, "u1", "canary"),
        RequestRecord(0.3, 1, 200, "u1", "canary"),
        RequestRecord(0.4, 1, 200, "u2", "stable"),
        RequestRecord(0.5, 1, 200, "u2", "canary", failover=True),
        RequestRecord(1.5, 1, 200, "u1", "stable"),
    ]
    assert cohort_share(recs, 0, 1) == {"stable": 0.4, "canary": 0.6}
    assert switches_per_user(recs) == {"u1": ["stable", "canary", "stable"], "u2": ["stable"]}


def test_timeline_picture_is_written(tmp_path):
    recs = [
        RequestRecord(i * 0.1, 5 + i % 3, 200, f"u{i}", "stable" if i % 4 else "canary")
        for i in range(50)
    ]
    recs.append(RequestRecord(2.0, 30, 503, "u9", error="draining"))
    out = plot_timeline(recs, tmp_path / "t.png", weights=[(0, 0), (1, 25)], phases=[(1, "step 1")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_2xx_that_is_not_a_rank_answer_is_recorded_without_a_model() -> None:
    from rollout.local.traffic import _answered

    record = _answered(0.0, 1.0, 200, "user-1", {"ranking": [], "model": {"revision": "x"}})
    assert record.status == 200 and record.cohort is None and record.artifact_id is None
    assert record.error is not None and record.error.startswith("not a rank answer")
    summary = summarize([record])
    assert (summary.non_2xx, summary.invalid_answers) == (0, 1)
