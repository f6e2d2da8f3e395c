"""Small, valid manifests on disk, for registering artifacts in registry tests.

Registration reads only the manifest, so the files it lists need not exist."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.artifact_store import manifest_uri_for
from app.manifest import MANIFEST_NAME, Manifest, sha256_hex


@dataclass(frozen=True)
class ManifestRef:
    uri: str  # file:// URI of manifest.json
    sha256: str
    model: str
    artifact_id: str


MakeManifest = Callable[..., ManifestRef]


def write_manifest(
    directory: Path,
    artifact_id: str,
    *,
    model: str = "ranker",
    metadata: dict[str, Any] | None = None,
    weights_digest: str = "ab" * 32,
) -> ManifestRef:
    manifest = Manifest(
        model=model,
        artifact_id=artifact_id,
        runtime="safetensors",
        architecture={"name": "ranker-mlp", "version": 1, "params": {"hidden": 64}},
        feature_schema="ranker-features-v3",
        precision="fp32",
        files=[{"path": "weights.safetensors", "sha256": weights_digest, "bytes": 1024}],
        metadata=metadata if metadata is not None else {"offline_eval": {"ndcg@10": 0.41}},
    )
    directory.mkdir(parents=True)
    data = manifest.to_bytes()
    (directory / MANIFEST_NAME).write_bytes(data)
    return ManifestRef(manifest_uri_for(directory), sha256_hex(data), model, artifact_id)
