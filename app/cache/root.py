"""The cache's root directory: which directory a replica's cache is (``node_cache_dir``), and
making sure it is a cache before anything in it is swept (``claim_cache_root``)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Final

from app.cache.files import MAX_MARKER_BYTES, fsync_dir, read_cached_file, write_all
from app.errors import ArtifactRejected, ConfigError
from app.safe_text import terminal_safe

# Written in a cache's root when it is created: only a directory that holds it (or an empty
# one, or a cache from before the marker) is ever opened, and so swept.
CACHE_MARKER_NAME: Final = ".ray-rollout-cache"
CACHE_FORMAT: Final = "ray-rollout-cache"
CACHE_FORMAT_VERSION: Final = 1

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
        data = read_cached_file(marker, CACHE_MARKER_NAME, MAX_MARKER_BYTES)
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
            write_all(fd, memoryview(data))
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
    fsync_dir(root)
