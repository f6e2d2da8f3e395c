"""What the cache hands out: a verified entry (``VerifiedArtifact``), a file of it read once
and hashed as it is read (``VerifiedStream``), a lease that pins an entry (``Lease``), and what
a fetch may be given (``FetchSink``) or must stay within (``CacheLimits``)."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from app.cache.files import CHUNK_BYTES, HASH_PIECE_BYTES, LOCK_FILE_FLAGS, open_cached_file
from app.errors import ArtifactRejected
from app.loading.control import LoadControl, advance, checkpoint
from app.manifest import FileEntry, Manifest

GiB: Final = 1 << 30


class FetchSink(Protocol):
    """Takes the bytes of a cold fetch as they are hashed on their way into the cache (a
    loader that builds its model from them, so the bytes are read and hashed once in all).
    ``start`` is called once the manifest is verified, before any file is read, and may
    refuse (ArtifactRejected: the fetch stops, nothing is cached); it returns a consumer per
    file path it wants. A consumer gets each chunk in file order, after it was hashed, and
    copies what it keeps (the buffer is reused); what it built counts only if the fetch
    returns: a digest that does not match raises. A hit calls nothing."""

    def start(self, manifest: Manifest) -> Mapping[str, Callable[[memoryview], None]]: ...


@dataclass(frozen=True)
class CacheLimits:
    """What a manifest may declare before a single byte is downloaded."""

    max_files: int = 256
    max_file_bytes: int = 64 * GiB
    max_total_bytes: int = 256 * GiB


@dataclass(frozen=True)
class VerifiedArtifact:
    """A complete, verified entry of the cache."""

    path: Path
    manifest: Manifest
    manifest_sha256: str
    cached: bool = False
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    # The mode of the trusted signature that covers it (app.trust); None: none was asked for.
    signature: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def file_path(self, rel: str) -> Path:
        self.manifest.file(rel)  # KeyError for a path the manifest does not list
        return self.path / rel

    def read_verified(self, rel: str, control: LoadControl | None = None) -> bytearray:
        """Read a listed file whole and check size and digest of exactly the bytes returned
        (``open_stream``, read to its end).

        Loaders deserialize from these bytes, so what is loaded is what was verified even if
        the cached copy was changed after the fetch. ``control``: see app.loading.control.
        """
        with self.open_stream(rel, control) as stream:
            data = bytearray(stream.size)
            view = memoryview(data)
            for start in range(0, stream.size, HASH_PIECE_BYTES):
                stream.readinto(view[start : start + HASH_PIECE_BYTES])
            stream.finish()
        return data

    def open_stream(self, rel: str, control: LoadControl | None = None) -> VerifiedStream:
        """A listed file read once, front to back, hashed as it is read (counted in
        ``control``'s ``load`` stage, which the loader begins): a loader puts the bytes
        straight where they go, and ``VerifiedStream.finish`` says whether they were the
        verified bytes."""
        try:
            entry = self.manifest.file(rel)
        except KeyError:
            raise ArtifactRejected(
                "missing",
                f"{rel!r} is not listed in the manifest",
                artifact_id=self.manifest.artifact_id,
            ) from None
        try:
            fd = open_cached_file(self.path / rel, f"cached file {rel!r}")
        except ArtifactRejected as exc:
            raise ArtifactRejected(
                exc.category, exc.detail, artifact_id=self.manifest.artifact_id
            ) from None
        except OSError as exc:
            raise ArtifactRejected(
                "missing",
                f"cached file {rel!r} unreadable: {exc.strerror or exc}",
                artifact_id=self.manifest.artifact_id,
            ) from exc
        return VerifiedStream(fd, entry, self.manifest.artifact_id, control)


class VerifiedStream:
    """Sequential reads of one cached file. Every byte handed out is hashed from the buffer
    it was read into, after the read: what the caller keeps is exactly what was hashed, even
    if the file changes under it. Nothing read is trustworthy until ``finish`` returns; a
    caller that fails ``finish`` drops everything it built from the bytes.

    The hashing of a chunk runs on a thread of its own while the next chunk is read (the read
    and SHA-256 each release the GIL), so a load takes the longer of the two, not their sum.
    A view handed to ``readinto`` is hashed from where it lies: the caller leaves its bytes
    as they are until the next ``readinto`` or ``finish`` returns (a view over the memory of
    the one before it is only read into once that one is hashed)."""

    def __init__(
        self, fd: int, entry: FileEntry, artifact_id: str, control: LoadControl | None
    ) -> None:
        self._file = os.fdopen(fd, "rb", buffering=0)
        self._entry = entry
        self._artifact_id = artifact_id
        self._control = control
        self._hasher = hashlib.sha256()
        # Started by the first read, from the loading thread: it inherits its CPU priority.
        self._hashing: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_span: tuple[int, int] = (0, 0)
        self.position = 0

    @property
    def size(self) -> int:
        """The size the manifest declares (reads never go past it)."""
        return self._entry.bytes

    def __enter__(self) -> VerifiedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file; a chunk still being hashed is waited for (its memory may be freed
        by the caller next) and its outcome dropped."""
        if self._hashing is not None:
            self._hashing.shutdown(wait=True)
            self._hashing = None
        self._pending = None
        self._file.close()

    def _rejected(self, category: str, detail: str) -> ArtifactRejected:
        return ArtifactRejected(category, detail, artifact_id=self._artifact_id)

    def readinto(self, view: memoryview) -> None:
        """Fill all of ``view`` (a writable byte view) with the next bytes; they are hashed
        while the caller goes on. One checkpoint per call, so callers pass chunks
        (``CHUNK_BYTES``), not whole files."""
        view = view.cast("B")
        wanted = len(view)
        if self.position + wanted > self.size:
            raise ValueError(f"read past the declared {self.size} bytes of {self._entry.path!r}")
        if not wanted:
            return
        span = _memory_span(view)
        if span[0] < self._pending_span[1] and self._pending_span[0] < span[1]:
            self._wait_hashed()  # the same memory as the chunk being hashed: not yet
        got = 0
        while got < wanted:
            n = self._file.readinto(view[got:])
            if not n:
                raise self._rejected(
                    "size",
                    f"cached {self._entry.path!r} ends at byte {self.position + got}, "
                    f"manifest says {self.size}",
                )
            got += n
        self._wait_hashed()  # in file order: the chunk before this one first
        if self._hashing is None:
            self._hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-hash")
        self._pending = self._hashing.submit(self._hash, view)
        self._pending_span = span
        self.position += wanted
        advance(self._control, "load", wanted)
        checkpoint(self._control)

    def _hash(self, view: memoryview) -> None:
        for start in range(0, len(view), HASH_PIECE_BYTES):
            self._hasher.update(view[start : start + HASH_PIECE_BYTES])
            checkpoint(self._control)  # this thread's pacing, and a stop as soon as asked

    def _wait_hashed(self) -> None:
        if self._pending is not None:
            pending, self._pending, self._pending_span = self._pending, None, (0, 0)
            pending.result()

    def skip(self, n: int) -> None:
        """Read and hash ``n`` bytes nobody keeps (padding between tensors)."""
        scratch = bytearray(min(n, CHUNK_BYTES))
        while n > 0:
            step = min(n, len(scratch))
            self.readinto(memoryview(scratch)[:step])
            n -= step

    def finish(self) -> None:
        """All declared bytes were read, the file has no more, and their SHA-256 is the
        manifest's: ArtifactRejected ``size`` / ``digest`` otherwise."""
        if self.position != self.size:
            self.skip(self.size - self.position)
        self._wait_hashed()
        if self._file.read(1):
            raise self._rejected(
                "size", f"cached {self._entry.path!r} is larger than the {self.size} bytes declared"
            )
        digest = self._hasher.hexdigest()
        if digest != self._entry.sha256:
            raise self._rejected(
                "digest",
                f"cached {self._entry.path!r} has sha256 {digest}, manifest says "
                f"{self._entry.sha256} (changed after it was verified)",
            )


def _memory_span(view: memoryview) -> tuple[int, int]:
    """Where a non-empty writable contiguous byte view lies in memory: [start, end)."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return start, start + len(view)


class Lease:
    """Pins one cache entry against eviction while held (a shared flock)."""

    def __init__(self, path: Path) -> None:
        self._fd: int | None = os.open(path, LOCK_FILE_FLAGS, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
