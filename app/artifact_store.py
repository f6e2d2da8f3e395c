"""Reading artifacts from where they are stored, by URI.

fsspec does the transport so that ``file://``, plain paths, ``http(s)://`` and (with the
``s3`` extra) ``s3://`` all work the same way. This module only reads and lists; checking what
was read is the cache's job (app/cache.py).
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from app.errors import ArtifactRejected
from app.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest


@dataclass(frozen=True)
class StoredEntry:
    """One thing found next to the manifest: a regular file, or something else (``kind``)."""

    path: str  # relative to the artifact's directory, POSIX separators
    kind: str  # "file", "symlink", "other"
    size: int


class ArtifactSource:
    """The directory an artifact's manifest lives in, on any fsspec filesystem."""

    def __init__(self, manifest_uri: str) -> None:
        self.manifest_uri = manifest_uri
        try:
            fs, path = fsspec.core.url_to_fs(manifest_uri)
        except (ValueError, ImportError) as exc:
            raise ArtifactRejected(
                "missing", f"cannot open artifact store for {manifest_uri!r}: {exc}"
            ) from exc
        self.fs: Any = fs
        self._manifest_path: str = path
        self.base: str = posixpath.dirname(path)
        self.is_local = isinstance(fs, LocalFileSystem)
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.is_http = bool({"http", "https"} & set(protocols))

    def _join(self, rel: str) -> str:
        return f"{self.base}/{rel}" if self.base else rel

    def read_small(self, rel: str | None, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
        """Read a small file (manifest, signature); None if it does not exist."""
        path = self._manifest_path if rel is None else self._join(rel)
        try:
            with self.fs.open(path, "rb") as fh:
                data = fh.read(limit + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ArtifactRejected("missing", f"cannot read {path}: {exc}") from exc
        if len(data) > limit:
            raise ArtifactRejected("limits", f"{path} is larger than {limit} bytes")
        return data

    def open(self, rel: str) -> BinaryIO:
        path = self._join(rel)
        if self.is_local:
            # O_NOFOLLOW: a listed file swapped for a symlink after listing is refused too.
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError as exc:
                raise ArtifactRejected("missing", f"listed file {rel!r} is missing") from exc
            except OSError as exc:
                raise ArtifactRejected(
                    "path", f"listed file {rel!r} cannot be opened: {exc}"
                ) from exc
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ArtifactRejected("path", f"listed file {rel!r} is not a regular file")
            return os.fdopen(fd, "rb", buffering=0)
        try:
            if self.is_http:
                # block_size=0 streams: one GET, no range requests a server may not support.
                return self.fs.open(path, "rb", block_size=0)
            return self.fs.open(path, "rb")
        except FileNotFoundError as exc:
            raise ArtifactRejected("missing", f"listed file {rel!r} is missing") from exc
        except OSError as exc:
            raise ArtifactRejected("missing", f"cannot read listed file {rel!r}: {exc}") from exc

    def list_entries(self) -> list[StoredEntry] | None:
        """Everything stored next to the manifest, or None where the store cannot list
        (plain HTTP has no directory listing; extra files cannot be detected there)."""
        if self.is_local:
            return list(self._walk_local(self.base, ""))
        if self.is_http:
            return None
        found = self.fs.find(self.base, detail=True, withdirs=False)
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


def read_manifest_bytes(manifest_uri: str) -> bytes:
    data = ArtifactSource(manifest_uri).read_small(None)
    if data is None:
        raise ArtifactRejected("missing", f"no manifest at {manifest_uri}")
    return data


def fetch_manifest(manifest_uri: str, expected_sha256: str) -> Manifest:
    """Read the manifest at ``manifest_uri`` and check it against the pinned digest."""
    return parse_manifest(read_manifest_bytes(manifest_uri), expected_sha256)


def manifest_uri_for(directory: os.PathLike[str] | str) -> str:
    """The file:// URI of the manifest in a local artifact directory."""
    return (Path(os.path.abspath(os.fspath(directory))) / MANIFEST_NAME).as_uri()
