"""The artifact manifest: what an immutable model artifact is made of.

Pure module (no Ray, no database, no I/O beyond what callers hand in). The manifest is the
unit of trust: its SHA-256, over the bytes exactly as stored, is pinned by the registry, and
every file it lists is checked for size and digest before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import unicodedata
from typing import Any, Final, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.errors import ArtifactRejected

MANIFEST_NAME: Final = "manifest.json"
SIGNATURE_NAME: Final = "manifest.json.sig"
# Written by the verified cache next to the files; no artifact may ship a file of that name.
COMPLETE_MARKER_NAME: Final = ".complete.json"
RESERVED_NAMES: Final = frozenset({MANIFEST_NAME, SIGNATURE_NAME, COMPLETE_MARKER_NAME})
# A file path's limit in bytes of UTF-8, as filesystems count it (NAME_MAX), not characters.
MAX_PATH_BYTES: Final = 255
MANIFEST_SCHEMA_VERSION: Final = 1
# A manifest is a small JSON document; anything bigger is not one.
MAX_MANIFEST_BYTES: Final = 1 << 20

_HEX = frozenset("0123456789abcdef")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and all(c in _HEX for c in value)


# Strict: no lax coercion ("12", 12.0 or true for a size); a manifest says exactly what it means.
_MANIFEST_MODEL = ConfigDict(frozen=True, extra="forbid", strict=True)


class FileEntry(BaseModel):
    model_config = _MANIFEST_MODEL

    path: str = Field(min_length=1)
    sha256: str
    bytes: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _fits_in_bytes(cls, value: str) -> str:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError("is not valid Unicode (a lone surrogate)") from None
        if size > MAX_PATH_BYTES:
            raise ValueError(f"is {size} bytes in UTF-8, at most {MAX_PATH_BYTES} bytes allowed")
        return value

    @field_validator("sha256")
    @classmethod
    def _lower_hex(cls, value: str) -> str:
        if not is_sha256_hex(value):
            raise ValueError("must be 64 lowercase hex characters")
        return value


class Architecture(BaseModel):
    """Names an architecture the *service* knows how to build; params are its hyper-parameters."""

    model_config = _MANIFEST_MODEL

    name: str
    version: int = Field(ge=1)
    params: dict[str, int | float | str | bool] = Field(default_factory=dict)


ArtifactKind = Literal["model", "backbone", "head"]
_ARTIFACT_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class BackboneRef(BaseModel):
    """The backbone a head artifact was trained on, pinned like a target pins an artifact.
    The backbone's manifest lies beside the head's in the same store
    (``<store>/<artifact_id>/manifest.json``, see ``backbone_manifest_uri``)."""

    model_config = _MANIFEST_MODEL

    artifact_id: str = Field(min_length=1, max_length=128, pattern=_ARTIFACT_ID_PATTERN)
    manifest_sha256: str

    @field_validator("manifest_sha256")
    @classmethod
    def _lower_hex(cls, value: str) -> str:
        if not is_sha256_hex(value):
            raise ValueError("must be 64 lowercase hex characters")
        return value


class Manifest(BaseModel):
    """Runtime, precision, architecture and feature schema are free strings here on purpose:
    an unknown value is a compatibility rejection (category ``runtime``/``schema``) decided by
    the loader, not a parse error.

    ``kind``: a ``model`` holds every tensor of its architecture (the default, left out of
    the serialised manifest so that manifests packed before kinds existed keep their bytes
    and digests); a ``backbone`` holds every tensor but its family's head and is never served
    alone; a ``head`` holds only the head's tensors and pins the ``backbone`` it runs on."""

    model_config = _MANIFEST_MODEL

    schema_version: int = MANIFEST_SCHEMA_VERSION
    model: str = Field(min_length=1, max_length=128, pattern=_ARTIFACT_ID_PATTERN)
    artifact_id: str = Field(min_length=1, max_length=128, pattern=_ARTIFACT_ID_PATTERN)
    kind: ArtifactKind = "model"
    backbone: BackboneRef | None = None
    runtime: str
    architecture: Architecture
    feature_schema: str
    precision: str
    files: list[FileEntry] = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _backbone_only_on_heads(self) -> Manifest:
        if self.kind == "head" and self.backbone is None:
            raise ValueError(
                "a head artifact names its backbone (backbone: {artifact_id, manifest_sha256})"
            )
        if self.kind != "head" and self.backbone is not None:
            raise ValueError(f"a {self.kind} artifact has no backbone (only a head has one)")
        if self.backbone is not None and self.backbone.artifact_id == self.artifact_id:
            raise ValueError("a head cannot be its own backbone")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def offline_evaluation(self, limit: int = 64) -> dict[str, float]:
        """The numbers of ``metadata.offline_evaluation`` (e.g. ``{"ndcg_at_10": 0.41}``):
        finite numbers under names of at most 200 characters, the first ``limit`` by name.
        Anything else there (the dataset's name, nested blocks) is left out."""
        block = self.metadata.get("offline_evaluation")
        if not isinstance(block, dict):
            return {}
        numbers = {
            name: float(value)
            for name, value in sorted(block.items())
            if isinstance(name, str)
            and 0 < len(name) <= 200
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        return dict(list(numbers.items())[:limit])

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def to_bytes(self) -> bytes:
        """Canonical serialisation used when packing (sorted keys, 2-space indent); a whole
        model's ``kind`` and absent ``backbone`` are left out (the bytes of every manifest
        packed before kinds existed)."""
        document = self.model_dump(mode="json")
        if self.kind == "model":
            del document["kind"]
        if self.backbone is None:
            del document["backbone"]
        return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


# Characters no file path may hold: C0/C1 controls and DEL (Cc), bidi controls, zero-width
# and other invisible format characters (Cf: they make two names look alike or reorder what a
# reviewer reads), line and paragraph separators, and lone surrogates (not text).
_REFUSED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_URL_SYNTAX: Final = frozenset("%?#")
_RESERVED_KEYS: Final = frozenset(
    unicodedata.normalize("NFC", n).casefold() for n in RESERVED_NAMES
)


def backbone_manifest_uri(head_manifest_uri: str, backbone: BackboneRef) -> str:
    """Where a head's backbone lies: the directory beside the head's, named by the backbone's
    artifact id (``s3://bucket/models/head-7/manifest.json`` ->
    ``s3://bucket/models/rb-1/manifest.json``), in the same bucket or host. Any scheme; the
    query or fragment of a URL (a presigned URL's signature) is not carried over.
    ArtifactRejected("backbone") when the head's directory has nothing above it in that
    bucket or host (``s3://bucket/manifest.json``): there is no "beside"."""
    parts = urlsplit(head_manifest_uri)
    head_dir = posixpath.dirname(parts.path)
    if head_dir in ("", "/"):
        raise ArtifactRejected(
            "backbone",
            f"the head's manifest {parts.scheme + '://' if parts.scheme else ''}"
            f"{parts.netloc}{parts.path} is not in a directory of its own, so no backbone "
            "can lie beside it",
        )
    path = posixpath.join(posixpath.dirname(head_dir), backbone.artifact_id, MANIFEST_NAME)
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def check_relative_path(path: str) -> str:
    """Return the path if it is a safe, normalised, relative POSIX path; else reject (``path``)."""
    for char in path:
        if unicodedata.category(char) in _REFUSED_CATEGORIES:
            name = unicodedata.name(char, "control character")
            raise ArtifactRejected(
                "path",
                f"file path {path!r} holds U+{ord(char):04X} ({name}): control, "
                "bidi and invisible characters are not allowed",
            )
    if "\\" in path:
        raise ArtifactRejected("path", f"backslash in file path {path!r}")
    # URL syntax in a name: over HTTP a '%' escape would be decoded ('%2e%2e' climbs like
    # '..'), '?' and '#' would end the path; object-store drivers read '?versionId=' and
    # '#generation' as selectors. The URL quotes each segment too; a name never needs them.
    url_syntax = sorted(set(path) & _URL_SYNTAX)
    if url_syntax:
        raise ArtifactRejected(
            "path",
            f"file path {path!r} holds {', '.join(repr(c) for c in url_syntax)}: percent-escapes, "
            "'?' and '#' are URL syntax and not allowed in a name",
        )
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise ArtifactRejected("path", f"absolute file path {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ArtifactRejected("path", f"file path {path!r} is not normalised (empty, '.' or '..')")
    if posixpath.normpath(path) != path:
        raise ArtifactRejected("path", f"file path {path!r} is not normalised")
    # Compared as a case-insensitive or normalising filesystem would: "MANIFEST.JSON" is the
    # manifest there.
    if _path_key(path) in _RESERVED_KEYS:
        raise ArtifactRejected("path", f"file path {path!r} is reserved")
    return path


def _path_key(path: str) -> str:
    # Two entries that name one file on a case-insensitive or normalising filesystem are
    # duplicates too.
    return unicodedata.normalize("NFC", path).casefold()


def check_file_paths(manifest: Manifest) -> None:
    seen: dict[str, str] = {}
    for entry in manifest.files:
        check_relative_path(entry.path)
        key = _path_key(entry.path)
        if key in seen:
            raise ArtifactRejected(
                "path", f"duplicate file path {entry.path!r} (same as {seen[key]!r})"
            )
        seen[key] = entry.path
    # A file may not also be a directory of another ("a" and "a/b").
    keys = set(seen)
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in keys:
                raise ArtifactRejected("path", f"file path {seen[key]!r} nests under a file")


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Parsers keep the last of two equal keys (json, pydantic) or the first (others): a reviewer
    # and the service could read two different manifests from the same bytes.
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(f"duplicate key {key!r}")
        found[key] = value
    return found


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise ValueError(f"{text} is out of range for a number")
    return value


def _load_json(data: bytes) -> Any:
    """The manifest's JSON document: UTF-8, no duplicate keys, no NaN/Infinity."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactRejected(
            "schema", f"not a valid manifest: not UTF-8 (byte {exc.start})"
        ) from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_refuse_duplicates,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
        )
    except _DuplicateKey as exc:
        raise ArtifactRejected("schema", f"not a valid manifest: {exc}") from None
    except ValueError as exc:  # json.JSONDecodeError included
        raise ArtifactRejected("schema", f"not a valid manifest: invalid JSON: {exc}") from None
    except RecursionError:
        raise ArtifactRejected("schema", "not a valid manifest: JSON nested too deeply") from None


def parse_manifest(data: bytes, expected_sha256: str | None = None) -> Manifest:
    """Check the pinned digest, then parse and check the manifest's own rules.

    Raises ArtifactRejected: ``manifest_digest`` (pinned digest differs), ``limits`` (too big),
    ``schema`` (not a manifest), ``path`` (unsafe file path).
    """
    if expected_sha256 is not None:
        actual = sha256_hex(data)
        if actual != expected_sha256.lower():
            raise ArtifactRejected(
                "manifest_digest",
                f"manifest sha256 is {actual}, expected {expected_sha256.lower()}",
            )
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactRejected(
            "limits", f"manifest is {len(data)} bytes (max {MAX_MANIFEST_BYTES})"
        )
    document = _load_json(data)
    try:
        manifest = Manifest.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ArtifactRejected("schema", f"not a valid manifest: {where}: {first['msg']}") from exc
    if manifest.schema_version != MANIFEST_SCHEMA_VERSION:
        raise ArtifactRejected(
            "schema",
            f"manifest schema_version {manifest.schema_version} is not supported "
            f"(this service reads {MANIFEST_SCHEMA_VERSION})",
            artifact_id=manifest.artifact_id,
        )
    check_file_paths(manifest)
    return manifest
