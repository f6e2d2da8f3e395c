"""Reading artifacts from where they are stored, by URI.

fsspec does the transport so that ``file://``, plain paths, ``http(s)://``, ``s3://`` (s3fs)
and ``gs://`` (gcsfs) all work the same way; object stores are read in parallel ranges that
are retried on their own (``_RangedReader``). This module only reads and lists; checking what
was read is the cache's job (app/cache.py).

What a failure is, whatever the store:

- a URI this service does not read from: a scheme outside the allowlist
  (``FetchConfig.schemes``), a chained fsspec URL (``a::b``), a redirect to another origin
  (scheme, host or port): ``ArtifactRejected("path")``. It names a location, not bytes, and
  another attempt reads the same location: final, like any other unsafe path of an artifact;
- a file that is not there (404, ENOENT): ``ArtifactRejected("missing")``;
- a store that cannot be read now (connection refused, DNS, a connect or read timeout, a 5xx):
  ``FetchFailed`` (category ``fetch``; retried);
- a store whose fsspec driver is not installed: ``ConfigError`` (the host needs it).

HTTP(S) is bounded by a connect timeout and a per-read timeout, never a total: a large artifact
streams for as long as bytes keep coming, and a stalled server fails within the read timeout.
A listed file's URL is the manifest's directory plus the file's path with each segment quoted
whole, so a name can never become a query, a fragment or an escape that climbs; a redirect is
followed only within the origin the URI names.
Every message shows URIs redacted (``app.safe_text``) and is clipped (``clip_text``), and no
foreign exception is chained into one (their texts carry the raw URI).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import re
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final
from urllib.parse import quote

import aiohttp
import fsspec
import fsspec.asyn
import yarl
from fsspec.implementations.http import HTTPStreamFile
from fsspec.implementations.local import LocalFileSystem

from app.contracts import FetchConfig, clip_text
from app.errors import ArtifactRejected, ConfigError, FetchFailed, RolloutSystemError
from app.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from app.safe_files import UnsafeFile, open_regular
from app.safe_text import redact_in, redact_uri, terminal_safe

log = logging.getLogger(__name__)

# A URI as shown in a message: redacted, and no longer than this.
MAX_SHOWN_URI: Final = 300
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
# Anything URL-like in a foreign exception's text (a redirect target the server chose carries
# secrets the manifest URI does not).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def shown_uri(uri: str) -> str:
    return clip_text(redact_uri(uri), MAX_SHOWN_URI)


def uri_scheme(uri: str) -> str:
    """The scheme of ``uri``, lower case; a plain path is ``file``."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else "file"


def check_uri_allowed(uri: str, schemes: tuple[str, ...]) -> str:
    """Return the scheme of ``uri`` if this service may read from it; else reject (``path``)."""
    if "::" in uri:
        # fsspec chains filesystems ("simplecache::s3://...", "zip://x::file://y"): the outer
        # scheme would not be the one that reads.
        raise ArtifactRejected(
            "path",
            f"'::' (a chained fsspec URL, or an IPv6 literal fsspec splits as one) is not "
            f"allowed: {shown_uri(uri)}",
        )
    scheme = uri_scheme(uri)
    if scheme not in schemes:
        raise ArtifactRejected(
            "path",
            f"URI scheme {clip_text(scheme, 40)!r} is not allowed (allowed: {', '.join(schemes)})"
            f": {shown_uri(uri)}",
        )
    return scheme


class _RedirectRefused(Exception):
    """Raised inside aiohttp's redirect handling; translated into a ``path`` rejection."""

    def __init__(self, origin: str, target: str, change: str) -> None:
        super().__init__("redirect refused")
        self.origin = origin
        self.target = target
        self.change = change  # "the scheme (http -> https)", "the host and port (a -> b)"


def _host_port(url: yarl.URL) -> str:
    host = url.host or ""
    return f"[{host}]:{url.port}" if ":" in host else f"{host}:{url.port}"


def _origin_change(origin: yarl.URL, target: yarl.URL) -> str | None:
    """What a redirect from ``origin`` to ``target`` changes of the origin, as a phrase; None
    when it stays within it (the port as used: ``http://h`` and ``http://h:80`` are one)."""
    if target.scheme.lower() != origin.scheme.lower():
        return f"the scheme ({uri_scheme(str(origin))} -> {uri_scheme(str(target))})"
    if (target.host or "").lower() != (origin.host or "").lower() or target.port != origin.port:
        return f"the host and port ({_host_port(origin)} -> {_host_port(target)})"
    return None


async def _refuse_origin_change(
    _session: aiohttp.ClientSession, _context: Any, params: aiohttp.TraceRequestRedirectParams
) -> None:
    # Called for every redirect before aiohttp follows it, so every hop stays within the
    # origin the operator named: https -> http would drop TLS; another scheme is not a store
    # this source was opened for; another host or port is one the store chose, not the
    # operator, and the request would carry the URI's credentials there.
    location = params.response.headers.get("Location") or params.response.headers.get("URI")
    if location is None:
        return
    try:
        target = params.url.join(yarl.URL(location))
    except ValueError:
        return  # aiohttp refuses it itself (InvalidUrlRedirectClientError)
    change = _origin_change(params.url, target)
    if change is not None:
        raise _RedirectRefused(str(params.url), str(target), change)


def _redirect_guard() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(_refuse_origin_change)
    trace.freeze()
    return trace


# One instance: fsspec caches filesystems by their options, so equal options share a session.
_REDIRECT_GUARD: Final = _redirect_guard()


def _storage_options(scheme: str, fetch: FetchConfig) -> dict[str, Any]:
    if scheme in ("http", "https"):
        timeout = aiohttp.ClientTimeout(
            total=None,  # a large artifact streams for as long as bytes keep coming
            connect=fetch.connect_timeout_s,
            sock_connect=fetch.connect_timeout_s,
            sock_read=fetch.read_timeout_s,
        )
        return {"client_kwargs": {"timeout": timeout, "trace_configs": [_REDIRECT_GUARD]}}
    if scheme in ("s3", "s3a"):
        # s3fs hands these to botocore's Config; its defaults are 60 s each as well.
        options: dict[str, Any] = {
            "config_kwargs": {
                "connect_timeout": fetch.connect_timeout_s,
                "read_timeout": fetch.read_timeout_s,
            }
        }
        if fetch.s3_endpoint_url is not None:
            options["endpoint_url"] = fetch.s3_endpoint_url
        return options
    return {}  # gs and others: the driver's own timeouts


def _describe(exc: BaseException, fetch: FetchConfig, *uris: str) -> str:
    """A foreign exception as one line of a message: no secret of ``uris``, no raw URL."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"no connection within the connect timeout ({fetch.connect_timeout_s:g} s)"
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "ReadTimeoutError":
        return f"no data within the read timeout ({fetch.read_timeout_s:g} s)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Its text ends "[Connect call failed ('127.0.0.1', 8000)]": say why instead.
        cause = exc.os_error
        code = cause.errno
        why = os.strerror(code) if isinstance(code, int) and code > 0 else cause.strerror
        return f"cannot connect to {exc.host}:{exc.port}: {why or type(cause).__name__}"
    if isinstance(exc, aiohttp.ClientResponseError):
        reason = terminal_safe(clip_text(str(exc.message or ""), 100))
        return f"HTTP {exc.status} {reason}".rstrip()
    text = redact_in(str(exc), *uris)
    text = _URL_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), text)
    return clip_text(f"{type(exc).__name__}: {terminal_safe(text)}", 1000)


def _transient_driver_error(exc: BaseException) -> bool:
    """An object-store driver's own error for "cannot read now": botocore's timeouts and
    dropped connections (a stall past the read timeout, a body cut short), which are not
    OSErrors. Another attempt may well succeed."""
    try:
        from botocore import exceptions as boto
    except ImportError:  # no S3 driver installed: nothing of it can be raised either
        return False
    return isinstance(
        exc,
        boto.ConnectionError
        | boto.HTTPClientError
        | boto.ResponseStreamingError
        | boto.IncompleteReadError,
    )


def _is_not_found(exc: BaseException) -> bool:
    if isinstance(exc, FileNotFoundError):
        return True
    return isinstance(exc, aiohttp.ClientResponseError) and exc.status in (404, 410)


def _translate(
    exc: BaseException, what: str, fetch: FetchConfig, *uris: str
) -> RolloutSystemError | None:
    """The typed error of a failure to read ``what`` (a phrase naming it, URIs redacted), or
    None for an exception that is not about the store (a bug: let it propagate)."""
    if isinstance(exc, RolloutSystemError):
        return exc
    if isinstance(exc, _RedirectRefused):
        return ArtifactRejected(
            "path",
            clip_text(
                f"{what}: redirect from {shown_uri(exc.origin)} to {shown_uri(exc.target)} "
                f"changes {exc.change}; not followed (redirects stay within the origin)"
            ),
        )
    if isinstance(exc, aiohttp.InvalidURL):  # a redirect's Location included
        return ArtifactRejected("path", clip_text(f"{what}: not a valid URL"))
    if _is_not_found(exc):
        return ArtifactRejected("missing", clip_text(f"{what} does not exist"))
    if isinstance(exc, ImportError):
        return _no_driver(what, exc, fetch)
    if isinstance(exc, OSError | aiohttp.ClientError):  # TimeoutError and ConnectionError too
        return FetchFailed(clip_text(f"{what}: {_describe(exc, fetch, *uris)}"))
    if _transient_driver_error(exc):
        return FetchFailed(clip_text(f"{what}: {_describe(exc, fetch, *uris)}"))
    return None


@dataclass(frozen=True)
class StoredEntry:
    """One thing found next to the manifest: a regular file, or something else (``kind``)."""

    path: str  # relative to the artifact's directory, POSIX separators
    kind: str  # "file", "symlink", "other"
    size: int


class _GuardedStream(io.RawIOBase):
    """A stored file as the cache reads it: every failure typed (``_translate``), and never
    more than ``size`` bytes (+1, to tell a longer file) taken from the store."""

    def __init__(
        self, inner: Any, what: str, size: int | None, fetch: FetchConfig, *uris: str
    ) -> None:
        super().__init__()
        self._inner = inner
        self._what = what
        self._size = size
        self._fetch = fetch
        self._uris = uris
        self._read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = len(view)
        if self._size is not None:
            want = min(want, self._size + 1 - self._read)
        if want <= 0:
            return 0
        try:
            if hasattr(self._inner, "readinto"):
                got = self._inner.readinto(view[:want]) or 0
            else:
                data = self._inner.read(want)
                got = len(data)
                view[:got] = data
        except BaseException as exc:
            typed = _translate(exc, self._what, self._fetch, *self._uris)
            if typed is None:
                raise
            raise typed from None
        self._read += got
        if self._size is not None and self._read > self._size:
            raise ArtifactRejected(
                "size", f"{self._what} is larger than the {self._size} bytes declared"
            )
        return got

    def close(self) -> None:
        if not self.closed:
            # Closing a failed HTTP response: nothing left to read or lose.
            with contextlib.suppress(Exception):
                self._inner.close()
        super().close()


class _RangedReader(io.RawIOBase):
    """A file of an object store read as ranges of ``part_bytes``, ``parallel_parts`` of
    them in flight at once (each store request streams at its own pace, so several together
    fill a fat pipe one cannot), handed out in order. A range that fails on a transient
    error (``FetchFailed``: a stall past the read timeout, a connection cut mid-body, a 5xx)
    is requested again with a growing pause, up to ``part_retries`` times, while the ranges
    already received are kept: a broken transfer resumes at the range it broke in. The
    object's size is checked first (one HEAD): a truncated or grown object is a ``size``
    rejection before a byte of it is read."""

    def __init__(
        self, fs: Any, path: str, size: int, what: str, fetch: FetchConfig, *uris: str
    ) -> None:
        super().__init__()
        self._fs, self._path, self._size, self._what = fs, path, size, what
        self._fetch, self._uris = fetch, uris
        # Set by close(): ranges not started are dropped and a backoff ends at once, so a
        # cancelled load (or a failure in another file) does not wait out the retries.
        self._closing = threading.Event()
        try:
            stored = int(fs.info(path)["size"])
        except BaseException as exc:
            raise self._typed(exc) from None
        if stored != size:
            raise ArtifactRejected(
                "size", f"{what} is {stored} bytes in the store, the manifest says {size}"
            )
        step = fetch.part_bytes
        self._ranges = [(start, min(size, start + step)) for start in range(0, size, step)]
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(fetch.parallel_parts, len(self._ranges))),
            thread_name_prefix="ranged-read",
        )
        self._ahead: deque[Future[bytes]] = deque()
        self._next = 0  # index of the next range to request
        self._current = memoryview(b"")
        self._fill()

    def _typed(self, exc: BaseException) -> BaseException:
        typed = _translate(exc, self._what, self._fetch, *self._uris)
        return typed if typed is not None else exc

    def _fill(self) -> None:
        while len(self._ahead) < self._fetch.parallel_parts and self._next < len(self._ranges):
            start, end = self._ranges[self._next]
            self._ahead.append(self._pool.submit(self._read_range, start, end))
            self._next += 1

    def _read_range(self, start: int, end: int) -> bytes:
        attempt = 0
        while True:
            if self._closing.is_set():
                raise FetchFailed(f"{self._what}: the read was stopped")
            try:
                data = self._fs.cat_file(self._path, start=start, end=end)
            except BaseException as exc:
                typed = self._typed(exc)
                final = (
                    not isinstance(typed, FetchFailed)
                    or isinstance(exc, PermissionError)  # a 403 stays a 403
                    or attempt >= self._fetch.part_retries
                    or self._closing.is_set()
                )
                if final:
                    raise typed from None
                pause = min(30.0, self._fetch.retry_initial_s * 2**attempt)
                log.warning(
                    "%s: bytes %d-%d: %s; reading them again in %.1f s (%d of %d)",
                    self._what, start, end, typed, pause, attempt + 1, self._fetch.part_retries,
                )  # fmt: skip
                self._closing.wait(pause)
                attempt += 1
                continue
            if len(data) != end - start:
                # A complete answer of another length: the object changed under us.
                raise ArtifactRejected(
                    "size",
                    f"{self._what}: bytes {start}-{end} came back as {len(data)} bytes",
                )
            return data

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not self._current:
            if not self._ahead:
                return 0
            future = self._ahead.popleft()
            self._current = memoryview(future.result())
            self._fill()
        n = min(len(view), len(self._current))
        view[:n] = self._current[:n]
        self._current = self._current[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._closing.set()
            for future in self._ahead:
                future.cancel()
            # A request in flight ends by itself (its read timeout at the latest); nobody
            # waits for it.
            self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


def _open_local_regular(path: str, what: str) -> int:
    """A descriptor on the regular file at ``path`` (app.safe_files: never blocking, no
    symlink, fstat decides). Missing: ArtifactRejected ``missing``; anything else that cannot
    be read safely: ``path``."""
    try:
        return open_regular(path, what)
    except FileNotFoundError:
        raise ArtifactRejected("missing", f"{what} is missing") from None
    except UnsafeFile as exc:
        raise ArtifactRejected("path", str(exc)) from None
    except OSError as exc:
        raise ArtifactRejected("path", f"{what} cannot be opened: {exc.strerror}") from None


def _check_http_url(uri: str, shown: str) -> None:
    # Refused here, not halfway through a fetch as a ValueError of yarl's or aiohttp's.
    try:
        url = yarl.URL(uri)
        host, _port = url.host, url.port  # the port: "out of range" is a ValueError
        if host:
            host.encode("idna")  # a label aiohttp could not encode (empty, > 63 characters)
    except ValueError as exc:  # UnicodeError (IDNA) included
        why = clip_text(redact_in(str(exc), uri), 200)
        raise ArtifactRejected("path", f"not a valid URL ({why}): {shown}") from None
    if not host:
        raise ArtifactRejected("path", f"URL without a host: {shown}")


def _no_driver(what: str, exc: ImportError, fetch: FetchConfig) -> ConfigError:
    # Not a fetch failure: retrying cannot install a package. The host needs the driver.
    return ConfigError(
        clip_text(
            f"{what}: no driver for this store is installed ({_describe(exc, fetch)}); "
            "install fsspec's driver for the scheme on every node (the project's setup "
            "installs s3fs for s3:// and gcsfs for gs://)"
        ),
        field="manifest_uri",
    )


def check_source_uri(uri: str, fetch: FetchConfig) -> str:
    """What opening ``uri`` checks before any I/O (the scheme allowlist, a URL's host and
    port), for callers that may not open it at all: a cache hit is served from the cache, but
    only for a URI this service would read from. Returns the scheme."""
    scheme = check_uri_allowed(uri, fetch.schemes)
    if scheme in ("http", "https"):
        _check_http_url(uri, shown_uri(uri))
    return scheme


def _read_up_to(stream: Any, limit: int) -> bytes:
    """Up to ``limit`` bytes: a streamed read may return fewer than asked before the end."""
    parts: list[bytes] = []
    got = 0
    while got < limit:
        chunk = stream.read(limit - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class ArtifactSource:
    """The directory an artifact's manifest lives in, on any fsspec filesystem.

    ``fetch`` (default: ``FetchConfig()``) says which schemes may be read and how long a
    connect or a read may stall."""

    def __init__(self, manifest_uri: str, fetch: FetchConfig | None = None) -> None:
        self.manifest_uri = manifest_uri
        self.fetch = fetch or FetchConfig()
        self.scheme = check_uri_allowed(manifest_uri, self.fetch.schemes)
        self.shown_uri = shown_uri(manifest_uri)
        self.is_http = self.scheme in ("http", "https")
        if self.is_http:
            _check_http_url(manifest_uri, self.shown_uri)
        # Schemes are case-insensitive (RFC 3986); fsspec's registry knows them lower case.
        prefix = manifest_uri[: len(self.scheme) + 1]
        opened = (
            f"{self.scheme}:{manifest_uri[len(prefix) :]}"
            if prefix.lower() == f"{self.scheme}:"
            else manifest_uri
        )
        try:
            fs, path = fsspec.core.url_to_fs(opened, **_storage_options(self.scheme, self.fetch))
        except ImportError as exc:  # fsspec: "Install s3fs to access S3"
            raise _no_driver(
                f"cannot open the store of {self.shown_uri}", exc, self.fetch
            ) from None
        except ValueError as exc:
            raise ArtifactRejected(
                "path",
                clip_text(
                    f"cannot open the store of {self.shown_uri}: "
                    f"{_describe(exc, self.fetch, manifest_uri)}"
                ),
            ) from None
        self.fs: Any = fs
        self._manifest_path: str = path
        self.base: str = posixpath.dirname(path)
        self.is_local = isinstance(fs, LocalFileSystem)

    def _join(self, rel: str) -> str:
        if self.is_http:
            # Each segment quoted whole (safe=""): a '?', '#' or '%' of a name stays part of
            # the name, never a query, a fragment or an escape the URL parser would decode
            # ('%2e%2e' normalised like '..'). Manifests refuse those names anyway.
            rel = "/".join(quote(segment, safe="") for segment in rel.split("/"))
        return f"{self.base}/{rel}" if self.base else rel

    def _where(self, rel: str | None) -> str:
        if rel is None:
            return f"manifest {self.shown_uri}"
        return f"{rel!r} next to {self.shown_uri}"

    def _fail(self, exc: BaseException, rel: str | None) -> RolloutSystemError | None:
        typed = _translate(
            exc, self._where(rel), self.fetch, self.manifest_uri, self._join(rel or "")
        )
        if isinstance(typed, FetchFailed):
            typed.ids["uri"] = self.shown_uri
        return typed

    def _open_remote(self, path: str) -> Any:
        if self.is_http:
            # One streaming GET: no range requests a server may not support, and no HEAD
            # first (fsspec's info() turns every failure of it, a refused connection or a 503
            # included, into FileNotFoundError).
            session = fsspec.asyn.sync(self.fs.loop, self.fs.set_session)
            return HTTPStreamFile(
                self.fs, path, session=session, loop=self.fs.loop, **self.fs.kwargs
            )
        return self.fs.open(path, "rb")

    def read_small(self, rel: str | None, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
        """Read a small file (manifest, signature); None if a signature does not exist. A
        missing manifest is a ``missing`` rejection."""
        path = self._manifest_path if rel is None else self._join(rel)
        try:
            if self.is_local:
                with os.fdopen(_open_local_regular(path, self._where(rel)), "rb") as fh:
                    data = fh.read(limit + 1)
            else:
                with self._open_remote(path) as fh:
                    data = _read_up_to(fh, limit + 1)
        except BaseException as exc:
            typed = self._fail(exc, rel)
            if typed is None:
                raise
            if typed.category == "missing":
                if rel is not None:
                    return None
                raise ArtifactRejected("missing", f"no manifest at {self.shown_uri}") from None
            raise typed from None
        if len(data) > limit:
            raise ArtifactRejected("limits", f"{self._where(rel)} is larger than {limit} bytes")
        return data

    def open(self, rel: str, size: int | None = None) -> BinaryIO:
        """A listed file, read as a stream. ``size``: the manifest's size for it; no more than
        one byte past it is ever taken from the store (a ``size`` rejection then)."""
        path = self._join(rel)
        if self.is_local:
            inner: Any = os.fdopen(
                _open_local_regular(path, f"listed file {rel!r}"), "rb", buffering=0
            )
        elif not self.is_http and size is not None:
            try:
                inner = _RangedReader(
                    self.fs, path, size, self._where(rel), self.fetch, self.manifest_uri, path
                )
            except ArtifactRejected as exc:
                if exc.category == "missing":
                    raise ArtifactRejected("missing", f"listed file {rel!r} is missing") from None
                raise
        else:
            try:
                inner = self._open_remote(path)
            except BaseException as exc:
                typed = self._fail(exc, rel)
                if typed is None:
                    raise
                if typed.category == "missing":
                    raise ArtifactRejected("missing", f"listed file {rel!r} is missing") from None
                raise typed from None
        # Unbuffered, as the cache reads it (readinto of its own buffers): a buffer here would
        # read ahead of what the caller asked.
        stream = _GuardedStream(inner, self._where(rel), size, self.fetch, self.manifest_uri, path)
        return stream  # type: ignore[return-value]

    def list_entries(self) -> list[StoredEntry] | None:
        """Everything stored next to the manifest, or None where the store cannot list
        (plain HTTP has no directory listing; extra files cannot be detected there)."""
        if self.is_local:
            return list(self._walk_local(self.base, ""))
        if self.is_http:
            return None
        try:
            found = self.fs.find(self.base, detail=True, withdirs=False)
        except BaseException as exc:
            typed = self._fail(exc, None)
            if typed is None:
                raise
            raise typed from None
        entries = []
        for full, info in found.items():
            rel = posixpath.relpath(full, self.base)
            kind = (
                "symlink"
                if info.get("islink")
                else ("file" if info.get("type") == "file" else "other")
            )
            entries.append(StoredEntry(rel, kind, int(info.get("size") or 0)))
        return entries

    def _walk_local(self, root: str, prefix: str) -> Iterator[StoredEntry]:
        with os.scandir(root) as it:
            for entry in it:
                rel = f"{prefix}{entry.name}"
                if entry.is_symlink():
                    yield StoredEntry(rel, "symlink", 0)
                elif entry.is_dir(follow_symlinks=False):
                    yield from self._walk_local(entry.path, rel + "/")
                elif entry.is_file(follow_symlinks=False):
                    yield StoredEntry(rel, "file", entry.stat(follow_symlinks=False).st_size)
                else:
                    yield StoredEntry(rel, "other", 0)


def read_manifest_bytes(manifest_uri: str, fetch: FetchConfig | None = None) -> bytes:
    data = ArtifactSource(manifest_uri, fetch).read_small(None)
    assert data is not None  # read_small(None) rejects a missing manifest
    return data


def fetch_manifest(
    manifest_uri: str, expected_sha256: str, fetch: FetchConfig | None = None
) -> Manifest:
    """Read the manifest at ``manifest_uri`` and check it against the pinned digest."""
    return parse_manifest(read_manifest_bytes(manifest_uri, fetch), expected_sha256)


def manifest_uri_for(directory: os.PathLike[str] | str) -> str:
    """The file:// URI of the manifest in a local artifact directory."""
    return (Path(os.path.abspath(os.fspath(directory))) / MANIFEST_NAME).as_uri()
