"""Opening a file that someone else may have put there, written once.

Three readers open files they did not create: the verified cache (every cached file, its
manifest, markers and signatures), the artifact store's local-directory source (an artifact's
files) and the key and trust files (``trust_key`` in a user_config, a CA chain). Each must
read a regular file and nothing else, and must never block on what it opens:

- ``O_NONBLOCK``: opening a FIFO with no writer returns at once instead of waiting forever
  (and a device swapped in after a listing does not block either); the flag is cleared once
  the descriptor is known to be a regular file, whose reads never block anyway;
- ``fstat`` on the descriptor decides, so a swap after a check by name counts for nothing;
- ``O_NOFOLLOW`` refuses a symlink, except where one is expected (``follow_symlinks``: mounted
  secrets are symlinks);
- reads are bounded: ``read_regular`` returns at most one byte more than asked, so a caller
  tells "too long" from "exactly the limit" without reading ``/dev/zero`` forever.

Errors are this module's own (``UnsafeFile``) or the ``OSError`` of the open, unchanged
(``FileNotFoundError`` included): each caller words them for its audience (an artifact
rejected with a category, a config error naming a field).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Final, Literal

READ_PIECE_BYTES: Final = 8 << 20

UnsafeKind = Literal["symlink", "not_regular"]


class UnsafeFile(Exception):
    """``what`` is a symlink (where none is followed) or not a regular file."""

    def __init__(self, what: str, kind: UnsafeKind, found: str = "a symlink") -> None:
        self.what = what
        self.kind: UnsafeKind = kind
        self.found = found
        super().__init__(
            f"{what} is a symlink"
            if kind == "symlink"
            else f"{what} is not a regular file but {found}"
        )


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO", "a directory", ...)."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    )
    return next((name for is_kind, name in kinds if is_kind(mode)), f"mode {oct(mode)}")


def open_regular(path: Path | str, what: str, *, follow_symlinks: bool = False) -> int:
    """A blocking read-only descriptor on the regular file at ``path``, opened without ever
    blocking. ``UnsafeFile`` for a symlink (unless ``follow_symlinks``) or anything but a
    regular file; the open's ``OSError`` otherwise (``FileNotFoundError`` for a missing
    file)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise UnsafeFile(what, "symlink") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeFile(what, "not_regular", file_kind(mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    path: Path | str, what: str, limit: int, *, follow_symlinks: bool = False
) -> bytes:
    """At most ``limit`` + 1 bytes of the regular file at ``path`` (one more, so a caller sees
    "too long"); errors as ``open_regular``'s."""
    fd = open_regular(path, what, follow_symlinks=follow_symlinks)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        chunks = []
        left = limit + 1
        while left > 0 and (chunk := fh.read(min(left, READ_PIECE_BYTES))):
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)
