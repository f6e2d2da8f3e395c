"""The cache itself (``ArtifactCache``): fetch an artifact into a content-addressed entry or
serve a published one re-checked, set entries aside, lease them, keep the byte budget by
evicting, sweep what crashed fetches left. The package's docstring (app.cache) draws the layout
on disk and the rules that make it crash-safe."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final, Literal

from app.artifact_store import ArtifactSource, check_source_uri
from app.cache.budget import budget_lock, reservation_prefix, reserved_bytes
from app.cache.entries import CacheLimits, FetchSink, Lease, VerifiedArtifact
from app.cache.files import (
    DIRECTORY_FLAGS,
    LOCK_FILE_FLAGS,
    MAX_MARKER_BYTES,
    fsync_dir,
    read_cached_file,
    try_flock,
    write_synced,
)
from app.cache.root import claim_cache_root
from app.cache.signatures import EntrySignatures
from app.cache.transfer import check_limits, check_listing, copy_verified, rehash, run_parallel
from app.contracts import FetchConfig, SignatureTrust
from app.errors import ArtifactRejected, FetchFailed
from app.loading.control import LoadControl, begin
from app.manifest import (
    COMPLETE_MARKER_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    is_sha256_hex,
    parse_manifest,
)
from app.safe_text import redact_uri
from app.trust import TrustPolicy

# How often a hit is read before an OSError that says nothing about the entry fails it, and
# the pause before the first retry (doubled after each): local-disk hiccups (EINTR, EAGAIN,
# a descriptor limit reached for a moment, an NFS ESTALE) pass within this.
HIT_READ_ATTEMPTS: Final = 3
HIT_RETRY_PAUSE_S: Final = 0.05
# OSErrors of a hit that say a piece of the published entry is missing or was replaced: the
# entry is broken for every reader and is set aside. Every other one is about this read.
_ENTRY_DAMAGED_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR})


class _HitUnreadable(Exception):
    """An OSError of a cache hit that is about reading now, not about the entry."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(cause)
        self.reason = os.strerror(cause.errno) if cause.errno else type(cause).__name__


class ArtifactCache:
    """One process's handle on a cache directory that several processes share (replicas of a
    node, ``rollout verify``): every decision is made under the directory's own locks."""

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
        self._signatures = EntrySignatures(trust, self.fetch)
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
        (app.loading.control).
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
                info = json.loads(read_cached_file(marker, "completion marker", MAX_MARKER_BYTES))
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
        reservations (app.cache.budget).
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
                fd = os.open(tmp, DIRECTORY_FLAGS | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if try_flock(fd, fcntl.LOCK_EX):
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
        fd = os.open(self.locks_dir / f"{digest}.lock", LOCK_FILE_FLAGS, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _remove_unless_in_use(self, digest: str) -> bool:
        lease_fd = os.open(self.leases_dir / f"{digest}.lease", LOCK_FILE_FLAGS, 0o644)
        lock_fd = os.open(self.locks_dir / f"{digest}.lock", LOCK_FILE_FLAGS, 0o644)
        try:
            if not (try_flock(lease_fd, fcntl.LOCK_EX) and try_flock(lock_fd, fcntl.LOCK_EX)):
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
            manifest_bytes = read_cached_file(
                entry / MANIFEST_NAME, "cached manifest", MAX_MANIFEST_BYTES
            )
            manifest = parse_manifest(manifest_bytes, digest)
            for item in manifest.files:
                st = os.lstat(entry / item.path)
                if not stat.S_ISREG(st.st_mode) or st.st_size != item.bytes:
                    raise ArtifactRejected("size", f"cached {item.path!r} changed")
            if recheck == "digests":
                begin(control, "verify", manifest.total_bytes)
                run_parallel(manifest.files, lambda item: rehash(entry / item.path, item, control))
            stored_signatures = self._signatures.stored(entry, manifest)
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
        if self._signatures.trust is not None:
            # Not a sign of corruption: the entry stays for consumers that need no signature.
            signature = self._signatures.check_hit(
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
        signatures = self._signatures.read(source, manifest)
        signature = None
        try:
            if self._signatures.trust is not None:
                signature = self._signatures.trust.verify(manifest_bytes, manifest, signatures)
            check_limits(manifest, self.limits, self.byte_budget)
            check_listing(source, manifest, self._signatures.names(manifest))
            consumers = dict(sink.start(manifest)) if sink is not None else {}
        except ArtifactRejected as exc:
            exc.artifact_id = manifest.artifact_id
            raise
        tmp, tmp_fd = self._reserve(digest, manifest.total_bytes)
        begin(control, "fetch", manifest.total_bytes)
        try:
            run_parallel(
                manifest.files,
                lambda item: copy_verified(
                    source, item, tmp / item.path, control, consumers.get(item.path)
                ),
            )
            fetched = time.monotonic()
            write_synced(tmp / MANIFEST_NAME, manifest_bytes)
            for name, data in signatures.items():
                if data is not None:
                    write_synced(tmp / name, data)
            marker = {
                "manifest_sha256": digest,
                "artifact_id": manifest.artifact_id,
                "bytes": manifest.total_bytes,
                "source": redact_uri(manifest_uri),  # for people; credentials stay out
                "fetched_at": time.time(),
            }
            write_synced(tmp / COMPLETE_MARKER_NAME, json.dumps(marker).encode())
            for directory in sorted({p.parent for p in tmp.rglob("*")}, reverse=True):
                fsync_dir(directory)
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
            fsync_dir(self.artifacts_dir)
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
            tmp_fd = os.open(tmp, DIRECTORY_FLAGS)
            fcntl.flock(tmp_fd, fcntl.LOCK_EX)
        return tmp, tmp_fd
