from __future__ import annotations

import json
import os

import pytest

from app.errors import ArtifactRejected, ConfigError
from app.manifest import MANIFEST_NAME, SIGNATURE_NAME, parse_manifest, sha256_hex
from app.packing import pack_artifact
from tests.file_artifacts import ARCH


def write_src(root, files):
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_pack_lists_every_file_and_folds_descriptors_into_the_manifest(tmp_path):
    src = write_src(
        tmp_path / "src",
        {
            "weights.safetensors": os.urandom(1000),
            "normalization.json": b"{}",
            "architecture.json": json.dumps(
                {"name": "ranker-mlp", "version": 1, "params": {"hidden": 8}}
            ).encode(),
            "metadata.json": b'{"offline_eval": {"ndcg@10": 0.5}}',
        },
    )
    result = pack_artifact(
        src,
        tmp_path / "out",
        model="ranker",
        artifact_id="r-1",
        feature_schema="s",
        precision="fp16",
    )
    data = (tmp_path / "out" / MANIFEST_NAME).read_bytes()
    assert sha256_hex(data) == result.manifest_sha256
    manifest = parse_manifest(data, result.manifest_sha256)
    assert sorted(f.path for f in manifest.files) == ["normalization.json", "weights.safetensors"]
    assert manifest.architecture.params == {"hidden": 8}
    assert manifest.metadata == {"offline_eval": {"ndcg@10": 0.5}}
    assert manifest.precision == "fp16"
    entry = manifest.file("weights.safetensors")
    assert entry.sha256 == sha256_hex((src / "weights.safetensors").read_bytes())
    assert result.manifest_uri == (tmp_path / "out" / MANIFEST_NAME).as_uri()


def test_pack_is_deterministic(tmp_path):
    src = write_src(tmp_path / "src", {"w.bin": b"abc", "sub/x.json": b"{}"})
    a = pack_artifact(
        src, tmp_path / "a", model="m", artifact_id="i", feature_schema="s", architecture=ARCH
    )
    b = pack_artifact(
        src, tmp_path / "b", model="m", artifact_id="i", feature_schema="s", architecture=ARCH
    )
    assert a.manifest_sha256 == b.manifest_sha256


def test_pack_refuses_symlinks_and_non_empty_output(tmp_path):
    src = write_src(tmp_path / "src", {"w.bin": b"abc"})
    (src / "link").symlink_to(src / "w.bin")
    with pytest.raises(ArtifactRejected) as info:
        pack_artifact(
            src, tmp_path / "o", model="m", artifact_id="i", feature_schema="s", architecture=ARCH
        )
    assert info.value.category == "path"
    (src / "link").unlink()
    out = tmp_path / "o2"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        pack_artifact(src, out, model="m", artifact_id="i", feature_schema="s", architecture=ARCH)
    assert (out / "keep").read_text() == "x"


def test_pack_without_architecture_names_it(tmp_path):
    src = write_src(tmp_path / "src", {"w.bin": b"abc"})
    with pytest.raises(ConfigError, match=r"^architecture"):
        pack_artifact(src, tmp_path / "o", model="m", artifact_id="i", feature_schema="s")
    assert not (tmp_path / "o").exists()


def test_pack_bad_artifact_id_names_the_field(tmp_path):
    src = write_src(tmp_path / "src", {"w.bin": b"abc"})
    with pytest.raises(ConfigError, match=r"^artifact_id"):
        pack_artifact(
            src,
            tmp_path / "o",
            model="m",
            artifact_id="../x",
            feature_schema="s",
            architecture=ARCH,
        )


def test_signed_pack_writes_detached_signature(tmp_path):
    from app.signing import generate_keypair

    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    src = write_src(tmp_path / "src", {"w.bin": b"abc"})
    pack_artifact(
        src,
        tmp_path / "o",
        model="m",
        artifact_id="i",
        feature_schema="s",
        architecture=ARCH,
        sign_key=tmp_path / "k.pem",
    )
    assert (tmp_path / "o" / SIGNATURE_NAME).read_bytes().endswith(b"\n")
