"""Packing a directory of model files into an immutable artifact with a manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from app.artifact_store import manifest_uri_for
from app.contracts import (
    DEFAULT_FEATURE_SCHEMA,
    EXPECTED_DIVERGENCE_KEY,
    ExpectedDivergence,
    SignatureTrust,
    Target,
)
from app.errors import ArtifactRejected, ConfigError
from app.manifest import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Architecture,
    ArtifactKind,
    BackboneRef,
    FileEntry,
    Manifest,
    check_file_paths,
    parse_manifest,
    sha256_hex,
)
from app.openssf_signing import DEFAULT_SIGNATURE_FILE, GIT_METADATA, sign_directory
from app.signing import load_signing_key, sign_manifest
from app.trust import directory_digests

# Files of the source directory that describe the artifact rather than belong to it.
ARCHITECTURE_FILE: Final = "architecture.json"
METADATA_FILE: Final = "metadata.json"
_COPY_CHUNK: Final = 8 << 20


@dataclass(frozen=True)
class PackResult:
    artifact_id: str
    out_dir: Path
    manifest_uri: str
    manifest_sha256: str
    # The manifest's: a target of this artifact names it (a replica serving another schema
    # refuses the target before fetching anything).
    feature_schema: str = DEFAULT_FEATURE_SCHEMA
    kind: ArtifactKind = "model"

    def target(self, revision: int) -> Target:
        """This artifact as a cohort's target at ``revision``."""
        return Target(
            revision=revision,
            artifact_id=self.artifact_id,
            manifest_uri=self.manifest_uri,
            manifest_sha256=self.manifest_sha256,
            feature_schema=self.feature_schema,
        )

    def as_json(self) -> dict[str, str]:
        return {
            "artifact_id": self.artifact_id,
            "manifest_uri": self.manifest_uri,
            "manifest_sha256": self.manifest_sha256,
            "feature_schema": self.feature_schema,
            "kind": self.kind,
        }


def _source_files(src_dir: Path) -> list[str]:
    found: list[str] = []
    for root, dirs, files in os.walk(src_dir, followlinks=False):
        if Path(root) == src_dir:
            # Git metadata of a checkout or a model hub snapshot (.gitattributes) is not part
            # of a model; the standard signing tool leaves it out of a signature too.
            dirs[:] = [d for d in dirs if d not in GIT_METADATA]
            files = [f for f in files if f not in GIT_METADATA]
        for name in list(dirs) + files:
            full = Path(root) / name
            rel = full.relative_to(src_dir).as_posix()
            mode = full.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise ArtifactRejected(
                    "path", f"source {rel!r} is a symlink; pack copies files only"
                )
            if name in dirs:
                continue
            if not stat.S_ISREG(mode):
                raise ArtifactRejected("path", f"source {rel!r} is not a regular file")
            found.append(rel)
    return sorted(found)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} is not valid JSON ({exc})") from exc


def _copy_hashing(
    src: Path, dest: Path, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dest, "xb") as fout:
        while chunk := fin.read(_COPY_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
        fout.flush()
        os.fsync(fout.fileno())
    return h.hexdigest(), size


def backbone_ref(artifact_dir: Path) -> BackboneRef:
    """The pin of the packed backbone artifact in ``artifact_dir`` (its manifest's id and
    digest), for packing heads on it; ConfigError when it is no backbone."""
    path = Path(artifact_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"--backbone: cannot read {path}: {exc.strerror or exc}", field="backbone"
        ) from None
    try:
        manifest = parse_manifest(data)
    except ArtifactRejected as exc:
        raise ConfigError(f"--backbone: {path}: {exc}", field="backbone") from None
    if manifest.kind != "backbone":
        raise ConfigError(
            f"--backbone: {manifest.artifact_id} is a {manifest.kind} artifact, not a backbone",
            field="backbone",
        )
    return BackboneRef(artifact_id=manifest.artifact_id, manifest_sha256=sha256_hex(data))


def check_expected_divergence(
    metadata: dict[str, Any], artifact_id: str
) -> ExpectedDivergence | None:
    """The ``metadata.expected_divergence`` block (``rollout replay``'s) of the artifact
    ``artifact_id`` (None without one): one the rollout controller reads, measured against
    another artifact; else ConfigError naming the field (before anything is written)."""
    expected = ExpectedDivergence.from_metadata(metadata)
    if expected is not None and expected.baseline_artifact_id == artifact_id:
        field = f"metadata.{EXPECTED_DIVERGENCE_KEY}.baseline_artifact_id"
        raise ConfigError(
            f"{field}: {artifact_id!r} is the artifact being packed; the block is measured "
            "against another model (the rollout's baseline)",
            field=field,
        )
    return expected


def pack_artifact(
    src_dir: Path,
    out_dir: Path,
    *,
    model: str,
    artifact_id: str,
    feature_schema: str,
    runtime: str = "safetensors",
    precision: str = "fp32",
    architecture: Architecture | None = None,
    metadata: dict[str, Any] | None = None,
    sign_key: Path | None = None,
    signature_file: str = DEFAULT_SIGNATURE_FILE,
    on_start: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    kind: ArtifactKind = "model",
    backbone: BackboneRef | None = None,
) -> PackResult:
    """Copy every regular file of ``src_dir`` into ``out_dir`` and write ``manifest.json``.

    ``architecture.json`` and ``metadata.json`` in ``src_dir`` describe the artifact and are
    folded into the manifest instead of being copied; ``metadata`` is merged over the latter
    (top-level keys). A ``metadata.expected_divergence`` block is validated
    (``app.contracts.ExpectedDivergence``). ``out_dir`` must not exist or be empty.

    ``sign_key``: an ed25519 key writes the project's ``manifest.json.sig``; an EC key an
    OpenSSF model signature (``signature_file``) over the directory, with the digests just
    computed while copying (the files are not read again). ``signature_file`` is reserved
    either way: a source file of that name is refused. Top-level git metadata (``.git``,
    ``.gitattributes``, ...) is not copied.

    ``on_start(total_bytes)`` is called once before the copy, ``on_bytes(n)`` as each chunk
    is copied and hashed (a progress bar).

    ``kind``/``backbone``: a ``backbone`` artifact (every tensor but the family's head), or a
    ``head`` pinning the ``backbone`` it was trained on (``backbone_ref`` of a packed one).
    """
    try:
        signature_file = SignatureTrust(signature_file=signature_file).signature_file
    except ValidationError as exc:
        raise ConfigError(f"--signature-file: {exc.errors(include_url=False)[0]['msg']}") from None
    src_dir, out_dir = Path(src_dir).resolve(), Path(out_dir).resolve()
    if not src_dir.is_dir():
        raise ConfigError(f"SRC_DIR: {src_dir} is not a directory")
    if out_dir == src_dir or src_dir in out_dir.parents:
        raise ConfigError(f"--out: {out_dir} must not be inside the source directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"--out: {out_dir} exists and is not empty (artifacts are immutable)")

    rels = _source_files(src_dir)
    if architecture is None:
        if ARCHITECTURE_FILE not in rels:
            raise ConfigError(
                f"architecture: {src_dir} has no {ARCHITECTURE_FILE} and none was given"
            )
        try:
            architecture = Architecture.model_validate(
                _read_json(src_dir / ARCHITECTURE_FILE, "architecture")
            )
        except ValidationError as exc:
            raise ConfigError(f"architecture: {exc.errors()[0]['msg']}") from exc
    merged_metadata: dict[str, Any] = {}
    if METADATA_FILE in rels:
        loaded = _read_json(src_dir / METADATA_FILE, "metadata")
        if not isinstance(loaded, dict):
            raise ConfigError(f"metadata: {METADATA_FILE} must hold a JSON object")
        merged_metadata.update(loaded)
    merged_metadata.update(metadata or {})
    check_expected_divergence(merged_metadata, artifact_id)
    payload = [r for r in rels if r not in (ARCHITECTURE_FILE, METADATA_FILE)]
    if not payload:
        raise ConfigError(f"SRC_DIR: {src_dir} holds no model files")
    if MANIFEST_NAME in payload or SIGNATURE_NAME in payload:
        raise ConfigError(f"SRC_DIR: {src_dir} already holds a manifest; pack a source tree")
    if signature_file in payload:
        raise ConfigError(
            f"SRC_DIR: {src_dir} holds {signature_file!r}, the name reserved for an OpenSSF "
            "signature of the artifact (rename it, or choose another --signature-file)"
        )
    key = load_signing_key(sign_key) if sign_key is not None else None  # before any copy

    out_dir.mkdir(parents=True, exist_ok=True)
    if on_start is not None:
        on_start(sum((src_dir / rel).stat().st_size for rel in payload))
    try:
        files = []
        for rel in payload:
            digest, size = _copy_hashing(src_dir / rel, out_dir / rel, on_bytes)
            files.append(FileEntry(path=rel, sha256=digest, bytes=size))
        try:
            manifest = Manifest(
                model=model,
                artifact_id=artifact_id,
                kind=kind,
                backbone=backbone,
                runtime=runtime,
                architecture=architecture,
                feature_schema=feature_schema,
                precision=precision,
                files=files,
                metadata=merged_metadata,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{field}: {first['msg']}") from exc
        check_file_paths(manifest)
        manifest_bytes = manifest.to_bytes()
        (out_dir / MANIFEST_NAME).write_bytes(manifest_bytes)
        if isinstance(key, Ed25519PrivateKey):
            (out_dir / SIGNATURE_NAME).write_bytes(sign_manifest(manifest_bytes, key))
        elif key is not None:
            assert sign_key is not None
            digests = directory_digests(manifest_bytes, manifest, project_signature=None)
            sign_directory(out_dir, sign_key, digests, signature_file)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return PackResult(
        artifact_id=artifact_id,
        out_dir=out_dir,
        manifest_uri=manifest_uri_for(out_dir),
        manifest_sha256=sha256_hex(manifest_bytes),
        feature_schema=feature_schema,
        kind=kind,
    )
