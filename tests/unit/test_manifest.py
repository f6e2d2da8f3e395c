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


# ------------------------------------------------------------------ edge cases (issue 11)


@pytest.mark.parametrize("path", ["MANIFEST.JSON", "Manifest.json.SIG", ".Complete.json"])
def test_reserved_names_are_compared_case_insensitively(path):
    # On a case-insensitive filesystem (macOS, Windows shares) "MANIFEST.JSON" overwrites the
    # manifest; the cache's completion marker likewise.
    with pytest.raises(ArtifactRejected) as info:
        check_relative_path(path)
    assert info.value.category == "path" and "reserved" in info.value.detail


def test_reserved_names_in_a_manifest_are_refused_whatever_their_case():
    doc = json.loads(json.dumps(GOOD))
    doc["files"].append({"path": "Manifest.JSON", "sha256": "b" * 64, "bytes": 1})
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "path" and "Manifest.JSON" in info.value.detail


def test_path_limit_is_255_bytes_of_utf8_not_characters():
    # 128 two-byte characters: 128 characters (under 255) but 256 bytes, more than a file
    # name may have on Linux (NAME_MAX counts bytes).
    doc = json.loads(json.dumps(GOOD))
    doc["files"][0]["path"] = "é" * 128
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "schema"
    assert "files.0.path" in info.value.detail and "255 bytes" in info.value.detail


def test_a_path_of_exactly_255_bytes_is_accepted():
    doc = json.loads(json.dumps(GOOD))
    doc["files"][0]["path"] = "é" * 127 + "x"  # 254 + 1 bytes
    assert parse_manifest(encode(doc)).files[0].path == doc["files"][0]["path"]


@pytest.mark.parametrize(
    "char",
    [
        "\x85",  # C1: NEL
        "\x9b",  # C1: CSI, a terminal escape on its own
        "\u202e",  # bidi: right-to-left override ("gpj.exe" shown as "exe.jpg")
        "\u2066",  # bidi: left-to-right isolate
        "\u200f",  # bidi: right-to-left mark
        "\u200b",  # zero-width space: two names that look the same
        "\u200d",  # zero-width joiner
        "\ufeff",  # zero-width no-break space (BOM)
        "\u2028",  # line separator
    ],
)
def test_control_bidi_and_invisible_characters_are_refused_in_paths(char):
    with pytest.raises(ArtifactRejected) as info:
        check_relative_path(f"weights{char}.bin")
    assert info.value.category == "path"
    assert f"U+{ord(char):04X}" in info.value.detail


def test_a_refused_path_is_shown_escaped():
    with pytest.raises(ArtifactRejected) as info:
        check_relative_path("a\x1b[31mred")
    assert "\x1b" not in info.value.detail and "\\x1b[31mred" in info.value.detail


def test_duplicate_json_keys_are_refused():
    # json and pydantic keep the last of two equal keys: a reviewer reading the first
    # "artifact_id" would approve something else than what the service loads.
    data = encode(GOOD).replace(
        b'"artifact_id": "ranker-v42"', b'"artifact_id": "ranker-v42", "artifact_id": "evil"'
    )
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(data)
    assert info.value.category == "schema" and "duplicate key 'artifact_id'" in info.value.detail


def test_duplicate_keys_nested_in_a_file_entry_are_refused():
    data = encode(GOOD).replace(b'"bytes": 10', b'"bytes": 10, "bytes": 11')
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(data)
    assert info.value.category == "schema" and "duplicate key 'bytes'" in info.value.detail


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["files"][0].update(bytes="12"), "files.0.bytes"),
        (lambda d: d["files"][0].update(bytes=12.0), "files.0.bytes"),
        (lambda d: d["files"][0].update(bytes=True), "files.0.bytes"),
        (lambda d: d.update(schema_version="1"), "schema_version"),
        (lambda d: d.update(schema_version=True), "schema_version"),
        (lambda d: d["architecture"].update(version=1.0), "architecture.version"),
        (lambda d: d.update(model=5), "model"),
    ],
)
def test_no_lax_type_coercion(mutate, field):
    doc = json.loads(json.dumps(GOOD))
    mutate(doc)
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(encode(doc))
    assert info.value.category == "schema"
    assert field in info.value.detail


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_json_numbers_are_refused(constant):
    data = encode(GOOD).replace(b'"hidden": 64', b'"hidden": ' + constant)
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(data)
    assert info.value.category == "schema"


def test_deeply_nested_json_is_a_schema_rejection_not_a_crash():
    nested = b"[" * 100_000 + b"]" * 100_000
    data = encode(GOOD).replace(
        b'{"offline_eval": {"ndcg@10": 0.41}}', b'{"deep": ' + nested + b"}"
    )
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(data)
    assert info.value.category == "schema"


def test_manifest_that_is_not_utf8_is_refused():
    data = encode(GOOD).replace(b"ranker-v42", b"ranker-v\xff2")
    with pytest.raises(ArtifactRejected) as info:
        parse_manifest(data)
    assert info.value.category == "schema" and "UTF-8" in info.value.detail
