"""Manifests on disk that this service could serve (runtime, feature schema, precision,
architecture and the files a runtime needs), for registering through the CLI, which refuses
anything else. Registration reads only the manifest, so the files it lists need not exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.artifact_store import manifest_uri_for
from app.manifest import MANIFEST_NAME, Manifest, sha256_hex
from app.models.ranker_mlp.features import FEATURE_SCHEMA
from app.preprocessing import LABEL_MAPPING_FILE, NORMALIZATION_FILE
from tests.integration.manifests import ManifestRef


def write_servable_manifest(
    directory: Path,
    artifact_id: str,
    *,
    model: str = "ranker",
    metadata: dict[str, Any] | None = None,
    weights_digest: str = "ab" * 32,
) -> ManifestRef:
    """Like ``manifests.write_manifest``, with a manifest ``check_compatibility`` accepts."""
    manifest = Manifest(
        model=model,
        artifact_id=artifact_id,
        runtime="safetensors",
        architecture={"name": "ranker-mlp", "version": 1, "params": {}},
        feature_schema=FEATURE_SCHEMA,
        precision="fp32",
        files=[
            {"path": "weights.safetensors", "sha256": weights_digest, "bytes": 1024},
            {"path": NORMALIZATION_FILE, "sha256": "cd" * 32, "bytes": 64},
            {"path": LABEL_MAPPING_FILE, "sha256": "ef" * 32, "bytes": 64},
        ],
        metadata=metadata if metadata is not None else {"offline_eval": {"ndcg@10": 0.41}},
    )
    directory.mkdir(parents=True)
    data = manifest.to_bytes()
    (directory / MANIFEST_NAME).write_bytes(data)
    return ManifestRef(manifest_uri_for(directory), sha256_hex(data), model, artifact_id)
