"""The verified artifact cache: every rejection rule on real files, atomicity under a real
kill, concurrent fetchers, eviction under leases."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from app.cache import ArtifactCache, CacheLimits
from app.errors import ArtifactRejected, LoadCancelled
from app.loading.control import LoadControl
from app.manifest import MANIFEST_NAME, SIGNATURE_NAME
from app.polling import wait_until
from app.signing import generate_keypair
from tests.file_artifacts import HeldFileServer, file_entry, make_file_artifact, rewrite_manifest

PAYLOAD = {"weights.bin": os.urandom(300_000), "conf/normalization.json": b'{"a": 1}'}


def assert_nothing_published(cache: ArtifactCache) -> None:
    assert list(cache.artifacts_dir.iterdir()) == []
    assert list(cache.tmp_dir.iterdir()) == []


def rejected(cache: ArtifactCache, uri: str, digest: str) -> ArtifactRejected:
    with pytest.raises(ArtifactRejected) as info:
        cache.fetch_verified(uri, digest)
    assert_nothing_published(cache)
    return info.value


@pytest.fixture
def artifact(tmp_path: Path):
    return make_file_artifact(tmp_path, PAYLOAD)


@pytest.fixture
def cache(tmp_path: Path) -> ArtifactCache:
    return ArtifactCache(tmp_path / "cache")


def test_fetch_publishes_one_verified_content_addressed_copy(artifact, cache):
    got = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    assert got.path == cache.artifacts_dir / artifact.manifest_sha256
    assert not got.cached
    assert got.read_verified("weights.bin") == PAYLOAD["weights.bin"]
    assert (got.path / MANIFEST_NAME).read_bytes() == (
        artifact.out_dir / MANIFEST_NAME
    ).read_bytes()
    again = cache.fetch_verified(str(artifact.out_dir / MANIFEST_NAME), artifact.manifest_sha256)
    assert again.cached and again.path == got.path
    assert list(cache.tmp_dir.iterdir()) == []


def test_fetch_over_http(artifact, cache):
    server = HeldFileServer(artifact.out_dir.parent)
    with server.running():
        got = cache.fetch_verified(
            server.uri(f"{artifact.out_dir.name}/{MANIFEST_NAME}"), artifact.manifest_sha256
        )
    assert got.read_verified("conf/normalization.json") == b'{"a": 1}'


def test_manifest_digest_mismatch(artifact, cache):
    err = rejected(cache, artifact.manifest_uri, "0" * 64)
    assert err.category == "manifest_digest"


def test_manifest_that_is_not_a_manifest(artifact, cache):
    bad = artifact.out_dir / MANIFEST_NAME
    bad.write_bytes(b'{"model": "ranker"}')
    from app.manifest import sha256_hex

    err = rejected(cache, artifact.manifest_uri, sha256_hex(bad.read_bytes()))
    assert err.category == "schema"
    assert "artifact_id" in err.detail or "files" in err.detail


@pytest.mark.parametrize(
    "bad_path",
    [
        "../outside.bin",
        "/etc/passwd",
        "dir\\file.bin",
        "ctl\x07.bin",
        "./weights.bin",
        "a//b.bin",
        "conf/../weights.bin",
        ".complete.json",
    ],
)
def test_unsafe_paths_are_rejected(artifact, cache, bad_path):
    def mutate(doc):
        doc["files"].append(file_entry(bad_path, b"x"))

    digest = rewrite_manifest(artifact, mutate)
    err = rejected(cache, artifact.manifest_uri, digest)
    assert err.category == "path", err


def test_duplicate_paths_after_normalisation(artifact, cache):
    def mutate(doc):
        doc["files"].append(file_entry("WEIGHTS.bin", b"x"))

    err = rejected(cache, artifact.manifest_uri, rewrite_manifest(artifact, mutate))
    assert err.category == "path" and "duplicate" in err.detail


def test_symlink_in_place_of_a_listed_file(artifact, cache, tmp_path):
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(PAYLOAD["weights.bin"])
    (artifact.out_dir / "weights.bin").unlink()
    (artifact.out_dir / "weights.bin").symlink_to(target)
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "path" and "symlink" in err.detail


def test_special_file_in_artifact(artifact, cache):
    os.mkfifo(artifact.out_dir / "pipe")
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "path"


@pytest.mark.parametrize(
    ("limits", "fragment"),
    [
        (CacheLimits(max_files=1), "files"),
        (CacheLimits(max_file_bytes=1000), "weights.bin"),
        (CacheLimits(max_total_bytes=1000), "artifact declares"),
    ],
)
def test_limits(artifact, tmp_path, limits, fragment):
    cache = ArtifactCache(tmp_path / "limited", limits=limits)
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "limits" and fragment in err.detail


def test_missing_file(artifact, cache):
    (artifact.out_dir / "conf/normalization.json").unlink()
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "missing" and "normalization.json" in err.detail


def test_extra_file(artifact, cache):
    (artifact.out_dir / "conf" / "surprise.py").write_text("print('pwned')")
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "extra" and "surprise.py" in err.detail


def test_truncated_file(artifact, cache):
    path = artifact.out_dir / "weights.bin"
    path.write_bytes(path.read_bytes()[:-1000])
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "size"


def test_truncated_file_over_http_is_caught_while_streaming(artifact, cache):
    # HTTP cannot list the directory, so the size check happens on the bytes received.
    path = artifact.out_dir / "weights.bin"
    path.write_bytes(path.read_bytes()[:-1000])
    server = HeldFileServer(artifact.out_dir.parent)
    with server.running():
        err = rejected(
            cache,
            server.uri(f"{artifact.out_dir.name}/{MANIFEST_NAME}"),
            artifact.manifest_sha256,
        )
    assert err.category == "size"


def test_file_larger_than_declared_over_http(artifact, cache):
    path = artifact.out_dir / "weights.bin"
    path.write_bytes(path.read_bytes() + b"trailing")
    server = HeldFileServer(artifact.out_dir.parent)
    with server.running():
        err = rejected(
            cache,
            server.uri(f"{artifact.out_dir.name}/{MANIFEST_NAME}"),
            artifact.manifest_sha256,
        )
    assert err.category == "size" and "larger" in err.detail


def test_flipped_byte(artifact, cache):
    path = artifact.out_dir / "weights.bin"
    data = bytearray(path.read_bytes())
    data[12345] ^= 0x01
    path.write_bytes(bytes(data))
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "digest" and "weights.bin" in err.detail


class TestSignatures:
    @pytest.fixture
    def keys(self, tmp_path):
        generate_keypair(tmp_path / "sign.pem", tmp_path / "trust.pem")
        generate_keypair(tmp_path / "other.pem", tmp_path / "other-pub.pem")
        return tmp_path

    def test_signed_artifact_verifies(self, keys, tmp_path):
        result = make_file_artifact(tmp_path, PAYLOAD, "signed-1", sign_key=keys / "sign.pem")
        cache = ArtifactCache(tmp_path / "c", trust_key=keys / "trust.pem")
        got = cache.fetch_verified(result.manifest_uri, result.manifest_sha256)
        assert (got.path / SIGNATURE_NAME).is_file()

    def test_unsigned_artifact_with_trust_key(self, keys, tmp_path, artifact):
        cache = ArtifactCache(tmp_path / "c", trust_key=keys / "trust.pem")
        err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
        assert err.category == "signature" and "unsigned" in err.detail

    def test_signed_with_another_key(self, keys, tmp_path):
        result = make_file_artifact(tmp_path, PAYLOAD, "signed-2", sign_key=keys / "other.pem")
        cache = ArtifactCache(tmp_path / "c", trust_key=keys / "trust.pem")
        err = rejected(cache, result.manifest_uri, result.manifest_sha256)
        assert err.category == "signature"

    def test_manifest_edited_after_signing(self, keys, tmp_path):
        result = make_file_artifact(tmp_path, PAYLOAD, "signed-3", sign_key=keys / "sign.pem")

        def mutate(doc):
            doc["metadata"]["offline_eval"] = {"ndcg": 0.99}

        digest = rewrite_manifest(result, mutate)
        cache = ArtifactCache(tmp_path / "c", trust_key=keys / "trust.pem")
        err = rejected(cache, result.manifest_uri, digest)
        assert err.category == "signature"


def test_artifact_larger_than_cache_budget(artifact, tmp_path):
    cache = ArtifactCache(tmp_path / "small", byte_budget=1000)
    err = rejected(cache, artifact.manifest_uri, artifact.manifest_sha256)
    assert err.category == "budget"


def test_tampering_with_cached_copy_is_detected_on_read_and_refetched(artifact, cache):
    got = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    cached_file = got.path / "weights.bin"
    cached_file.chmod(0o644)
    data = bytearray(cached_file.read_bytes())
    data[0] ^= 0xFF
    cached_file.write_bytes(bytes(data))
    with pytest.raises(ArtifactRejected) as info:
        got.read_verified("weights.bin")
    assert info.value.category == "digest"
    # A full re-check sets the corrupted entry aside and fetches a good copy.
    fresh = cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256, recheck="digests")
    assert not fresh.cached
    assert fresh.read_verified("weights.bin") == PAYLOAD["weights.bin"]


FETCH_SCRIPT = textwrap.dedent(
    """
    import sys
    from app.cache import ArtifactCache
    cache = ArtifactCache(sys.argv[1])
    art = cache.fetch_verified(sys.argv[2], sys.argv[3])
    print(art.path, flush=True)
    """
)


def test_fetch_killed_midway_leaves_no_entry_and_is_swept(tmp_path):
    big = os.urandom(4 << 20)
    result = make_file_artifact(tmp_path, {"weights.bin": big}, "big-1")
    server = HeldFileServer(tmp_path, held="weights.bin", held_after=1 << 20)
    root = tmp_path / "cache"
    ArtifactCache(root)
    with server.running():
        uri = server.uri(f"big-1/{MANIFEST_NAME}")
        proc = subprocess.Popen(
            [sys.executable, "-c", FETCH_SCRIPT, str(root), uri, result.manifest_sha256],
            cwd=Path(__file__).resolve().parents[3],
        )
        try:
            assert server.holding.wait(30), "download never started"

            def partial_written() -> bool:
                return any(p.stat().st_size > 0 for p in (root / "tmp").rglob("weights.bin"))

            wait_until(partial_written, 20.0, "partial file in the temp dir", every=0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert list((root / "artifacts").iterdir()) == [], "a killed fetch published an entry"
        assert len(list((root / "tmp").iterdir())) == 1
        server.release.set()
        reopened = ArtifactCache(root)
        assert len(reopened.swept) == 1
        assert list(reopened.tmp_dir.iterdir()) == []
        got = reopened.fetch_verified(uri, result.manifest_sha256)
        assert got.read_verified("weights.bin") == big


def _fetch_in_process(root: str, uri: str, digest: str, out: multiprocessing.Queue) -> None:
    art = ArtifactCache(root).fetch_verified(uri, digest)
    out.put(str(art.path))


def test_concurrent_fetches_end_with_one_copy_and_one_download(tmp_path):
    result = make_file_artifact(tmp_path, {"weights.bin": os.urandom(2 << 20)}, "shared-1")
    server = HeldFileServer(tmp_path, held="weights.bin", held_after=4096)
    downloads = []
    original = server.httpd.RequestHandlerClass.copyfile

    def counting_copyfile(handler, source, outputfile):
        if handler.path.endswith("weights.bin"):
            downloads.append(handler.path)
        return original(handler, source, outputfile)

    server.httpd.RequestHandlerClass.copyfile = counting_copyfile
    root = tmp_path / "cache"
    ArtifactCache(root)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with server.running():
        uri = server.uri(f"shared-1/{MANIFEST_NAME}")
        procs = [
            ctx.Process(
                target=_fetch_in_process, args=(str(root), uri, result.manifest_sha256, out)
            )
            for _ in range(2)
        ]
        for p in procs:
            p.start()
        threads_out: list[str] = []
        threads = [
            threading.Thread(
                target=lambda: threads_out.append(
                    str(ArtifactCache(root).fetch_verified(uri, result.manifest_sha256).path)
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        assert server.holding.wait(30)
        server.release.set()
        for t in threads:
            t.join(60)
        paths = {out.get(timeout=60) for _ in procs} | set(threads_out)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    assert paths == {str(root / "artifacts" / result.manifest_sha256)}
    assert len(list((root / "artifacts").iterdir())) == 1
    assert list((root / "tmp").iterdir()) == []
    assert len(downloads) == 1, f"expected one download, saw {len(downloads)}"


def test_eviction_is_lru_and_never_removes_a_leased_entry(tmp_path):
    size = 100_000
    arts = [make_file_artifact(tmp_path, {"w.bin": os.urandom(size)}, f"art-{i}") for i in range(4)]
    cache = ArtifactCache(tmp_path / "cache", byte_budget=int(size * 2.5))
    a0, a1, a2, a3 = arts
    lease0 = cache.lease(a0.manifest_sha256)
    cache.fetch_verified(a0.manifest_uri, a0.manifest_sha256)
    cache.fetch_verified(a1.manifest_uri, a1.manifest_sha256)
    # a0 is the least recently used, but it is leased: a1 goes instead.
    cache.fetch_verified(a2.manifest_uri, a2.manifest_sha256)
    present = {d for d, _, _ in cache.entries()}
    assert present == {a0.manifest_sha256, a2.manifest_sha256}
    assert cache.total_bytes() <= cache.byte_budget
    # Releasing the lease makes a0 evictable; a2 is leased now and must stay.
    lease0.release()
    with cache.lease(a2.manifest_sha256):
        cache.fetch_verified(a3.manifest_uri, a3.manifest_sha256)
        present = {d for d, _, _ in cache.entries()}
        assert present == {a2.manifest_sha256, a3.manifest_sha256}


def test_eviction_with_everything_leased_removes_nothing(tmp_path):
    arts = [make_file_artifact(tmp_path, {"w.bin": os.urandom(1000)}, f"e-{i}") for i in range(2)]
    cache = ArtifactCache(tmp_path / "cache", byte_budget=1500)
    leases = [cache.lease(a.manifest_sha256) for a in arts]
    for a in arts:
        cache.fetch_verified(a.manifest_uri, a.manifest_sha256)
    assert cache.evict() == []
    assert len(cache.entries()) == 2
    for lease in leases:
        lease.release()
    assert len(cache.evict()) == 1


class RecordingPacer:
    """A pacer (app.loading.control's interface) that notes which threads reach a checkpoint and
    holds up the stream's hashing thread, so a read that did not wait for it would overwrite
    the bytes it is still hashing."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.threads: set[str] = set()
        self.hold_s = hold_s
        self.paused_s = 0.0

    def checkpoint(self) -> None:
        name = threading.current_thread().name
        self.threads.add(name.rsplit("_", 1)[0])
        if name.startswith(("verify-hash", "fetch-hash")):
            time.sleep(self.hold_s)


BIG_PAYLOAD = {"weights.bin": os.urandom(3 * (8 << 20) + 12_345)}


def test_a_stream_hashes_on_its_own_thread_while_the_next_chunk_is_read(tmp_path):
    art = make_file_artifact(tmp_path, BIG_PAYLOAD)
    got = ArtifactCache(tmp_path / "cache").fetch_verified(art.manifest_uri, art.manifest_sha256)
    pacer = RecordingPacer()
    data = got.read_verified("weights.bin", LoadControl(pacer=pacer))
    assert data == BIG_PAYLOAD["weights.bin"]
    assert {"verify-hash", "MainThread"} <= pacer.threads


def test_a_buffer_read_into_again_waits_until_its_last_chunk_is_hashed(tmp_path):
    """One 8 MiB buffer for every chunk while the hashing thread lags: each read must wait
    for the hash of the bytes it would overwrite, else the digest comes out wrong."""
    art = make_file_artifact(tmp_path, BIG_PAYLOAD)
    got = ArtifactCache(tmp_path / "cache").fetch_verified(art.manifest_uri, art.manifest_sha256)
    buffer = memoryview(bytearray(8 << 20))
    seen = bytearray()
    with got.open_stream("weights.bin", LoadControl(pacer=RecordingPacer(hold_s=0.05))) as stream:
        while stream.position < stream.size:
            n = min(len(buffer), stream.size - stream.position)
            stream.readinto(buffer[:n])
            seen += buffer[:n]
        stream.finish()  # raises ``digest`` if any chunk was hashed after being overwritten
    assert seen == BIG_PAYLOAD["weights.bin"]


def test_a_byte_changed_in_the_cache_while_hashing_lags_is_still_caught(tmp_path):
    art = make_file_artifact(tmp_path, BIG_PAYLOAD)
    got = ArtifactCache(tmp_path / "cache").fetch_verified(art.manifest_uri, art.manifest_sha256)
    cached = got.path / "weights.bin"
    cached.chmod(0o644)
    with open(cached, "r+b") as fh:
        fh.seek(2 * (8 << 20) + 5)
        fh.write(bytes([BIG_PAYLOAD["weights.bin"][2 * (8 << 20) + 5] ^ 0x01]))
    with pytest.raises(ArtifactRejected) as info:
        got.read_verified("weights.bin", LoadControl(pacer=RecordingPacer(hold_s=0.02)))
    assert info.value.category == "digest"


def test_a_cancelled_stream_stops_within_a_chunk_while_its_hashing_runs_behind(tmp_path):
    art = make_file_artifact(tmp_path, BIG_PAYLOAD)
    got = ArtifactCache(tmp_path / "cache").fetch_verified(art.manifest_uri, art.manifest_sha256)
    control = LoadControl(pacer=RecordingPacer())
    chunks = 0
    with pytest.raises(LoadCancelled), got.open_stream("weights.bin", control) as stream:
        buffers = [memoryview(bytearray(8 << 20)) for _ in range(2)]
        while stream.position < stream.size:
            n = min(8 << 20, stream.size - stream.position)
            stream.readinto(buffers[chunks % 2][:n])
            chunks += 1
            if chunks == 1:
                control.cancel("a newer target")
        stream.finish()
    assert chunks <= 2  # stopped within one chunk of the cancel


def test_a_cold_fetch_hashes_and_writes_on_threads_of_their_own_and_feeds_in_file_order(
    tmp_path,
):
    art = make_file_artifact(tmp_path, BIG_PAYLOAD)
    pacer = RecordingPacer(hold_s=0.03)
    fed = bytearray()

    class Sink:
        def start(self, manifest):
            return {"weights.bin": lambda view: fed.extend(view)}

    cache = ArtifactCache(tmp_path / "cache")
    got = cache.fetch_verified(
        art.manifest_uri, art.manifest_sha256, control=LoadControl(pacer=pacer), sink=Sink()
    )
    assert fed == BIG_PAYLOAD["weights.bin"]
    assert (got.path / "weights.bin").read_bytes() == BIG_PAYLOAD["weights.bin"]
    assert "fetch-hash" in pacer.threads
