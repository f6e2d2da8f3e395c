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

import logging
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import fsspec
import fsspec.asyn
import yarl
from fsspec.implementations.http import HTTPStreamFile
from fsspec.implementations.local import LocalFileSystem

from app.contracts import FetchConfig, clip_text
from app.errors import ArtifactRejected, FetchFailed, RolloutSystemError
from app.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from app.safe_files import UnsafeFile, open_regular
from app.safe_text import redact_in
from app.store_transport import (
    GuardedStream,
    RangedReader,
    describe_failure,
    no_driver,
    shown_uri,
    storage_options,
    translate_failure,
    uri_scheme,
)

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class StoredEntry:
    """One thing found next to the manifest: a regular file, or something else (``kind``)."""

    path: str  # relative to the artifact's directory, POSIX separators
    kind: str  # "file", "symlink", "other"
    size: int


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
            fs, path = fsspec.core.url_to_fs(opened, **storage_options(self.scheme, self.fetch))
        except ImportError as exc:  # fsspec: "Install s3fs to access S3"
            raise no_driver(f"cannot open the store of {self.shown_uri}", exc, self.fetch) from None
        except ValueError as exc:
            raise ArtifactRejected(
                "path",
                clip_text(
                    f"cannot open the store of {self.shown_uri}: "
                    f"{describe_failure(exc, self.fetch, manifest_uri)}"
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
        typed = translate_failure(
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
                inner = RangedReader(
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
        stream = GuardedStream(inner, self._where(rel), size, self.fetch, self.manifest_uri, path)
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
