"""Reading artifact stores (app.artifact_store) through real servers and real files.

What each failure is: a store out of reach (connection refused, DNS, a stall, a 5xx, a missing
fsspec driver) is ``FetchFailed`` (category ``fetch``, retried); a URI this service does not
read from (a scheme outside the allowlist, a redirect to another scheme, host or port, a
manifest file path that would be URL syntax: a percent-escape, a query, a fragment) is a
``path`` rejection; a file that is not there is ``missing``. No message shows a URI's
credentials, and a FIFO or device swapped in for a listed file is refused instead of blocking
the loader.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app.artifact_store import ArtifactSource
from app.cache import ArtifactCache
from app.contracts import FetchConfig
from app.errors import ArtifactRejected, ConfigError, FetchFailed
from app.manifest import MANIFEST_NAME, check_relative_path
from rollout.local.cluster import free_port
from tests.file_artifacts import HeldFileServer, make_file_artifact, rewrite_manifest

PASSWORD = "hunter2-pass"
SIGNATURE = "f00dfacecafe5ec2e7"


def secret_uri(base: str) -> str:
    """``base`` (``http://host:port/path``) with a password and a presigned signature."""
    scheme, rest = base.split("://", 1)
    return f"{scheme}://reader:{PASSWORD}@{rest}?X-Amz-Expires=60&X-Amz-Signature={SIGNATURE}"


def assert_no_secret(exc: BaseException) -> None:
    shown = f"{exc} {exc.args} {getattr(exc, 'ids', {})}"
    assert PASSWORD not in shown and SIGNATURE not in shown, shown


@contextmanager
def serving(handler: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """An HTTP server on a free loopback port whose every GET and HEAD is ``handler``; yields
    its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            handler(self)

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def answer(status: int, headers: dict[str, str] | None = None, body: bytes = b"") -> Any:
    def handle(request: BaseHTTPRequestHandler) -> None:
        request.send_response(status)
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        if request.command == "GET":
            request.wfile.write(body)

    return handle


@contextmanager
def silent_listener() -> Iterator[str]:
    """Accepts TCP connections and never answers (a hung store); yields its base URL."""
    release = threading.Event()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        accepted: list[socket.socket] = []

        def accept() -> None:
            while not release.is_set():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                accepted.append(conn)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            release.set()
            for conn in accepted:
                conn.close()


FAST = FetchConfig(connect_timeout_s=2.0, read_timeout_s=0.5)


# --------------------------------------------------------------------------- transport failures


def test_a_store_that_is_not_listening_is_a_fetch_failure_not_a_rejection(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}/ranker-v42/manifest.json"
    with pytest.raises(FetchFailed) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(uri, "ab" * 32)
    assert info.value.category == "fetch"
    assert "127.0.0.1" in str(info.value) and "refused" in str(info.value).lower()


def test_a_name_that_does_not_resolve_is_a_fetch_failure(tmp_path: Path) -> None:
    uri = "http://artifacts.nonexistent.invalid/ranker-v42/manifest.json"
    with pytest.raises(FetchFailed) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(uri, "ab" * 32)
    assert "artifacts.nonexistent.invalid" in str(info.value)


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_server_error_is_a_fetch_failure_naming_the_status(tmp_path: Path, status: int) -> None:
    with serving(answer(status, body=b"try later")) as base, pytest.raises(FetchFailed) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(f"{base}/a/manifest.json", "ab" * 32)
    assert f"HTTP {status}" in str(info.value)


def test_a_manifest_that_is_not_there_is_still_missing(tmp_path: Path) -> None:
    with serving(answer(404)) as base, pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(f"{base}/a/manifest.json", "ab" * 32)
    assert info.value.category == "missing"


@pytest.mark.skipif(importlib.util.find_spec("adlfs") is not None, reason="adlfs is installed")
def test_a_missing_fsspec_driver_is_a_config_error_naming_it(tmp_path: Path) -> None:
    # Not retryable: no retry installs a driver. (s3fs and gcsfs come with the setup; a
    # deployment that allows another scheme needs that scheme's driver on every node.)
    assert importlib.util.find_spec("s3fs") is not None  # installed by the project
    fetch = FetchConfig(schemes=("abfs",))
    with pytest.raises(ConfigError) as info:
        ArtifactCache(tmp_path / "cache", fetch=fetch).fetch_verified(
            "abfs://host/a/manifest.json", "ab" * 32
        )
    assert "no driver" in str(info.value) and "s3fs" in str(info.value), info.value


# --------------------------------------------------------------------------- stalls and timeouts


def test_a_server_that_stalls_midway_fails_with_fetch_within_the_read_timeout(
    tmp_path: Path,
) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": os.urandom(64 * 1024)})
    server = HeldFileServer(tmp_path, held="weights.bin", held_after=4096)
    with server.running():
        source = ArtifactSource(server.uri(f"{artifact.out_dir.name}/{MANIFEST_NAME}"), fetch=FAST)
        got = bytearray()
        with pytest.raises(FetchFailed) as info, source.open("weights.bin") as stream:
            while chunk := stream.read(1 << 20):
                got += chunk
        assert server.holding.is_set()
    assert got == (artifact.out_dir / "weights.bin").read_bytes()[: len(got)]
    assert "read timeout" in str(info.value) and "0.5" in str(info.value)


def test_a_server_that_never_answers_fails_with_fetch(tmp_path: Path) -> None:
    with silent_listener() as base:
        source = ArtifactSource(f"{base}/a/{MANIFEST_NAME}", fetch=FAST)
        with pytest.raises(FetchFailed) as info:
            source.read_small(None)
    assert "timeout" in str(info.value)


def test_a_download_longer_than_the_read_timeout_completes_while_bytes_keep_coming(
    tmp_path: Path,
) -> None:
    # The old client bounded the whole body (300 s): a large artifact never loaded. Here the
    # download takes several read timeouts, and each wait for bytes is short.
    pieces = [bytes([i]) * 1024 for i in range(8)]
    gap = threading.Event()

    def trickle(request: BaseHTTPRequestHandler) -> None:
        request.send_response(200)
        request.send_header("Content-Length", str(sum(map(len, pieces))))
        request.end_headers()
        for piece in pieces:
            request.wfile.write(piece)
            request.wfile.flush()
            gap.wait(0.2)  # never set: a pause shorter than the read timeout

    with serving(trickle) as base:
        source = ArtifactSource(f"{base}/a/{MANIFEST_NAME}", fetch=FAST)
        with source.open("weights.bin") as stream:
            got = stream.read()
    assert got == b"".join(pieces)


# --------------------------------------------------------------------------- schemes and redirects


@pytest.mark.parametrize(
    ("uri", "scheme"),
    [
        ("ftp://store.example/a/manifest.json", "ftp"),
        ("memory://a/manifest.json", "memory"),
        ("data:application/json;base64,e30=", "data"),
        ("FTP://store.example/a/manifest.json", "ftp"),
        ("sftp://reader:pw@host/a/manifest.json", "sftp"),
    ],
)
def test_a_scheme_outside_the_allowlist_is_refused_naming_it(
    tmp_path: Path, uri: str, scheme: str
) -> None:
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(uri, "ab" * 32)
    assert info.value.category == "path"
    assert f"scheme {scheme!r}" in info.value.detail and "allowed: file, http" in info.value.detail


def test_a_chained_fsspec_url_is_refused(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"w.bin": b"x"})
    uri = f"simplecache::{artifact.manifest_uri}"
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(uri, artifact.manifest_sha256)
    assert info.value.category == "path"


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:99999/a/manifest.json",
        "http://[bad/manifest.json",
        "http:///no-host/manifest.json",
        "http://a..b/manifest.json",  # an empty label: IDNA cannot encode it
        "http://" + "a" * 64 + ".example/manifest.json",  # a label over 63 characters
    ],
)
def test_a_malformed_url_is_refused_before_a_fetch(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(uri, "ab" * 32)
    assert info.value.category == "path" and uri in info.value.detail


def test_the_allowlist_is_configurable(tmp_path: Path) -> None:
    from app.artifact_store import check_uri_allowed

    artifact = make_file_artifact(tmp_path, {"w.bin": b"x"})
    assert check_uri_allowed(artifact.manifest_uri, ("file",)) == "file"
    assert check_uri_allowed(str(artifact.out_dir / MANIFEST_NAME), ("file",)) == "file"
    with pytest.raises(ArtifactRejected, match=r"scheme 'file' is not allowed \(allowed: https\)"):
        ArtifactSource(artifact.manifest_uri, fetch=FetchConfig(schemes=("https",)))


@pytest.mark.parametrize(
    "target", ["https://127.0.0.1:{port}/a/manifest.json", "file:///etc/passwd"]
)
def test_a_redirect_to_another_scheme_is_refused(tmp_path: Path, target: str) -> None:
    location = target.format(port=free_port())
    cache = ArtifactCache(tmp_path / "cache")
    with (
        serving(answer(302, {"Location": location})) as base,
        pytest.raises(ArtifactRejected) as info,
    ):
        cache.fetch_verified(f"{base}/a/manifest.json", "ab" * 32)
    assert info.value.category == "path"
    assert "redirect" in info.value.detail and location.split(":")[0] in info.value.detail


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        ("http://127.0.0.1:{port}/a/manifest.json", "127.0.0.1:{port}"),  # another port
        ("http://localhost:{base_port}/a/manifest.json", "localhost:{base_port}"),  # host
        ("http://store.example/a/manifest.json", "store.example:80"),
    ],
)
def test_a_redirect_to_another_host_or_port_is_refused_naming_both(
    tmp_path: Path, target: str, shown: str
) -> None:
    """A server may not send the fetch (and whatever the URI carries) to another origin: a
    store's credentials would go along, and a host chosen by the store is not one the
    operator named."""
    port = free_port()
    cache = ArtifactCache(tmp_path / "cache")
    with contextlib.ExitStack() as stack:
        holder: dict[str, str] = {}

        def moved(request: BaseHTTPRequestHandler) -> None:
            answer(302, {"Location": holder["location"]})(request)

        base = stack.enter_context(serving(moved))
        base_port = base.rsplit(":", 1)[1]
        holder["location"] = target.format(port=port, base_port=base_port)
        with pytest.raises(ArtifactRejected) as info:
            cache.fetch_verified(f"{base}/a/manifest.json", "ab" * 32)
    detail = info.value.detail
    assert info.value.category == "path"
    assert "redirect" in detail and "not followed" in detail, detail
    assert f"127.0.0.1:{base_port}" in detail, detail  # where it came from
    assert shown.format(port=port, base_port=base_port) in detail, detail  # where it went


def test_a_redirect_within_the_same_origin_is_followed(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"w.bin": b"payload"})
    stored = artifact.out_dir / MANIFEST_NAME

    def store(request: BaseHTTPRequestHandler) -> None:
        if request.path.startswith("/old/"):
            answer(301, {"Location": "/" + request.path.removeprefix("/old/")})(request)
        elif request.path == f"/{artifact.out_dir.name}/{MANIFEST_NAME}":
            answer(200, body=stored.read_bytes())(request)
        else:
            answer(404)(request)

    with serving(store) as base:
        source = ArtifactSource(f"{base}/old/{artifact.out_dir.name}/{MANIFEST_NAME}")
        assert source.read_small(None) == stored.read_bytes()


# --------------------------------------------------------------------------- file paths in URLs


@contextmanager
def recording_store() -> Iterator[tuple[str, list[str]]]:
    """A server answering every GET with ``data``, noting each request's path as sent."""
    paths: list[str] = []

    def record(request: BaseHTTPRequestHandler) -> None:
        paths.append(request.path)
        answer(200, body=b"data")(request)

    with serving(record) as base:
        yield base, paths


@pytest.mark.parametrize(
    ("rel", "requested"),
    [
        ("%2e%2e/secret", "/store/a/%252e%252e/secret"),  # never climbs to /store/secret
        ("%2E%2E/%2e%2e/secret", "/store/a/%252E%252E/%252e%252e/secret"),
        ("w.bin?x=1", "/store/a/w.bin%3Fx=1"),  # not a query (yarl sends "=" as is)
        ("w.bin#frag", "/store/a/w.bin%23frag"),  # not a fragment
        ("dir/a b+c.bin", "/store/a/dir/a%20b%2Bc.bin"),
    ],
)
def test_each_segment_of_a_file_path_is_quoted_into_the_url(rel: str, requested: str) -> None:
    with recording_store() as (base, paths):
        source = ArtifactSource(f"{base}/store/a/{MANIFEST_NAME}", fetch=FAST)
        with source.open(rel) as stream:
            assert stream.read() == b"data"
        assert source.read_small(rel) == b"data"
    assert paths == [requested, requested]


def test_a_file_named_with_a_space_and_a_plus_is_fetched_over_http_by_its_own_name(
    tmp_path: Path,
) -> None:
    data = os.urandom(4096)
    artifact = make_file_artifact(tmp_path, {"dir/a b+c.bin": data})
    store = HeldFileServer(tmp_path)
    with store.running():
        got = ArtifactCache(tmp_path / "cache").fetch_verified(
            store.uri(f"{artifact.out_dir.name}/{MANIFEST_NAME}"), artifact.manifest_sha256
        )
    assert got.read_verified("dir/a b+c.bin") == data


@pytest.mark.parametrize(
    "path", ["%2e%2e/secret", "w%20.bin", "w.bin%", "w.bin?x=1", "dir/w.bin#frag"]
)
def test_a_manifest_file_path_with_a_percent_escape_query_or_fragment_is_refused(
    tmp_path: Path, path: str
) -> None:
    """A name the manifest lists is a name, never part of a URL's syntax: refused before any
    store is asked for it, the message naming the path."""
    artifact = make_file_artifact(tmp_path, {"w.bin": b"x"})
    digest = rewrite_manifest(artifact, lambda doc: doc["files"][0].update(path=path))
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(artifact.manifest_uri, digest)
    assert info.value.category == "path"
    assert repr(path) in info.value.detail, info.value.detail
    with pytest.raises(ArtifactRejected) as info:
        check_relative_path(path)
    assert repr(path) in info.value.detail


# --------------------------------------------------------------------------- credentials


def test_credentials_in_the_uri_never_reach_a_fetch_failure(tmp_path: Path) -> None:
    uri = secret_uri(f"http://127.0.0.1:{free_port()}/a/manifest.json")
    with pytest.raises(FetchFailed) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(uri, "ab" * 32)
    assert_no_secret(info.value)
    assert "reader:***@127.0.0.1" in str(info.value)


@pytest.mark.parametrize("status", [404, 503])
def test_credentials_never_reach_an_http_status_failure(tmp_path: Path, status: int) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    with serving(answer(status)) as base, pytest.raises((FetchFailed, ArtifactRejected)) as info:
        cache.fetch_verified(secret_uri(f"{base}/a/manifest.json"), "ab" * 32)
    assert_no_secret(info.value)


def test_credentials_never_reach_a_refused_redirect_or_scheme(tmp_path: Path) -> None:
    location = secret_uri("https://elsewhere.example/a/manifest.json")
    cache = ArtifactCache(tmp_path / "cache")
    with (
        serving(answer(302, {"Location": location})) as base,
        pytest.raises(ArtifactRejected) as info,
    ):
        cache.fetch_verified(secret_uri(f"{base}/a/manifest.json"), "ab" * 32)
    assert_no_secret(info.value)
    with pytest.raises(ArtifactRejected) as info:
        ArtifactCache(tmp_path / "cache").fetch_verified(
            secret_uri("ftp://store.example/a/manifest.json"), "ab" * 32
        )
    assert_no_secret(info.value)


def test_a_huge_uri_makes_a_bounded_error(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}/{'a' * (5 << 20)}/manifest.json"
    with pytest.raises(FetchFailed) as info:
        ArtifactSource(uri).read_small(None)
    assert len(str(info.value)) <= 4000


# --------------------------------------------------------------------------- local files


def fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def in_thread(work: Callable[[], Any]) -> tuple[bool, BaseException | None]:
    """Run ``work`` on a daemon thread: (finished, what it raised). A thread that blocks
    forever (an open of a FIFO without a writer) must not hang the test run."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return not thread.is_alive(), (raised[0] if raised else None)


def unblock(fifo: Path) -> None:
    """Give a reader blocked on ``fifo`` a writer, so its thread ends."""
    with contextlib.suppress(OSError):  # ENXIO: nobody was blocked
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_swapped_in_for_a_listed_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": b"w" * 100})
    source = ArtifactSource(artifact.manifest_uri)
    fifo = artifact.out_dir / "weights.bin"
    fifo_in_place_of(fifo)  # after the listing the cache checked, before the open
    try:
        finished, raised = in_thread(lambda: source.open("weights.bin"))
    finally:
        unblock(fifo)
    assert finished, "opening a FIFO blocked the loader"
    assert isinstance(raised, ArtifactRejected) and raised.category == "path"
    assert "not a regular file" in raised.detail


def test_a_fifo_in_place_of_the_manifest_is_refused_not_waited_on(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": b"w"})
    fifo = artifact.out_dir / MANIFEST_NAME
    fifo_in_place_of(fifo)
    try:
        finished, raised = in_thread(lambda: ArtifactSource(artifact.manifest_uri).read_small(None))
    finally:
        unblock(fifo)
    assert finished, "reading a FIFO manifest blocked"
    assert isinstance(raised, ArtifactRejected) and raised.category == "path"


def test_a_symlink_swapped_in_for_a_listed_file_is_refused(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": b"w"})
    link = artifact.out_dir / "weights.bin"
    link.unlink()
    link.symlink_to("/dev/zero")
    with pytest.raises(ArtifactRejected) as info:
        ArtifactSource(artifact.manifest_uri).open("weights.bin")
    assert info.value.category == "path" and "symlink" in info.value.detail


def test_reads_are_bounded_by_the_declared_size(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": b"w" * 100})
    (artifact.out_dir / "weights.bin").write_bytes(b"w" * 10_000)  # grew after the listing
    with ArtifactSource(artifact.manifest_uri).open("weights.bin", size=100) as stream:
        assert len(stream.read(60)) == 60
        with pytest.raises(ArtifactRejected) as info:
            stream.read(1 << 20)
    assert info.value.category == "size" and "100 bytes" in info.value.detail


def test_a_file_of_the_declared_size_reads_whole(tmp_path: Path) -> None:
    data = os.urandom(3000)
    artifact = make_file_artifact(tmp_path, {"weights.bin": data})
    with ArtifactSource(artifact.manifest_uri).open("weights.bin", size=len(data)) as stream:
        got = bytearray()
        buf = bytearray(1024)
        while n := stream.readinto(buf):
            got += buf[:n]
    assert got == data


def test_a_stalled_store_fails_the_cache_fetch_within_the_read_timeout(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": os.urandom(64 * 1024)})
    server = HeldFileServer(tmp_path, held="weights.bin", held_after=4096)
    with server.running():
        cache = ArtifactCache(tmp_path / "cache", fetch=FetchConfig(read_timeout_s=0.5))
        with pytest.raises(FetchFailed, match="read timeout"):
            cache.fetch_verified(
                server.uri(f"{artifact.out_dir.name}/manifest.json"), artifact.manifest_sha256
            )


@pytest.mark.parametrize(
    "uri",
    [
        "ftp://u:secretpw@127.0.0.1/manifest.json",
        "memory://x/manifest.json",
        "http://127.0.0.1:99999/manifest.json",
        "http://a..b/manifest.json",
    ],
)
def test_a_cached_entry_is_never_served_for_a_uri_this_service_would_not_read(
    tmp_path: Path, uri: str
) -> None:
    """A hit needs no fetch: the URI is checked before the cache is, so an entry cached from
    a good source is not handed out under a refused scheme or a malformed URL."""
    artifact = make_file_artifact(tmp_path, {"weights.bin": os.urandom(1024)})
    cache = ArtifactCache(tmp_path / "cache")
    cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256)
    assert cache.fetch_verified(artifact.manifest_uri, artifact.manifest_sha256).cached
    with pytest.raises(ArtifactRejected) as info:
        cache.fetch_verified(uri, artifact.manifest_sha256)
    assert info.value.category == "path", info.value
    assert "secretpw" not in str(info.value)


def test_a_scheme_in_capitals_is_the_same_scheme(tmp_path: Path) -> None:
    artifact = make_file_artifact(tmp_path, {"weights.bin": os.urandom(1024)})
    upper = "FILE" + artifact.manifest_uri[len("file") :]
    got = ArtifactCache(tmp_path / "cache").fetch_verified(upper, artifact.manifest_sha256)
    assert got.manifest.artifact_id == artifact.artifact_id
