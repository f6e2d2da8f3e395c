"""The cache's own file handling: reading what it published (refusing anything swapped in
after publication, app.safe_files), writing and syncing what it publishes, its locks."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Final

from app.errors import ArtifactRejected
from app.safe_files import UnsafeFile, open_regular, read_regular

CHUNK_BYTES: Final = 8 << 20
# Digests of bytes already in memory are taken in pieces this large, a pacing point between
# each (a few ms of SHA-256): one call over a whole file would be one long burst.
HASH_PIECE_BYTES: Final = 4 << 20
MAX_MARKER_BYTES: Final = 64 << 10
# Lock and lease files, directories: opened without following a symlink planted in their place.
LOCK_FILE_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
DIRECTORY_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_cached_file(path: Path, what: str) -> int:
    """A descriptor on a file of the cache (app.safe_files.open_regular): ArtifactRejected
    ``path`` for a symlink or anything but a regular file; the open's OSError otherwise."""
    try:
        return open_regular(path, what)
    except UnsafeFile as exc:
        raise ArtifactRejected("path", str(exc)) from None


def read_cached_file(path: Path, what: str, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of a file of the cache (one more, so a caller sees "too
    long"); errors as ``open_cached_file``'s."""
    try:
        return read_regular(path, what, limit)
    except UnsafeFile as exc:
        raise ArtifactRejected("path", str(exc)) from None


def write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_synced(path: Path, data: bytes) -> None:
    """A new file (never through an existing one) holding ``data``, on disk when this returns."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, DIRECTORY_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
