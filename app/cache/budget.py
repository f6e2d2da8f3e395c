"""The byte budget's bookkeeping of downloads in progress (app.cache).

Eviction makes room for a download before it starts, but the download's bytes are only counted
once it is published: two fetches of different artifacts, each making room for itself alone,
would together fill the cache past its budget. So each download reserves its declared bytes
where every fetcher sees them, in the name of its temp directory
(``tmp/<digest[:16]>.<bytes>_<random>``), which it holds an exclusive flock on while it runs;
eviction counts the reservations of the directories so held. Making room and reserving happen
under one cache-wide lock (``locks/budget.lock``), so no two fetchers make room for themselves
from the same count.

What the budget cannot hold back is what eviction may not remove: an entry in use (leased, or
locked by its fetcher) and the downloads already reserved. When those leave no room, every
other entry is evicted and the download goes ahead: the cache then exceeds the budget by at
most the bytes of the entries in use plus the reservations already made (a single artifact
larger than the budget is refused outright), until they are released and a later fetch
evicts. Manifests, signatures and completion markers (a few KiB per entry) are not counted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from app.cache.files import DIRECTORY_FLAGS, LOCK_FILE_FLAGS

BUDGET_LOCK_NAME: Final = "budget.lock"
# A download's temp directory: a digest's first 16 hex digits, the bytes it reserves, then
# mkdtemp's random part (letters, digits, '_'). Directories of other names reserve nothing.
_RESERVATION: Final = re.compile(r"[0-9a-f]{16}\.(\d+)_[A-Za-z0-9_]*")


def reservation_prefix(digest: str, size: int) -> str:
    """The ``mkdtemp`` prefix of a download of ``size`` bytes of ``digest``."""
    return f"{digest[:16]}.{size}_"


def reserved_bytes(tmp_dir: Path) -> int:
    """The bytes reserved by downloads in progress under ``tmp_dir``: those whose directory
    is flocked by its fetcher. A leftover of a crashed fetch (no flock) reserves nothing."""
    total = 0
    for tmp in tmp_dir.iterdir():
        match = _RESERVATION.fullmatch(tmp.name)
        if match is None:
            continue
        try:
            # O_NONBLOCK: a FIFO planted here must not block the open.
            fd = os.open(tmp, DIRECTORY_FLAGS | os.O_NONBLOCK)
        except OSError:
            continue  # published or swept since the listing
        try:
            # A shared flock is refused only while the fetcher holds its exclusive one.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            total += int(match.group(1))
        finally:
            os.close(fd)  # drops the shared flock, if taken
    return total


@contextlib.contextmanager
def budget_lock(locks_dir: Path) -> Iterator[None]:
    """Held while making room and reserving, by every fetcher of the cache. Its holder never
    waits for another lock (eviction only tries leases and digest locks), so a fetcher may
    take it while holding its digest lock."""
    fd = os.open(locks_dir / BUDGET_LOCK_NAME, LOCK_FILE_FLAGS, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
