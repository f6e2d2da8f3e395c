from __future__ import annotations

import json

import pytest

from app.errors import ArtifactRejected
from app.manifest import Manifest, check_relative_path, parse_manifest, sha256_hex

GOOD = {
    "schema_version": 1,
    "model": "ranker",
    "artifact_id": "ranker-v42",
    "runtime": "safetensors",
    "architecture": {"name": "ranker-mlp", "version": 1, "params": {"hidden": 64}},
    "feature_schema": "ranker-features-v3",
    "precision": "fp16",
    "files": [{"path": "weights.safetensors", "sha256": "a" * 64, "bytes": 10}],
    "metadata": {"offline_eval": {"ndcg@10": 0.41}},
}


def encode(doc) -> bytes:
    return json.dumps(doc).encode()


def test_parse_checks_pinned_digest_of_the_exact_bytes():
    data = encode(GOOD)
    manifest = parse_manifest(data, sha256_hex(data))
    assert manifest.artifact_id == "ranker-v42" and manifest.total_bytes == 10
    reformatted = json.dumps(GOOD, indent=4).encode()  # same content, other bytes
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(reformatted, sha256_hex(data))
    assert info.value.category == "manifest_digest"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("artifact_id"), "artifact_id"),
        (lambda d: d["files"][0].update(sha256="XYZ"), "files.0.sha256"),
        (lambda d: d["files"][0].update(bytes=-1), "files.0.bytes"),
        (lambda d: d.update(files=[]), "files"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d.update(artifact_id="../evil"), "artifact_id"),
    ],
)
def test_invalid_manifests_name_the_field(mutate, field):
    doc = json.loads(json.dumps(GOOD))
    mutate(doc)
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "schema"
    assert field in info.value.detail


def test_unknown_schema_version_is_refused():
    doc = dict(GOOD, schema_version=2)
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "schema" and "schema_version 2" in info.value.detail


def test_oversized_manifest():
    doc = dict(GOOD, metadata={"blob": "x" * (1 << 20)})
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "limits"


@pytest.mark.parametrize(
    "path",
    ["weights.safetensors", "conf/normalization.json", "a/b/c.bin", "name with space.bin"],
)
def test_safe_paths(path):
    assert check_relative_path(path) == path


@pytest.mark.parametrize(
    "path",
    [
        "/abs",
        "C:/x",
        "../up",
        "a/../b",
        "a/./b",
        "./a",
        "a//b",
        "a/",
        "a\\b",
        "tab\there",
        "nul\x00",
        "manifest.json",
        "manifest.json.sig",
        ".complete.json",
    ],
)
def test_unsafe_paths(path):
    with pytest.raises(ArtifactRejected) as info:
        check_relative_path(path)
    assert info.value.category == "path"


def test_file_nested_under_another_file_is_refused():
    doc = json.loads(json.dumps(GOOD))
    doc["files"].append({"path": "weights.safetensors/inner", "sha256": "b" * 64, "bytes": 1})
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "path"


def test_canonical_bytes_are_stable():
    manifest = Manifest.model_validate(GOOD)
    assert manifest.to_bytes() == Manifest.model_validate_json(manifest.to_bytes()).to_bytes()
