"""The verified artifact cache: content-addressed, crash-safe, shared between processes.

Layout under ``root``::

    .ray-rollout-cache             marks the directory as a cache (format version); a cache
                                   opens, and so sweeps, nothing else (claim_cache_root)
    artifacts/<manifest_sha256>/   published entries: manifest.json, files, .complete.json
    tmp/<prefix>.<bytes>_<random>/ downloads in progress (flock held on the directory; the
                                   bytes it reserves against the budget in its name)
    locks/<manifest_sha256>.lock   one fetcher per digest at a time (flock, exclusive)
    locks/budget.lock              making room and reserving it, one fetcher at a time
    leases/<manifest_sha256>.lease pins an entry against eviction (flock, shared)

A fetch streams every file into a private temp directory while hashing it, compares size and
SHA-256 with the manifest, fsyncs files and directories, writes the completion marker and
renames the directory into place in one step. A crash leaves only temp directories whose lock
is gone; they are swept when a cache is opened. No file under ``artifacts/`` is ever written in
place.

A hit is re-checked (sizes, or digests), its signatures verified when a trust policy is set
(an entry may come from a process without one; app.trust), and every cached file is opened so
that nothing swapped in after publication can block a reader or redirect it
(``open_regular``). An entry keeps the signature files its source had (the project's
``manifest.json.sig``, an OpenSSF ``model.sig``) for consumers that trust them; when those fail
and the source's current ones verify (a key rotated, an artifact signed after it was cached),
the entry takes the new ones, each replaced in one rename: the only change ever made to a
published entry. A hit that cannot be read now (an OSError other than a piece of the entry
missing: EIO, EMFILE, ESTALE...) says nothing about the bytes: it is tried again
(``HIT_READ_ATTEMPTS``), then fails as ``FetchFailed``, and the entry stays for every replica
that holds a lease on it. Only bytes that do not match, or a piece missing, set an entry aside.

The byte budget (``byte_budget``) is kept by evicting least recently used entries before each
download, counting the downloads in progress; entries in use are never evicted, so it may be
exceeded by what is in use: app.cache_budget says exactly by how much.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, Protocol

from app.artifact_store import ArtifactSource, check_source_uri
from app.cache_budget import budget_lock, reservation_prefix, reserved_bytes
from app.contracts import FetchConfig, SignatureTrust
from app.errors import ArtifactRejected, ConfigError, FetchFailed
from app.load_control import LoadControl, advance, begin, checkpoint
from app.manifest import (
    COMPLETE_MARKER_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    is_sha256_hex,
    parse_manifest,
)
from app.safe_text import redact_uri, terminal_safe
from app.trust import TrustPolicy, signature_limits

GiB: Final = 1 << 30
CHUNK_BYTES: Final = 8 << 20
# Digests of bytes already in memory are taken in pieces this large, a pacing point between
# each (a few ms of SHA-256): one call over a whole file would be one long burst.
HASH_PIECE_BYTES: Final = 4 << 20
MAX_PARALLEL_FILES: Final = 4
MAX_MARKER_BYTES: Final = 64 << 10
# Written in a cache's root when it is created: only a directory that holds it (or an empty
# one, or a cache from before the marker) is ever opened, and so swept.
CACHE_MARKER_NAME: Final = ".ray-rollout-cache"
CACHE_FORMAT: Final = "ray-rollout-cache"
CACHE_FORMAT_VERSION: Final = 1
# Lock and lease files, directories: opened without following a symlink planted in their place.
_LOCK_FILE_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# How often a hit is read before an OSError that says nothing about the entry fails it, and
# the pause before the first retry (doubled after each): local-disk hiccups (EINTR, EAGAIN,
# a descriptor limit reached for a moment, an NFS ESTALE) pass within this.
HIT_READ_ATTEMPTS: Final = 3
HIT_RETRY_PAUSE_S: Final = 0.05
# OSErrors of a hit that say a piece of the published entry is missing or was replaced: the
# entry is broken for every reader and is set aside. Every other one is about this read.
_ENTRY_DAMAGED_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR})


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
        the cached copy was changed after the fetch. ``control``: see app.load_control.
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
            fd = open_regular(self.path / rel, f"cached file {rel!r}")
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
        self._fd: int | None = os.open(path, _LOCK_FILE_FLAGS, 0o644)
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


def open_regular(path: Path, what: str) -> int:
    """Open ``path`` for reading only if it is a regular file, without ever blocking.

    ``O_NOFOLLOW`` refuses a symlink; ``O_NONBLOCK`` makes opening a FIFO return at once (a
    plain open would wait forever for a writer); ``fstat`` on the descriptor judges the file
    actually opened, not one that was checked by name earlier. O_NONBLOCK is then cleared so
    reads of the regular file behave normally. ArtifactRejected ``path`` for anything else.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ArtifactRejected("path", f"{what} is a symlink") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ArtifactRejected("path", f"{what} is not a regular file but {_kind(mode)}")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for is_kind, name in kinds if is_kind(mode)), f"mode {oct(mode)}")


def read_regular(path: Path, what: str, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of a regular file (one more, so a caller sees "too long")."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        chunks = []
        left = limit + 1
        while left > 0 and (chunk := fh.read(min(left, CHUNK_BYTES))):
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------- the cache's root

# A node's own cache directory, set in its raylet's environment (its replicas inherit it):
# nodes whose fast disk is mounted elsewhere, several nodes on one host. It wins over the
# config's cache_dir, which is one path for every replica of the application.
NODE_CACHE_DIR_ENV = "RANKER_CACHE_DIR"


def node_cache_dir(configured: str) -> str:
    """The cache directory of a replica on this node: the node's when the node names one (made
    absolute against the working directory), else ``configured``."""
    node = os.environ.get(NODE_CACHE_DIR_ENV)
    return os.path.abspath(node) if node else configured


_LAYOUT: Final = ("artifacts", "tmp", "locks", "leases")
# What the code before the marker left in each directory of the layout (names it makes).
_DIGEST = "[0-9a-f]{64}"
_PREMARKER_NAMES: Final = {
    "artifacts": re.compile(_DIGEST),
    "tmp": re.compile(r"(?:[0-9a-f]{16}|incomplete|evicted|corrupt)\.[A-Za-z0-9_]+"),
    "locks": re.compile(_DIGEST + r"\.lock"),
    "leases": re.compile(_DIGEST + r"\.lease"),
}
_PREMARKER_KINDS: Final = {
    "artifacts": stat.S_ISDIR,
    "tmp": stat.S_ISDIR,
    "locks": stat.S_ISREG,
    "leases": stat.S_ISREG,
}


def _cache_dir_error(root: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"cache_dir {terminal_safe(str(root))}: {problem}; nothing in it was changed",
        field="cache_dir",
    )


def claim_cache_root(root: Path) -> None:
    """Make sure ``root`` is an artifact cache before anything sweeps it.

    A cache deletes unlocked directories under ``tmp/`` and unmarked ones under
    ``artifacts/`` when it opens, so a mistyped ``cache_dir`` (``/``, a home directory) must
    never be opened. ``root`` is used when it holds the marker (written by a cache of a format
    this code reads), is new or empty (then it is marked), or is a cache made before the
    marker existed: exactly the four directories of the layout holding only names that cache
    made (then it is marked too). Anything else: ConfigError, before anything is written.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_dir_error(root, f"cannot be created ({exc.strerror or exc})") from None
    marker = root / CACHE_MARKER_NAME
    for _attempt in range(3):
        info = _read_cache_marker(root, marker)
        if info is not None:
            _check_cache_format(root, info)
            return
        try:
            names = os.listdir(root)
        except OSError as exc:
            raise _cache_dir_error(root, f"cannot be listed ({exc.strerror or exc})") from None
        if CACHE_MARKER_NAME in names:
            continue  # marked by a concurrent opener since we looked
        # Temp files of a concurrent opener writing the marker (see _write_cache_marker).
        names = [n for n in names if not n.startswith(CACHE_MARKER_NAME + ".")]
        if names and not _is_premarker_cache(root, names):
            raise _cache_dir_error(
                root,
                f"is not empty and is not an artifact cache (no {CACHE_MARKER_NAME} marker); "
                "point cache_dir at a new or empty directory",
            )
        _write_cache_marker(root, marker)
    info = _read_cache_marker(root, marker)
    if info is None:  # pragma: no cover - the marker was removed as we wrote it, three times
        raise _cache_dir_error(root, f"its {CACHE_MARKER_NAME} marker keeps disappearing")
    _check_cache_format(root, info)


def _read_cache_marker(root: Path, marker: Path) -> dict[str, object] | None:
    try:
        data = read_regular(marker, CACHE_MARKER_NAME, MAX_MARKER_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ArtifactRejected) as exc:
        raise _cache_dir_error(root, f"unreadable {CACHE_MARKER_NAME} marker ({exc})") from None
    try:
        info = json.loads(data)
    except ValueError:
        info = None
    if not isinstance(info, dict) or info.get("format") != CACHE_FORMAT:
        raise _cache_dir_error(root, f"{CACHE_MARKER_NAME} is not a cache marker")
    return info


def _check_cache_format(root: Path, info: dict[str, object]) -> None:
    version = info.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _cache_dir_error(root, f"{CACHE_MARKER_NAME} has no valid version ({version!r})")
    if version > CACHE_FORMAT_VERSION:
        raise _cache_dir_error(
            root,
            f"is a cache of format version {version}, this code reads up to {CACHE_FORMAT_VERSION}",
        )


def _is_premarker_cache(root: Path, names: list[str]) -> bool:
    if sorted(names) != sorted(_LAYOUT):
        return False
    for name in _LAYOUT:
        directory = root / name
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                return False
            children = os.listdir(directory)
        except OSError:
            return False
        pattern, is_kind = _PREMARKER_NAMES[name], _PREMARKER_KINDS[name]
        for child in children:
            if not pattern.fullmatch(child):
                return False
            try:
                if not is_kind(os.lstat(directory / child).st_mode):
                    return False
            except OSError:
                return False
    return True


def _write_cache_marker(root: Path, marker: Path) -> None:
    """Publish the marker whole (a temp file hard-linked into place), or find that another
    opener did: a reader never sees a half-written marker."""
    data = json.dumps({"format": CACHE_FORMAT, "version": CACHE_FORMAT_VERSION}).encode()
    fd, temp = tempfile.mkstemp(prefix=CACHE_MARKER_NAME + ".", suffix=".tmp", dir=root)
    try:
        try:
            _write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, marker)
        except FileExistsError:
            pass  # a concurrent opener marked it first
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise _cache_dir_error(root, f"cannot be marked ({exc.strerror})") from None
            # No hard links on this filesystem: rename replaces atomically (same content).
            os.rename(temp, marker)
    except OSError as exc:
        raise _cache_dir_error(root, f"cannot be marked ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HitUnreadable(Exception):
    """An OSError of a cache hit that is about reading now, not about the entry."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(cause)
        self.reason = os.strerror(cause.errno) if cause.errno else type(cause).__name__


def _try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class ArtifactCache:
    def __init__(
        self,
        root: Path | str,
        *,
        byte_budget: int | None = None,
        limits: CacheLimits | None = None,
        trust_key: Path | str | None = None,
        trust: SignatureTrust | TrustPolicy | None = None,
        fetch: FetchConfig | None = None,
    ) -> None:
        """Open (or create) the cache at ``root``. ConfigError (field ``cache_dir``) for a
        directory that is not a cache: see ``claim_cache_root``; nothing in it is touched.

        ``trust`` (a policy, or the config to build one from; ``trust_key`` is shorthand for
        one key of it): signatures every fetch and every hit must carry. A key that cannot be
        read is a ConfigError naming ``trust.…``."""
        self.root = Path(root)
        self.byte_budget = byte_budget
        self.limits = limits or CacheLimits()
        self.fetch = fetch or FetchConfig()  # schemes and timeouts of the stores read from
        if isinstance(trust, TrustPolicy) and trust_key:
            raise ValueError("give trust_key within the policy, not beside it")
        if not isinstance(trust, TrustPolicy):
            config = (trust or SignatureTrust()).with_key(str(trust_key) if trust_key else None)
            trust = TrustPolicy.of(config)
        self._trust: TrustPolicy | None = trust
        self._signature_limits = signature_limits(
            trust.signature_file if trust else SignatureTrust().signature_file
        )
        claim_cache_root(self.root)
        self.artifacts_dir = self.root / "artifacts"
        self.tmp_dir = self.root / "tmp"
        self.locks_dir = self.root / "locks"
        self.leases_dir = self.root / "leases"
        for d in (self.artifacts_dir, self.tmp_dir, self.locks_dir, self.leases_dir):
            d.mkdir(exist_ok=True)
        self.swept = self.sweep()

    # ------------------------------------------------------------------ public surface

    def fetch_verified(
        self,
        manifest_uri: str,
        manifest_sha256: str,
        *,
        recheck: Literal["sizes", "digests"] = "sizes",
        control: LoadControl | None = None,
        sink: FetchSink | None = None,
    ) -> VerifiedArtifact:
        """Return the verified entry for ``manifest_sha256``, fetching it if needed.

        ``recheck`` says how a hit is re-checked: file sizes (cheap; loaders re-hash what they
        read anyway) or full digests (``rollout verify``). A corrupted hit is set aside and
        fetched again. ``control`` paces, counts and can cancel a background load
        (app.load_control).
        """
        digest = manifest_sha256.lower()
        if not is_sha256_hex(digest):
            raise ValueError(f"manifest sha256 must be 64 hex characters, got {manifest_sha256!r}")
        # A hit needs no fetch, but it is served only for a URI that could be fetched.
        check_source_uri(manifest_uri, self.fetch)
        hit = self._open_entry(digest, recheck, control, manifest_uri)
        if hit is not None:
            return hit
        with self._digest_lock(digest):
            # Another fetcher may have published while we waited for the lock.
            hit = self._open_entry(digest, recheck, control, manifest_uri, holding_lock=True)
            if hit is not None:
                return hit
            return self._download(manifest_uri, digest, control, sink)

    def set_aside(self, manifest_sha256: str) -> bool:
        """Unpublish an entry whose bytes were found changed after they were verified (by a
        loader reading them): the next fetch reads the source again. Readers that have it
        open keep reading the old files. False when there was no such entry."""
        digest = manifest_sha256.lower()
        if not is_sha256_hex(digest):
            raise ValueError(f"manifest sha256 must be 64 hex characters, got {manifest_sha256!r}")
        with self._digest_lock(digest):
            entry = self.artifacts_dir / digest
            if not os.path.lexists(entry):
                return False
            self._set_aside(entry, "corrupt")
            return True

    def lease(self, manifest_sha256: str) -> Lease:
        """Pin an entry (present or about to be fetched) against eviction until released."""
        return Lease(self.leases_dir / f"{manifest_sha256.lower()}.lease")

    def entries(self) -> list[tuple[str, int, float]]:
        """Published entries as (digest, bytes, last use), least recently used first."""
        found = []
        for entry in self.artifacts_dir.iterdir():
            marker = entry / COMPLETE_MARKER_NAME
            try:
                info = json.loads(read_regular(marker, "completion marker", MAX_MARKER_BYTES))
                found.append((entry.name, int(info["bytes"]), marker.stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError, ArtifactRejected):
                continue
        return sorted(found, key=lambda item: item[2])

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, reserve: int = 0) -> list[str]:
        """Remove least recently used entries until ``reserve`` more bytes fit the budget
        beside the published entries and the downloads in progress (their reservations).

        An entry under a lease, or being fetched, is never removed: when those leave no room,
        every other entry goes and the budget is exceeded by at most their bytes plus the
        reservations (app.cache_budget).
        """
        if self.byte_budget is None:
            return []
        with budget_lock(self.locks_dir):
            return self._evict_locked(reserve)

    def _evict_locked(self, reserve: int) -> list[str]:
        assert self.byte_budget is not None
        entries = self.entries()
        total = sum(size for _, size, _ in entries) + reserved_bytes(self.tmp_dir)
        evicted: list[str] = []
        for digest, size, _ in entries:
            if total + reserve <= self.byte_budget:
                break
            if self._remove_unless_in_use(digest):
                total -= size
                evicted.append(digest)
        return evicted

    def sweep(self) -> list[str]:
        """Remove leftovers of crashed fetches (temp dirs nobody holds) and half entries."""
        removed = []
        for tmp in self.tmp_dir.iterdir():
            try:
                # Only directories are ours; O_NONBLOCK: a FIFO here must not block the open.
                fd = os.open(tmp, _DIRECTORY_FLAGS | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if _try_flock(fd, fcntl.LOCK_EX):
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp.name)
            finally:
                os.close(fd)
        for entry in self.artifacts_dir.iterdir():
            if not (entry / COMPLETE_MARKER_NAME).is_file():
                # Cannot come from this code (the marker is written before the rename), but an
                # operator's copy might: never serve it.
                self._set_aside(entry, "incomplete")
                removed.append(entry.name)
        return removed

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _digest_lock(self, digest: str) -> Iterator[None]:
        fd = os.open(self.locks_dir / f"{digest}.lock", _LOCK_FILE_FLAGS, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _remove_unless_in_use(self, digest: str) -> bool:
        lease_fd = os.open(self.leases_dir / f"{digest}.lease", _LOCK_FILE_FLAGS, 0o644)
        lock_fd = os.open(self.locks_dir / f"{digest}.lock", _LOCK_FILE_FLAGS, 0o644)
        try:
            if not (_try_flock(lease_fd, fcntl.LOCK_EX) and _try_flock(lock_fd, fcntl.LOCK_EX)):
                return False
            self._set_aside(self.artifacts_dir / digest, "evicted")
            return True
        finally:
            os.close(lock_fd)
            os.close(lease_fd)

    def _set_aside(self, entry: Path, why: str) -> None:
        """Unpublish atomically (rename), then delete at leisure."""
        target = Path(tempfile.mkdtemp(prefix=f"{why}.", dir=self.tmp_dir))
        with contextlib.suppress(FileNotFoundError):
            os.rename(entry, target / "entry")
        shutil.rmtree(target, ignore_errors=True)

    def _open_entry(
        self,
        digest: str,
        recheck: str,
        control: LoadControl | None = None,
        manifest_uri: str | None = None,
        *,
        holding_lock: bool = False,
    ) -> VerifiedArtifact | None:
        """The published entry for ``digest``, re-checked; None when absent or corrupt (a
        corrupt one is set aside when ``holding_lock``: the caller holds the digest lock). With
        a trust key its signature is checked on every hit: an entry may have been published by
        a process without one.

        An OSError that says nothing about the entry's bytes is no reason to set it aside
        (another replica may hold a lease on it and read it later): the hit is tried
        ``HIT_READ_ATTEMPTS`` times, then fails as ``FetchFailed`` (retried by loaders), the
        entry kept."""
        pause = HIT_RETRY_PAUSE_S
        for attempt in range(1, HIT_READ_ATTEMPTS + 1):
            try:
                return self._check_entry(digest, recheck, control, manifest_uri, holding_lock)
            except _HitUnreadable as exc:
                if attempt == HIT_READ_ATTEMPTS:
                    raise FetchFailed(
                        f"cached entry {digest[:12]} cannot be read ({exc.reason}; tried "
                        f"{attempt} times); kept: nothing says its bytes are wrong"
                    ) from exc.__cause__
                time.sleep(pause)
                pause *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_entry(
        self,
        digest: str,
        recheck: str,
        control: LoadControl | None,
        manifest_uri: str | None,
        holding_lock: bool,
    ) -> VerifiedArtifact | None:
        """One try of ``_open_entry``; ``_HitUnreadable`` for an OSError not about the bytes."""
        entry = self.artifacts_dir / digest
        if not os.path.lexists(entry):
            return None
        started = time.monotonic()
        try:
            if not stat.S_ISREG(os.lstat(entry / COMPLETE_MARKER_NAME).st_mode):
                raise ArtifactRejected("path", "completion marker is not a regular file")
            manifest_bytes = read_regular(
                entry / MANIFEST_NAME, "cached manifest", MAX_MANIFEST_BYTES
            )
            manifest = parse_manifest(manifest_bytes, digest)
            for item in manifest.files:
                st = os.lstat(entry / item.path)
                if not stat.S_ISREG(st.st_mode) or st.st_size != item.bytes:
                    raise ArtifactRejected("size", f"cached {item.path!r} changed")
            if recheck == "digests":
                begin(control, "verify", manifest.total_bytes)
                self._run_parallel(
                    manifest.files, lambda item: self._rehash(entry / item.path, item, control)
                )
            stored_signatures = self._stored_signatures(entry, manifest)
        except (OSError, ArtifactRejected) as exc:
            if isinstance(exc, OSError) and exc.errno not in _ENTRY_DAMAGED_ERRNOS:
                raise _HitUnreadable(exc) from exc
            # Damaged: set aside, but only by a check made under the digest lock. Without it
            # the entry may since have been replaced by a good one another fetcher published;
            # fetch_verified checks again under the lock.
            if holding_lock:
                self._set_aside(entry, "corrupt")
            return None
        signature = None
        if self._trust is not None:
            # Not a sign of corruption: the entry stays for consumers that need no signature.
            signature = self._check_signatures_of_hit(
                entry, manifest, manifest_bytes, stored_signatures, manifest_uri
            )
        # Last use, for LRU eviction; best effort: a hit is served all the same (the entry
        # only looks older to eviction).
        with contextlib.suppress(OSError):
            os.utime(entry / COMPLETE_MARKER_NAME)
        return VerifiedArtifact(
            entry,
            manifest,
            digest,
            cached=True,
            timings={"verify_s": time.monotonic() - started},
            signature=signature,
        )

    def _signature_names(self, manifest: Manifest) -> dict[str, int]:
        """The signature files this cache reads beside a manifest, with their size limits: a
        name the manifest lists is one of its files, not a signature (a policy refuses such an
        artifact; without one it is served like any other)."""
        listed = {item.path for item in manifest.files}
        return {n: limit for n, limit in self._signature_limits.items() if n not in listed}

    def _stored_signatures(self, entry: Path, manifest: Manifest) -> dict[str, bytes | None]:
        stored: dict[str, bytes | None] = {}
        for name, limit in self._signature_names(manifest).items():
            try:
                stored[name] = read_regular(entry / name, f"cached signature {name}", limit)
            except FileNotFoundError:
                stored[name] = None
        return stored

    def _read_signatures(
        self, source: ArtifactSource, manifest: Manifest
    ) -> dict[str, bytes | None]:
        return {
            name: source.read_small(name, limit=limit)
            for name, limit in self._signature_names(manifest).items()
        }

    def _keep_signatures(self, entry: Path, signatures: dict[str, bytes | None]) -> None:
        """Store the source's signatures in a published entry (each file replaced in one
        rename), so later hits check them without reading the source. Best effort: a hit
        that cannot store them reads the source again next time."""
        for name, data in signatures.items():
            if data is None:
                continue
            tmp = entry / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                self._write_synced(tmp, data)
                tmp.chmod(0o444)
                os.replace(tmp, entry / name)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def _check_signatures_of_hit(
        self,
        entry: Path,
        manifest: Manifest,
        manifest_bytes: bytes,
        stored: dict[str, bytes | None],
        manifest_uri: str | None,
    ) -> str:
        """The mode of the trusted signature over a hit: one stored in the entry, else one the
        source holds now (the manifest bytes are pinned by digest; a signature added or renewed
        at the source after the entry was published, e.g. on key rotation, is as good).
        ArtifactRejected ``signature`` when neither verifies."""
        assert self._trust is not None
        try:
            return self._trust.verify(manifest_bytes, manifest, stored)
        except ArtifactRejected as exc:
            stored_failure = ArtifactRejected(
                "signature", f"cached copy: {exc.detail}", artifact_id=manifest.artifact_id
            )
        if manifest_uri is None:
            raise stored_failure
        current = self._read_signatures(ArtifactSource(manifest_uri, self.fetch), manifest)
        if current == stored:
            raise stored_failure
        try:
            mode = self._trust.verify(manifest_bytes, manifest, current)
        except ArtifactRejected as exc:
            raise ArtifactRejected(
                "signature",
                f"{stored_failure.detail}; at the source: {exc.detail}",
                artifact_id=manifest.artifact_id,
            ) from None
        self._keep_signatures(entry, current)
        return mode

    @staticmethod
    def _rehash(path: Path, item: FileEntry, control: LoadControl | None = None) -> None:
        h = hashlib.sha256()
        left = item.bytes + 1  # one more than declared: a grown file is seen, not read forever
        with os.fdopen(open_regular(path, f"cached {item.path!r}"), "rb", buffering=0) as fh:
            while left > 0 and (chunk := fh.read(min(CHUNK_BYTES, left))):
                left -= len(chunk)
                h.update(chunk)
                advance(control, "verify", len(chunk))
                checkpoint(control)
        if left != 1:
            raise ArtifactRejected("size", f"cached {item.path!r} changed size")
        if h.hexdigest() != item.sha256:
            raise ArtifactRejected("digest", f"cached {item.path!r} does not match its digest")

    def _check_listing(self, source: ArtifactSource, manifest: Manifest) -> None:
        listing = source.list_entries()
        if listing is None:
            return
        stored: dict[str, int] = {}
        for entry in listing:
            if entry.kind == "symlink":
                raise ArtifactRejected("path", f"{entry.path!r} is a symlink")
            if entry.kind != "file":
                raise ArtifactRejected("path", f"{entry.path!r} is not a regular file")
            stored[entry.path] = entry.size
        stored.pop(MANIFEST_NAME, None)
        for name in self._signature_names(manifest):
            stored.pop(name, None)
        listed = {item.path: item for item in manifest.files}
        extra = sorted(set(stored) - set(listed))
        if extra:
            raise ArtifactRejected("extra", f"files not in the manifest: {', '.join(extra)}")
        missing = sorted(set(listed) - set(stored))
        if missing:
            raise ArtifactRejected("missing", f"listed files absent: {', '.join(missing)}")
        for path, item in listed.items():
            if stored[path] != item.bytes:
                raise ArtifactRejected(
                    "size", f"{path!r} is {stored[path]} bytes, manifest says {item.bytes}"
                )

    def _check_limits(self, manifest: Manifest) -> None:
        lim = self.limits
        if len(manifest.files) > lim.max_files:
            raise ArtifactRejected("limits", f"{len(manifest.files)} files (max {lim.max_files})")
        for item in manifest.files:
            if item.bytes > lim.max_file_bytes:
                raise ArtifactRejected(
                    "limits",
                    f"{item.path!r} declares {item.bytes} bytes (max {lim.max_file_bytes})",
                )
        if manifest.total_bytes > lim.max_total_bytes:
            raise ArtifactRejected(
                "limits",
                f"artifact declares {manifest.total_bytes} bytes (max {lim.max_total_bytes})",
            )
        if self.byte_budget is not None and manifest.total_bytes > self.byte_budget:
            raise ArtifactRejected(
                "budget",
                f"artifact is {manifest.total_bytes} bytes, cache budget is {self.byte_budget}",
            )

    def _download(
        self,
        manifest_uri: str,
        digest: str,
        control: LoadControl | None = None,
        sink: FetchSink | None = None,
    ) -> VerifiedArtifact:
        started = time.monotonic()
        source = ArtifactSource(manifest_uri, self.fetch)
        manifest_bytes = source.read_small(None)
        if manifest_bytes is None:
            raise ArtifactRejected("missing", f"no manifest at {redact_uri(manifest_uri)}")
        manifest = parse_manifest(manifest_bytes, digest)
        signatures = self._read_signatures(source, manifest)
        signature = None
        try:
            if self._trust is not None:
                signature = self._trust.verify(manifest_bytes, manifest, signatures)
            self._check_limits(manifest)
            self._check_listing(source, manifest)
            consumers = dict(sink.start(manifest)) if sink is not None else {}
        except ArtifactRejected as exc:
            exc.artifact_id = manifest.artifact_id
            raise
        tmp, tmp_fd = self._reserve(digest, manifest.total_bytes)
        begin(control, "fetch", manifest.total_bytes)
        try:
            self._run_parallel(
                manifest.files,
                lambda item: self._copy_verified(
                    source, item, tmp / item.path, control, consumers.get(item.path)
                ),
            )
            fetched = time.monotonic()
            self._write_synced(tmp / MANIFEST_NAME, manifest_bytes)
            for name, data in signatures.items():
                if data is not None:
                    self._write_synced(tmp / name, data)
            marker = {
                "manifest_sha256": digest,
                "artifact_id": manifest.artifact_id,
                "bytes": manifest.total_bytes,
                "source": redact_uri(manifest_uri),  # for people; credentials stay out
                "fetched_at": time.time(),
            }
            self._write_synced(tmp / COMPLETE_MARKER_NAME, json.dumps(marker).encode())
            for directory in sorted({p.parent for p in tmp.rglob("*")}, reverse=True):
                _fsync_dir(directory)
            final = self.artifacts_dir / digest
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # Someone published the same digest (e.g. without our lock): one copy wins.
                shutil.rmtree(tmp, ignore_errors=True)
                hit = self._open_entry(
                    digest, "sizes", manifest_uri=manifest_uri, holding_lock=True
                )
                if hit is None:
                    raise
                return hit
            _fsync_dir(self.artifacts_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.close(tmp_fd)
        done = time.monotonic()
        for item in manifest.files:
            (final / item.path).chmod(0o444)
        for name, data in signatures.items():
            if data is not None:
                (final / name).chmod(0o444)
        return VerifiedArtifact(
            final,
            manifest,
            digest,
            cached=False,
            timings={"fetch_s": fetched - started, "publish_s": done - fetched},
            signature=signature,
        )

    def _reserve(self, digest: str, size: int) -> tuple[Path, int]:
        """Make room for ``size`` bytes and create the download's temp directory, flocked
        ("in progress": sweep leaves it alone), its name reserving ``size`` bytes; under the
        budget lock, so that concurrent fetchers count each other's reservations."""
        with contextlib.ExitStack() as stack:
            if self.byte_budget is not None:
                stack.enter_context(budget_lock(self.locks_dir))
                self._evict_locked(size)
            tmp = Path(tempfile.mkdtemp(prefix=reservation_prefix(digest, size), dir=self.tmp_dir))
            tmp_fd = os.open(tmp, _DIRECTORY_FLAGS)
            fcntl.flock(tmp_fd, fcntl.LOCK_EX)
        return tmp, tmp_fd

    @staticmethod
    def _run_parallel(items: list[FileEntry], work: object) -> None:
        """Run ``work`` per file; hashing and I/O release the GIL, so files overlap."""
        assert callable(work)
        if len(items) == 1:
            work(items[0])
            return
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(items))) as pool:
            futures = [pool.submit(work, item) for item in items]
            for future in futures:
                future.result()

    @staticmethod
    def _write_synced(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _copy_verified(
        source: ArtifactSource,
        item: FileEntry,
        dest: Path,
        control: LoadControl | None = None,
        consume: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Stream one file into ``dest`` while hashing it: chunk i+1 is read while chunk i is
        hashed (then handed to ``consume``, a FetchSink's consumer, in file order) on one
        thread and written on another, in two buffers taken in turn; a buffer is read into
        again only once its chunk is hashed, consumed and written. Reading, SHA-256 and
        writing release the GIL, so the fetch takes about the longest of the three."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        total = 0
        buffers = (bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES))
        in_flight: list[list[Future[None]]] = [[], []]

        def hash_and_consume(view: memoryview) -> None:
            digest.update(view)
            if consume is not None:
                consume(view)
            checkpoint(control)  # this thread's pacing, and a stop as soon as asked

        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Both threads are started from the fetching thread and share its CPU priority;
            # leaving the block waits for whatever they still do with the buffers.
            with (
                source.open(item.path, size=item.bytes) as src,
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-hash") as hasher,
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-write") as writer,
            ):
                index = 0
                while True:
                    turn = index % 2
                    for future in in_flight[turn]:
                        future.result()
                    buf = buffers[turn]
                    if hasattr(src, "readinto"):
                        n = src.readinto(buf)
                    else:  # pragma: no cover - fsspec files without readinto
                        data = src.read(CHUNK_BYTES)
                        n = len(data)
                        buf[:n] = data
                    if not n:
                        break
                    total += n
                    if total > item.bytes:
                        raise ArtifactRejected(
                            "size", f"{item.path!r} is larger than the {item.bytes} bytes declared"
                        )
                    view = memoryview(buf)[:n]
                    in_flight[turn] = [
                        hasher.submit(hash_and_consume, view),
                        writer.submit(_write_all, out, view),
                    ]
                    advance(control, "fetch", n)
                    checkpoint(control)
                    index += 1
                for futures in in_flight:
                    for future in futures:
                        future.result()
            if total != item.bytes:
                raise ArtifactRejected(
                    "size", f"{item.path!r} is {total} bytes, manifest says {item.bytes}"
                )
            if digest.hexdigest() != item.sha256:
                raise ArtifactRejected(
                    "digest",
                    f"{item.path!r} has sha256 {digest.hexdigest()}, manifest says {item.sha256}",
                )
            os.fsync(out)
        finally:
            os.close(out)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]
