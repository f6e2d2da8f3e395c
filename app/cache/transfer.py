"""Bytes into and out of the cache: a file streamed from its source into an entry while it is
hashed (``copy_verified``), a published file hashed again (``rehash``), files of an artifact
side by side (``run_parallel``), and what a source must show before any byte is read
(``check_limits``, ``check_listing``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final

from app.artifact_store import ArtifactSource
from app.cache.entries import CacheLimits
from app.cache.files import CHUNK_BYTES, open_cached_file, write_all
from app.errors import ArtifactRejected
from app.loading.control import LoadControl, advance, checkpoint
from app.manifest import MANIFEST_NAME, FileEntry, Manifest

MAX_PARALLEL_FILES: Final = 4


def run_parallel(items: list[FileEntry], work: Callable[[FileEntry], object]) -> None:
    """Run ``work`` per file; hashing and I/O release the GIL, so files overlap."""
    if len(items) == 1:
        work(items[0])
        return
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(items))) as pool:
        futures = [pool.submit(work, item) for item in items]
        for future in futures:
            future.result()


def rehash(path: Path, item: FileEntry, control: LoadControl | None = None) -> None:
    h = hashlib.sha256()
    left = item.bytes + 1  # one more than declared: a grown file is seen, not read forever
    with os.fdopen(open_cached_file(path, f"cached {item.path!r}"), "rb", buffering=0) as fh:
        while left > 0 and (chunk := fh.read(min(CHUNK_BYTES, left))):
            left -= len(chunk)
            h.update(chunk)
            advance(control, "verify", len(chunk))
            checkpoint(control)
    if left != 1:
        raise ArtifactRejected("size", f"cached {item.path!r} changed size")
    if h.hexdigest() != item.sha256:
        raise ArtifactRejected("digest", f"cached {item.path!r} does not match its digest")


def copy_verified(
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
                    writer.submit(write_all, out, view),
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


def check_limits(manifest: Manifest, lim: CacheLimits, byte_budget: int | None) -> None:
    """What a manifest declares, against the limits and the budget, before any byte is read."""
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
    if byte_budget is not None and manifest.total_bytes > byte_budget:
        raise ArtifactRejected(
            "budget",
            f"artifact is {manifest.total_bytes} bytes, cache budget is {byte_budget}",
        )


def check_listing(
    source: ArtifactSource, manifest: Manifest, signature_names: Iterable[str]
) -> None:
    """The source's listing (where it has one) holds exactly the manifest's files, of their
    sizes, plus the manifest and signatures: nothing extra, nothing missing, no symlink."""
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
    for name in signature_names:
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
