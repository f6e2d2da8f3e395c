"""How the artifact store talks to a store (app.artifact_store): URIs as they may be shown,
every redirect kept within the origin the operator named, the drivers' options, a driver's
failures translated into the project's typed errors (credentials kept out of the words), and
the streams a stored file is read through: guarded (typed failures, never past its declared
size) and, on object stores, ranged reads in parallel that resume at the range a transfer broke
in."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

import aiohttp
import yarl

from app.contracts import FetchConfig, clip_text
from app.errors import ArtifactRejected, ConfigError, FetchFailed, RolloutSystemError
from app.safe_text import redact_in, redact_uri, terminal_safe

log = logging.getLogger(__name__)

# A URI as shown in a message: redacted, and no longer than this.
MAX_SHOWN_URI: Final = 300


SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


# Anything URL-like in a foreign exception's text (a redirect target the server chose carries
# secrets the manifest URI does not).
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def shown_uri(uri: str) -> str:
    return clip_text(redact_uri(uri), MAX_SHOWN_URI)


def uri_scheme(uri: str) -> str:
    """The scheme of ``uri``, lower case; a plain path is ``file``."""
    match = SCHEME.match(uri)
    return match.group(1).lower() if match else "file"


class RedirectRefused(Exception):
    """Raised inside aiohttp's redirect handling; translated into a ``path`` rejection."""

    def __init__(self, origin: str, target: str, change: str) -> None:
        super().__init__("redirect refused")
        self.origin = origin
        self.target = target
        self.change = change  # "the scheme (http -> https)", "the host and port (a -> b)"


def host_port(url: yarl.URL) -> str:
    host = url.host or ""
    return f"[{host}]:{url.port}" if ":" in host else f"{host}:{url.port}"


def origin_change(origin: yarl.URL, target: yarl.URL) -> str | None:
    """What a redirect from ``origin`` to ``target`` changes of the origin, as a phrase; None
    when it stays within it (the port as used: ``http://h`` and ``http://h:80`` are one)."""
    if target.scheme.lower() != origin.scheme.lower():
        return f"the scheme ({uri_scheme(str(origin))} -> {uri_scheme(str(target))})"
    if (target.host or "").lower() != (origin.host or "").lower() or target.port != origin.port:
        return f"the host and port ({host_port(origin)} -> {host_port(target)})"
    return None


async def refuse_origin_change(
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
    change = origin_change(params.url, target)
    if change is not None:
        raise RedirectRefused(str(params.url), str(target), change)


def redirect_guard() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(refuse_origin_change)
    trace.freeze()
    return trace


# One instance: fsspec caches filesystems by their options, so equal options share a session.
REDIRECT_GUARD: Final = redirect_guard()


def storage_options(scheme: str, fetch: FetchConfig) -> dict[str, Any]:
    if scheme in ("http", "https"):
        timeout = aiohttp.ClientTimeout(
            total=None,  # a large artifact streams for as long as bytes keep coming
            connect=fetch.connect_timeout_s,
            sock_connect=fetch.connect_timeout_s,
            sock_read=fetch.read_timeout_s,
        )
        return {"client_kwargs": {"timeout": timeout, "trace_configs": [REDIRECT_GUARD]}}
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


def describe_failure(exc: BaseException, fetch: FetchConfig, *uris: str) -> str:
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
    text = URL_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), text)
    return clip_text(f"{type(exc).__name__}: {terminal_safe(text)}", 1000)


def transient_driver_error(exc: BaseException) -> bool:
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


def is_not_found(exc: BaseException) -> bool:
    if isinstance(exc, FileNotFoundError):
        return True
    return isinstance(exc, aiohttp.ClientResponseError) and exc.status in (404, 410)


def translate_failure(
    exc: BaseException, what: str, fetch: FetchConfig, *uris: str
) -> RolloutSystemError | None:
    """The typed error of a failure to read ``what`` (a phrase naming it, URIs redacted), or
    None for an exception that is not about the store (a bug: let it propagate)."""
    if isinstance(exc, RolloutSystemError):
        return exc
    if isinstance(exc, RedirectRefused):
        return ArtifactRejected(
            "path",
            clip_text(
                f"{what}: redirect from {shown_uri(exc.origin)} to {shown_uri(exc.target)} "
                f"changes {exc.change}; not followed (redirects stay within the origin)"
            ),
        )
    if isinstance(exc, aiohttp.InvalidURL):  # a redirect's Location included
        return ArtifactRejected("path", clip_text(f"{what}: not a valid URL"))
    if is_not_found(exc):
        return ArtifactRejected("missing", clip_text(f"{what} does not exist"))
    if isinstance(exc, ImportError):
        return no_driver(what, exc, fetch)
    if isinstance(exc, OSError | aiohttp.ClientError):  # TimeoutError and ConnectionError too
        return FetchFailed(clip_text(f"{what}: {describe_failure(exc, fetch, *uris)}"))
    if transient_driver_error(exc):
        return FetchFailed(clip_text(f"{what}: {describe_failure(exc, fetch, *uris)}"))
    return None


class GuardedStream(io.RawIOBase):
    """A stored file as the cache reads it: every failure typed (``translate_failure``), and never
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
            typed = translate_failure(exc, self._what, self._fetch, *self._uris)
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


class RangedReader(io.RawIOBase):
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
        typed = translate_failure(exc, self._what, self._fetch, *self._uris)
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


def no_driver(what: str, exc: ImportError, fetch: FetchConfig) -> ConfigError:
    # Not a fetch failure: retrying cannot install a package. The host needs the driver.
    return ConfigError(
        clip_text(
            f"{what}: no driver for this store is installed ({describe_failure(exc, fetch)}); "
            "install fsspec's driver for the scheme on every node (the project's setup "
            "installs s3fs for s3:// and gcsfs for gs://)"
        ),
        field="manifest_uri",
    )
