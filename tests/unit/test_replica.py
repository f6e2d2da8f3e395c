"""The replica core (app.replica) without Ray: real demo artifacts, real cache, real torch.

What a Ray Serve shell cannot show cheaply: reconfigure never raises once the replica has
started (a raising reconfigure kills it and its replacements), a cleared target retires the
serving model, and fault injection is inert unless the process environment allows it.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.cache import NODE_CACHE_DIR_ENV
from app.contracts import FaultInjection, WireRequest
from app.demo_artifacts import make_demo_artifacts
from app.errors import ConfigError, ReplicaNotReady
from app.faults import FAULT_INJECTION_ENV, NO_FAULT
from app.models.ranker_mlp.features import NUM_FEATURES
from app.packing import PackResult
from app.polling import wait_until
from app.replica import RankerReplica
from tests.artifacts import pack_ranker

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackResult]:
    out = tmp_path_factory.mktemp("demo")
    return {p.artifact_id: p for p in make_demo_artifacts(out)}


def target(packed: PackResult, revision: int) -> dict[str, Any]:
    return packed.target(revision).model_dump(mode="json")


def config(tmp: Path, cohort: str = "canary", **changes: Any) -> dict[str, Any]:
    return {
        "cohort": cohort,
        "cache_dir": str(tmp / "cache"),
        "retry": {"initial_s": 0.01, "cap_s": 0.02, "max_attempts": 2},
        **changes,
    }


def request() -> WireRequest:
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(4, NUM_FEATURES)).astype(np.float32)
    return WireRequest(("a", "b", "c", "d"), feats, {}, 2)


@pytest.fixture
def replica() -> Iterator[RankerReplica]:
    r = RankerReplica("r-test", loader_nice=0)
    yield r
    r.close()


@pytest.fixture
def serving(replica: RankerReplica, demo, tmp_path: Path) -> RankerReplica:
    assert replica.reconfigure(config(tmp_path, target=target(demo["ranker-v42"], 5)))
    assert replica.rank([request()]).model.artifact_id == "ranker-v42"
    return replica


# --------------------------------------------------------------------------- bad configs


def test_an_invalid_first_config_raises(replica: RankerReplica, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"user_config\.batching\.max_batch_size"):
        replica.reconfigure(config(tmp_path, batching={"max_batch_size": 0}))
    assert not replica.has_config


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"batching": {"max_batch_size": 0}}, "user_config.batching.max_batch_size"),
        ({"colour": "red"}, "user_config.colour"),
        ({"target": {"revision": "six"}}, "user_config.target.revision"),
        ({"cohort": "stable"}, "user_config.cohort"),
        ({"loading": {"cpu_share": 0}}, "user_config.loading.cpu_share"),
        # These once killed the reporter thread and the reconciler's worker (a wait overflow).
        ({"report_interval_s": 1e12}, "user_config.report_interval_s"),
        (
            {"retry": {"initial_s": 0.01, "cap_s": 1e12, "max_attempts": 2}},
            "user_config.retry.cap_s",
        ),
    ],
)
def test_an_invalid_config_on_a_serving_replica_is_refused_not_raised(
    serving: RankerReplica, tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    before = serving.config
    good = config(tmp_path, target=target_of(serving))
    assert serving.reconfigure({**good, **change}) is False  # no exception
    assert serving.config == before
    report = serving.report()
    err = report.last_error
    assert err is not None and err.category == "config" and err.field == field, err
    assert report.config_error == err
    assert (report.actual_artifact, report.phase) == ("ranker-v42", "ready")
    assert serving.rank([request()]).model.artifact_id == "ranker-v42"
    # The good config again clears the error (even though it changes nothing).
    assert serving.reconfigure(good) is False
    assert serving.report().last_error is None and serving.report().config_error is None


def target_of(replica: RankerReplica) -> dict[str, Any]:
    t = replica.config.target
    assert t is not None
    return t.model_dump()


def test_a_later_load_failure_shows_over_an_older_config_error(
    serving: RankerReplica, tmp_path: Path, demo
) -> None:
    good = config(tmp_path, target=target_of(serving))
    serving.reconfigure({**good, "colour": "red"})
    broken = {**target(demo["ranker-v41"], 6), "manifest_sha256": "0" * 64}
    serving.reconfigure(config(tmp_path, target=broken))
    wait_until(
        lambda: serving.report().phase == "failed", TIMEOUT, "the broken target failed", every=0.01
    )
    report = serving.report()
    assert report.last_error is not None and report.last_error.revision == 6
    assert report.actual_artifact == "ranker-v42"


def test_installed_at_says_since_when_the_serving_model_serves(
    replica: RankerReplica, tmp_path: Path, demo
) -> None:
    before = time.time()
    replica.reconfigure(config(tmp_path, target=target(demo["ranker-v42"], 5)))
    first = replica.report().installed_at
    assert first is not None and before <= first <= time.time()
    # A failed candidate leaves the serving model, and so its time, alone.
    broken = {**target(demo["ranker-v41"], 6), "manifest_sha256": "0" * 64}
    replica.reconfigure(config(tmp_path, target=broken))
    wait_until(
        lambda: replica.report().phase == "failed", TIMEOUT, "the broken target failed", every=0.01
    )
    assert replica.report().installed_at == first
    replica.reconfigure(config(tmp_path, target=target(demo["ranker-v41"], 7)))
    wait_until(
        lambda: replica.report().actual_revision == 7, TIMEOUT, "revision 7 installed", every=0.01
    )
    second = replica.report().installed_at
    assert second is not None and second > first
    replica.reconfigure(config(tmp_path, target=None))  # an idle pool serves nothing
    assert replica.report().installed_at is None


def test_background_loads_are_paced_and_the_startup_load_is_not(
    replica: RankerReplica, tmp_path: Path, demo
) -> None:
    # A small share pauses after every burst (about 5 ms of CPU). The demo model's whole
    # background load can take less than one burst on a fast run: this one takes many
    # (17 MiB to hash and load, a wide dry run).
    wide = pack_ranker(
        tmp_path / "store",
        artifact_id="ranker-paced",
        params={"hidden_dim": 2048, "num_layers": 2, "context_dim": 8},
    )
    cfg = config(tmp_path, loading={"cpu_share": 0.2})
    replica.reconfigure({**cfg, "target": target(demo["ranker-v42"], 5)})
    assert replica.report().timings.paced == 0.0  # nothing serves here until it is done
    replica.reconfigure({**cfg, "target": target(wide, 6)})
    wait_until(
        lambda: replica.report().actual_revision == 6, TIMEOUT, "revision 6 installed", every=0.01
    )
    assert replica.report().timings.paced > 0.0
    replica.reconfigure(
        {**cfg, "loading": {"cpu_share": 1.0}, "target": target(demo["ranker-v42"], 7)}
    )
    wait_until(
        lambda: replica.report().actual_revision == 7, TIMEOUT, "revision 7 installed", every=0.01
    )
    assert replica.report().timings.paced == 0.0  # a full share: unpaced


def test_a_long_load_reports_its_progress_and_a_newer_target_cancels_it(
    serving: RankerReplica, tmp_path: Path, demo
) -> None:
    # ~200 MiB of weights at a tenth of a core: long enough to watch, and to cancel.
    wide = pack_ranker(
        tmp_path / "store",
        artifact_id="ranker-wide",
        params={"hidden_dim": 4096, "num_layers": 4, "context_dim": 16},
    )
    cfg = config(tmp_path, loading={"cpu_share": 0.1})
    serving.reconfigure({**cfg, "target": target(wide, 6)})
    seen: list[Any] = []

    def moved() -> bool:
        progress = serving.report().progress
        if progress is not None and progress.done_bytes > 0:
            seen.append(progress)
        return len({(p.stage, p.done_bytes) for p in seen}) >= 3

    wait_until(moved, TIMEOUT, "progress of the wide load", every=0.02)
    last = seen[-1]
    assert (last.revision, last.artifact_id) == (6, "ranker-wide")
    assert last.stage in ("fetch", "load") and 0 < last.done_bytes < last.total_bytes
    assert last.total_bytes >= wide_bytes(wide)
    assert serving.rank([request()]).model.artifact_id == "ranker-v42"  # still serving

    serving.reconfigure({**cfg, "target": target(demo["ranker-v41"], 7)})
    wait_until(
        lambda: serving.report().actual_revision == 7, TIMEOUT, "revision 7 installed", every=0.01
    )
    report = serving.report()
    assert report.last_error is None and report.progress is None
    # Stopped at a checkpoint, not loaded to its end and then dropped.
    assert 6 not in report.discarded_revisions and 6 in report.cancelled_revisions


def wide_bytes(packed: PackResult) -> int:
    return (packed.out_dir / "weights.safetensors").stat().st_size


# --------------------------------------------------------------------------- cleared target


def test_a_cleared_target_retires_the_model_and_a_newer_one_loads(
    serving: RankerReplica, tmp_path: Path, demo
) -> None:
    model = serving._holder.current.model  # type: ignore[union-attr]
    # The serving model's offline evaluation travels in its reports (the router's fallback
    # guard reads it); numbers only.
    assert serving.report().evaluation == {"auc": 0.786, "examples": 200000.0, "ndcg_at_10": 0.419}
    assert serving.reconfigure(config(tmp_path, target=None)) is True
    report = serving.report()
    assert (report.phase, report.actual_revision, report.actual_artifact) == ("idle", None, None)
    assert report.desired_revision is None and report.evaluation == {}
    with pytest.raises(ReplicaNotReady):
        serving.rank([request()])
    assert serving._holder.wait_idle(TIMEOUT) and model.closed  # cleaned up, lease released
    # A later target loads in the background (the replica is running: no blocking load).
    assert serving.reconfigure(config(tmp_path, target=target(demo["ranker-v41"], 6)))
    wait_until(
        lambda: serving.report().actual_revision == 6, TIMEOUT, "revision 6 installed", every=0.01
    )
    assert serving.rank([request()]).model.artifact_id == "ranker-v41"
    assert serving.report().phase == "ready"
    assert serving.report().evaluation["ndcg_at_10"] == 0.412


def test_an_older_revision_after_a_clear_is_ignored(
    serving: RankerReplica, tmp_path: Path, demo
) -> None:
    serving.reconfigure(config(tmp_path, target=None))
    serving.reconfigure(config(tmp_path, target=target(demo["ranker-v41"], 4)))
    assert serving._reconciler.wait_settled(TIMEOUT)
    report = serving.report()
    assert report.actual_revision is None and report.phase == "idle"


def test_a_failed_target_on_an_idle_running_replica_is_reported_not_raised(
    replica: RankerReplica, tmp_path: Path, demo
) -> None:
    replica.reconfigure(config(tmp_path))  # an idle pool starts with no target
    broken = {**target(demo["ranker-v41"], 2), "feature_schema": "ranker-features-v2"}
    assert replica.reconfigure(config(tmp_path, target=broken))  # no exception
    wait_until(
        lambda: replica.report().phase == "failed", TIMEOUT, "the broken target failed", every=0.01
    )
    assert replica.report().last_error.category == "schema"  # type: ignore[union-attr]


# --------------------------------------------------------------------------- fault injection


FAULTS = {"extra_latency_ms": 250.0, "error_rate": 0.5}


def test_faults_are_ignored_and_reported_without_the_environment_switch(
    serving: RankerReplica, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    assert serving.reconfigure(config(tmp_path, target=target_of(serving), faults=FAULTS))
    assert serving.config.faults is not None  # accepted ...
    assert all(serving.plan_fault() == NO_FAULT for _ in range(200))  # ... but inert
    assert serving.report().faults is None
    err = serving.report().last_error
    assert err is not None and err.category == "config" and err.field == "user_config.faults"


def test_faults_take_effect_where_the_environment_allows_them(
    serving: RankerReplica, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "allow")
    assert serving.reconfigure(config(tmp_path, target=target_of(serving), faults=FAULTS))
    plans = [serving.plan_fault() for _ in range(2000)]
    assert {p.delay_s for p in plans} == {0.25}
    failed = sum(p.fail for p in plans) / len(plans)
    assert 0.4 < failed < 0.6, failed
    report = serving.report()
    assert report.last_error is None and report.faults == FaultInjection(**FAULTS)
    always = {"error_rate": 1.0}
    serving.reconfigure(config(tmp_path, target=target_of(serving), faults=always))
    assert all(serving.plan_fault().fail for _ in range(100))
    # Faults off again: no plan, and nothing reported.
    serving.reconfigure(config(tmp_path, target=target_of(serving)))
    assert serving.plan_fault() == NO_FAULT


def test_the_report_carries_the_memory_figures_of_an_in_place_promotion(
    replica: RankerReplica, demo, tmp_path: Path
) -> None:
    idle = replica.report().capacity.memory
    assert idle.resident_bytes == 0 and idle.load_peak_bytes is None
    capacity = 1 << 30
    cfg = config(
        tmp_path, target=target(demo["ranker-v42"], 5), memory={"capacity_bytes": capacity}
    )
    assert replica.reconfigure(cfg)
    memory = replica.report().capacity.memory
    model = replica._holder.current.model  # type: ignore[union-attr]
    assert memory.resident_bytes == model.param_bytes > 0
    assert memory.capacity_bytes == capacity  # the configured budget wins over the device's
    assert memory.load_peak_bytes == model.memory.single_buffer_peak > model.param_bytes


# --------------------------------------------------------------------------- secrets in errors

# Nothing listens on port 1: the fetch fails at once, and the transport error names the URL.
SECRET_URI = "https://user:hunter2@127.0.0.1:1/m.json?X-Amz-Signature=sekrit"
SECRETS = ("hunter2", "sekrit")


def leaky_target(packed: PackResult, revision: int) -> dict[str, Any]:
    return {**target(packed, revision), "manifest_uri": SECRET_URI}


def logged(records: list[logging.LogRecord]) -> str:
    """What the service logs: its own lines at every level, any library's from INFO up
    (fsspec's DEBUG lines name every URL it opens, as given)."""
    return "\n".join(
        r.getMessage() for r in records if r.name.startswith("app.") or r.levelno >= logging.INFO
    )


def test_a_failed_background_load_shows_no_secret_of_its_uri(
    serving: RankerReplica, tmp_path: Path, demo, caplog
) -> None:
    with caplog.at_level(logging.DEBUG):
        serving.reconfigure(config(tmp_path, target=leaky_target(demo["ranker-v41"], 6)))
        wait_until(
            lambda: serving.report().phase == "failed", TIMEOUT, "the fetch failed", every=0.01
        )
    report = serving.report()
    assert report.last_error is not None and report.last_error.revision == 6
    shown = report.model_dump_json() + logged(caplog.records)
    assert "127.0.0.1:1" in shown  # it still says where it failed
    for secret in SECRETS:
        assert secret not in shown
    assert serving.rank([request()]).model.artifact_id == "ranker-v42"


def test_a_failed_startup_load_raises_no_secret_of_its_uri(
    replica: RankerReplica, tmp_path: Path, demo, caplog
) -> None:
    with caplog.at_level(logging.DEBUG), pytest.raises(Exception) as caught:
        replica.reconfigure(config(tmp_path, target=leaky_target(demo["ranker-v42"], 5)))
    raised = "".join(traceback.format_exception(caught.value))
    assert "127.0.0.1:1" in raised
    for secret in SECRETS:
        assert secret not in raised and secret not in logged(caplog.records)
    # The original error's category survives the redaction: a refused connection is a store
    # that cannot be read now (retried), never an artifact that is not there.
    assert getattr(caught.value, "category", None) == "fetch", caught.value


def test_the_report_names_its_incarnation_and_counts_no_restarts(serving: RankerReplica) -> None:
    first, second = serving.report(), serving.report()
    assert first.incarnation is not None and first.incarnation == second.incarnation
    assert second.seq > first.seq
    assert (second.thread_restarts, second.thread_crash) == (0, None)


@pytest.mark.parametrize("setting", ["cache_dir", "trust_key"])
def test_a_cache_setting_the_replica_cannot_use_is_refused_with_the_config(
    serving: RankerReplica, tmp_path: Path, setting: str
) -> None:
    """A mistyped cache_dir (a directory that is not a cache) or trust_key (no key there) is
    refused when the config arrives, naming the field, not at the next load as a failure."""
    not_a_cache = tmp_path / "home"
    (not_a_cache / "tmp").mkdir(parents=True)
    (not_a_cache / "tmp" / "notes.txt").write_text("keep me")
    bad = {"cache_dir": str(not_a_cache)} if setting == "cache_dir" else {}
    if setting == "trust_key":
        bad["trust_key"] = str(tmp_path / "no-such-key.pem")
    before = serving.config
    good = config(tmp_path, target=target_of(serving))
    assert serving.reconfigure({**good, **bad}) is False
    assert serving.config == before
    err = serving.report().last_error
    assert err is not None and err.category == "config", err
    assert err.field == f"user_config.{setting}", err
    assert (not_a_cache / "tmp" / "notes.txt").read_text() == "keep me"
    assert serving.rank([request()]).model.artifact_id == "ranker-v42"


# --------------------------------------------------------------------------- signatures


@pytest.fixture(scope="module")
def openssf_signed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An EC key pair and two rankers packed with an OpenSSF signature of that key."""
    from app.demo_artifacts import write_ranker_source
    from app.packing import pack_artifact
    from app.signing import generate_keypair

    root = tmp_path_factory.mktemp("openssf")
    generate_keypair(root / "ec.pem", root / "ec.pub", kind="ec-p256")
    packed = {}
    for seed, artifact_id in ((1, "ranker-signed-a"), (2, "ranker-signed-b")):
        write_ranker_source(root / f"src-{artifact_id}", seed=seed)
        packed[artifact_id] = pack_artifact(
            root / f"src-{artifact_id}", root / artifact_id, model="ranker",
            artifact_id=artifact_id, feature_schema="ranker-features-v3",
            sign_key=root / "ec.pem",
        )  # fmt: skip
    return {"public_key": str(root / "ec.pub"), **packed}


def test_a_replica_trusting_an_openssf_key_refuses_a_candidate_the_signature_does_not_cover(
    replica: RankerReplica, tmp_path: Path, openssf_signed: dict[str, Any], demo
) -> None:
    """The replica checks OpenSSF signatures with the same verifier as ``rollout verify``: a
    candidate whose manifest was edited and re-pinned after signing, or that is unsigned, is
    refused (``signature``) and the serving generation keeps answering."""
    from tests.file_artifacts import rewrite_manifest

    trust = {"keys": [openssf_signed["public_key"]]}
    good = openssf_signed["ranker-signed-a"]
    assert replica.reconfigure(config(tmp_path, trust=trust, target=target(good, 1)))
    assert replica.rank([request()]).model.artifact_id == "ranker-signed-a"

    tampered = openssf_signed["ranker-signed-b"]
    (tampered.out_dir / "manifest.json").chmod(0o644)
    repinned = rewrite_manifest(tampered, lambda doc: doc["metadata"].update(promoted_by="me"))
    for revision, candidate, why in (
        (2, {**target(tampered, 2), "manifest_sha256": repinned}, "Signature mismatch"),
        (3, target(demo["ranker-v41"], 3), "unsigned"),
    ):
        replica.reconfigure(config(tmp_path, trust=trust, target=candidate))
        wait_until(
            lambda revision=revision: replica.report().phase == "failed"
            and replica.report().last_error is not None
            and replica.report().last_error.revision == revision,  # type: ignore[union-attr]
            TIMEOUT, f"candidate r{revision} refused", every=0.01,
        )  # fmt: skip
        err = replica.report().last_error
        assert err is not None and err.category == "signature" and why in err.message, err
        assert replica.report().actual_artifact == "ranker-signed-a"
        assert replica.rank([request()]).model.artifact_id == "ranker-signed-a"


def test_a_trust_anchor_the_replica_cannot_read_is_refused_with_the_config(
    serving: RankerReplica, tmp_path: Path
) -> None:
    before = serving.config
    good = config(tmp_path, target=target_of(serving))
    missing = str(tmp_path / "no-such-key.pub")
    assert serving.reconfigure({**good, "trust": {"keys": [missing]}}) is False
    assert serving.config == before
    err = serving.report().last_error
    assert err is not None and err.category == "config", err
    assert err.field == "user_config.trust.keys[0]", err
    assert serving.rank([request()]).model.artifact_id == "ranker-v42"


def test_a_nodes_own_cache_dir_wins_over_the_configs(
    replica: RankerReplica, tmp_path: Path, demo, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_cache = tmp_path / "node-local-disk"
    monkeypatch.setenv(NODE_CACHE_DIR_ENV, str(node_cache))
    replica.reconfigure({**config(tmp_path), "target": target(demo["ranker-v41"], 5)})
    assert replica.report().actual_revision == 5
    cached = [p.name for p in node_cache.rglob("*.safetensors")]
    assert cached, list(node_cache.rglob("*"))
    assert not (tmp_path / "cache").exists()  # the config's cache_dir is not used
