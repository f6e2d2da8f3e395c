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
(app.safe_files). An entry keeps the signature files its source had (the project's
``manifest.json.sig``, an OpenSSF ``model.sig``) for consumers that trust them; when those fail
and the source's current ones verify (a key rotated, an artifact signed after it was cached),
the entry takes the new ones, each replaced in one rename: the only change ever made to a
published entry. A hit that cannot be read now (an OSError other than a piece of the entry
missing: EIO, EMFILE, ESTALE...) says nothing about the bytes: it is tried again
(``HIT_READ_ATTEMPTS``), then fails as ``FetchFailed``, and the entry stays for every replica
that holds a lease on it. Only bytes that do not match, or a piece missing, set an entry aside.

The byte budget (``byte_budget``) is kept by evicting least recently used entries before each
download, counting the downloads in progress; entries in use are never evicted, so it may be
exceeded by what is in use: app.cache.budget says exactly by how much.

The package's modules: ``artifact_cache`` (the cache), ``entries`` (what it hands out),
``root`` (which directory, and claiming it), ``transfer`` (bytes in and out, checks before a
fetch), ``signatures`` (signature files of entries), ``budget`` (reservations of downloads in
progress), ``files`` (its file handling).
"""

from app.cache.artifact_cache import HIT_READ_ATTEMPTS, HIT_RETRY_PAUSE_S, ArtifactCache
from app.cache.entries import CacheLimits, FetchSink, GiB, Lease, VerifiedArtifact, VerifiedStream
from app.cache.files import CHUNK_BYTES, HASH_PIECE_BYTES, MAX_MARKER_BYTES
from app.cache.root import (
    CACHE_FORMAT,
    CACHE_FORMAT_VERSION,
    CACHE_MARKER_NAME,
    NODE_CACHE_DIR_ENV,
    claim_cache_root,
    node_cache_dir,
)
from app.cache.transfer import MAX_PARALLEL_FILES

__all__ = [
    "CACHE_FORMAT",
    "CACHE_FORMAT_VERSION",
    "CACHE_MARKER_NAME",
    "CHUNK_BYTES",
    "HASH_PIECE_BYTES",
    "HIT_READ_ATTEMPTS",
    "HIT_RETRY_PAUSE_S",
    "MAX_MARKER_BYTES",
    "MAX_PARALLEL_FILES",
    "NODE_CACHE_DIR_ENV",
    "ArtifactCache",
    "CacheLimits",
    "FetchSink",
    "GiB",
    "Lease",
    "VerifiedArtifact",
    "VerifiedStream",
    "claim_cache_root",
    "node_cache_dir",
]
