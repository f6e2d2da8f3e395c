"""Builders of real ranker artifacts on disk, good and bad, for the whole team's tests.

Every builder writes a source directory with ``app.demo_artifacts.write_ranker_source``, packs
it with the real ``app.packing.pack_artifact`` under ``root/<artifact_id>`` and returns the
PackResult. ``open_verified`` turns one into a VerifiedArtifact in place (no cache copy; reads
are still size- and digest-checked), ``fetch_verified`` goes through a real ArtifactCache.

    good = good_artifact(tmp_path)                  # loads and dry-runs
    load_verified(open_verified(nan_weights_artifact(tmp_path)))  # -> ArtifactRejected dry_run
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from app.cache import ArtifactCache, VerifiedArtifact
from app.compatibility import WEIGHTS_FILES
from app.demo_artifacts import (
    DEMO_MODEL,
    TWO_TOWER_MODEL,
    family_weights,
    ranker_weights,
    write_ranker_source,
    write_two_tower_source,
)
from app.loading.device import PRECISIONS
from app.manifest import MANIFEST_NAME, Architecture, parse_manifest
from app.models.ranker_mlp.features import FEATURE_SCHEMA
from app.models.ranker_mlp.network import RANKER_MLP
from app.models.two_tower import TWO_TOWER
from app.models.two_tower.features import FEATURE_SCHEMA as TWO_TOWER_SCHEMA
from app.packing import PackResult, pack_artifact
from app.preprocessing import NORMALIZATION_FILE

# A few hundred parameters: builds, loads and dry-runs in milliseconds.
TINY_PARAMS: Final[Mapping[str, int]] = {"hidden_dim": 8, "num_layers": 2, "context_dim": 2}


def tiny_weights(
    seed: int = 0,
    params: Mapping[str, int] = TINY_PARAMS,
    precision: str = "fp32",
) -> dict[str, torch.Tensor]:
    arch = Architecture(name=RANKER_MLP, version=1, params=dict(params))
    return ranker_weights(arch, seed=seed, dtype=PRECISIONS[precision])


def pack_ranker(
    root: Path,
    *,
    artifact_id: str = "ranker-test",
    seed: int = 0,
    params: Mapping[str, int] = TINY_PARAMS,
    precision: str = "fp32",
    runtime: str = "safetensors",
    weights: Mapping[str, torch.Tensor] | None = None,
    edit_source: Callable[[Path], None] | None = None,
    declared_runtime: str | None = None,
    declared_precision: str | None = None,
    feature_schema: str = FEATURE_SCHEMA,
    architecture: Architecture | None = None,
    metadata: dict[str, Any] | None = None,
) -> PackResult:
    """Write and pack one artifact. ``runtime``/``precision`` say what is written;
    ``declared_*`` override what the manifest claims (for dishonest or unknown values)."""
    src = Path(root) / f"src-{artifact_id}"
    write_ranker_source(
        src, seed=seed, params=params, precision=precision, runtime=runtime, weights=weights
    )
    if edit_source is not None:
        edit_source(src)
    return pack_artifact(
        src,
        Path(root) / artifact_id,
        model=DEMO_MODEL,
        artifact_id=artifact_id,
        feature_schema=feature_schema,
        runtime=declared_runtime or runtime,
        precision=declared_precision or precision,
        architecture=architecture,
        metadata=metadata,
    )


# The two-tower family's tiny shape.
TINY_TWO_TOWER_PARAMS: Final[Mapping[str, int]] = {
    "hidden_dim": 8,
    "tower_layers": 1,
    "embed_dim": 4,
    "context_dim": 2,
}


def pack_two_tower(
    root: Path,
    *,
    artifact_id: str = "two-tower-test",
    seed: int = 0,
    params: Mapping[str, int] = TINY_TWO_TOWER_PARAMS,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> PackResult:
    """A ``two-tower`` artifact (model ``TWO_TOWER_MODEL``, schema ``two-tower-features-v1``)."""
    src = Path(root) / f"src-{artifact_id}"
    write_two_tower_source(src, seed=seed, params=params, weights=weights)
    return pack_artifact(
        src,
        Path(root) / artifact_id,
        model=TWO_TOWER_MODEL,
        artifact_id=artifact_id,
        feature_schema=TWO_TOWER_SCHEMA,
    )


def family_tiny_weights(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights ``pack_family`` writes for ``family`` and ``seed``."""
    if family == RANKER_MLP:
        return tiny_weights(seed)
    arch = Architecture(name=TWO_TOWER, version=1, params=dict(TINY_TWO_TOWER_PARAMS))
    return family_weights(arch, seed=seed)


def pack_family(
    root: Path,
    family: str,
    *,
    artifact_id: str | None = None,
    seed: int = 0,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> PackResult:
    """A tiny artifact of a shipped family (``ranker-mlp`` or ``two-tower``)."""
    aid = artifact_id or f"{family}-test"
    if family == RANKER_MLP:
        return pack_ranker(root, artifact_id=aid, seed=seed, weights=weights)
    if family == TWO_TOWER:
        return pack_two_tower(root, artifact_id=aid, seed=seed, weights=weights)
    raise ValueError(f"no such shipped family: {family}")


def pack_for_model(root: Path, model: str, artifact_id: str = "other-v1") -> PackResult:
    """A ranker artifact whose manifest names ``model`` (another model than the service's)."""
    src = root / f"src-{artifact_id}"
    write_ranker_source(src, seed=0, params=TINY_PARAMS)
    return pack_artifact(
        src, root / artifact_id, model=model, artifact_id=artifact_id, feature_schema=FEATURE_SCHEMA
    )


def open_verified(result: PackResult) -> VerifiedArtifact:
    """The packed directory as a VerifiedArtifact, without copying it into a cache."""
    data = (result.out_dir / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(data, result.manifest_sha256)
    return VerifiedArtifact(
        path=result.out_dir, manifest=manifest, manifest_sha256=result.manifest_sha256
    )


def fetch_verified(result: PackResult, cache_root: Path) -> VerifiedArtifact:
    """Through the real cache: download, verify, publish."""
    return ArtifactCache(cache_root).fetch_verified(result.manifest_uri, result.manifest_sha256)


# --------------------------------------------------------------------------- good ones


def good_artifact(root: Path, **kw: Any) -> PackResult:
    return pack_ranker(root, **kw)


def half_artifact(root: Path, precision: str = "fp16", **kw: Any) -> PackResult:
    """fp16 or bf16 weights, declared as such."""
    return pack_ranker(root, artifact_id=f"ranker-{precision}", precision=precision, **kw)


def state_dict_artifact(root: Path, **kw: Any) -> PackResult:
    """runtime pytorch-state-dict: weights.pt written by torch.save."""
    return pack_ranker(root, artifact_id="ranker-pt", runtime="pytorch-state-dict", **kw)


def large_artifact(
    root: Path, hidden_dim: int = 1024, num_layers: int = 8, **kw: Any
) -> PackResult:
    """Slower to hash, load and dry-run (default ~8.5M params, ~34 MB fp32); GPU checks pass
    multi-GB sizes (hidden_dim=16384, num_layers=8 is ~8.6 GB at fp32)."""
    params = {"hidden_dim": hidden_dim, "num_layers": num_layers, "context_dim": 16}
    return pack_ranker(
        root, artifact_id=f"ranker-large-{hidden_dim}x{num_layers}", params=params, **kw
    )


# --------------------------------------------------------------------------- rejected at load


def wrong_schema_artifact(root: Path) -> PackResult:
    """Manifest names another feature schema (-> schema)."""
    return pack_ranker(root, artifact_id="ranker-v2schema", feature_schema="ranker-features-v2")


def unknown_runtime_artifact(root: Path) -> PackResult:
    """-> runtime"""
    return pack_ranker(root, artifact_id="ranker-onnx", declared_runtime="onnx")


def unknown_precision_artifact(root: Path) -> PackResult:
    """-> runtime"""
    return pack_ranker(root, artifact_id="ranker-int8", declared_precision="int8")


def unknown_architecture_artifact(root: Path) -> PackResult:
    """An architecture the service does not have (-> runtime)."""
    arch = Architecture(name="ranker-transformer", version=1, params={})
    return pack_ranker(root, artifact_id="ranker-transformer", architecture=arch)


def bad_architecture_params_artifact(root: Path, **params: int | float | str | bool) -> PackResult:
    """Known architecture, unknown or out-of-range params (-> runtime)."""
    arch = Architecture(name=RANKER_MLP, version=1, params=params or {"hidden_dim": 0})
    return pack_ranker(root, artifact_id="ranker-badparams", architecture=arch)


def torch_too_new_requirement_artifact(root: Path) -> PackResult:
    """metadata.requires.torch excludes the running torch (-> runtime)."""
    return pack_ranker(root, artifact_id="ranker-torch99", metadata={"requires": {"torch": ">=99"}})


def missing_key_artifact(root: Path, key: str = "head.bias") -> PackResult:
    """-> load"""
    weights = tiny_weights()
    del weights[key]
    return pack_ranker(root, artifact_id="ranker-missing-key", weights=weights)


def unexpected_key_artifact(root: Path, key: str = "blocks.9.weight") -> PackResult:
    """-> load"""
    weights = tiny_weights()
    weights[key] = torch.zeros(2, 2)
    return pack_ranker(root, artifact_id="ranker-extra-key", weights=weights)


def wrong_shape_artifact(root: Path) -> PackResult:
    """Weights of a wider model than the architecture says (-> load)."""
    wide = dict(TINY_PARAMS, hidden_dim=TINY_PARAMS["hidden_dim"] * 2)
    arch = Architecture(name=RANKER_MLP, version=1, params=dict(TINY_PARAMS))
    return pack_ranker(
        root, artifact_id="ranker-wrong-shape", weights=tiny_weights(params=wide), architecture=arch
    )


def mislabeled_precision_artifact(root: Path) -> PackResult:
    """fp32 tensors in an artifact that claims fp16 (-> load)."""
    return pack_ranker(root, artifact_id="ranker-mislabeled", declared_precision="fp16")


def garbage_weights_artifact(root: Path) -> PackResult:
    """A weights file that is not safetensors at all (-> load)."""

    def scribble(src: Path) -> None:
        (src / WEIGHTS_FILES["safetensors"]).write_bytes(b"\x00not safetensors\xff" * 64)

    return pack_ranker(root, artifact_id="ranker-garbage", edit_source=scribble)


class _MakesDirectoryWhenUnpickled:
    """Unpickling this calls os.mkdir(marker): proof of code execution if it ever happens."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def pickle_exploit_artifact(root: Path, marker: Path) -> PackResult:
    """weights.pt whose pickle would run os.mkdir(marker) (-> load; marker never created)."""

    def plant(src: Path) -> None:
        state: dict[str, Any] = dict(tiny_weights())
        state["head.bias"] = _MakesDirectoryWhenUnpickled(marker)
        torch.save(state, src / WEIGHTS_FILES["pytorch-state-dict"])

    return pack_ranker(
        root, artifact_id="ranker-exploit", runtime="pytorch-state-dict", edit_source=plant
    )


def nan_weights_artifact(root: Path, value: float = float("nan")) -> PackResult:
    """Loads fine, produces NaN (or Inf with value=inf) scores (-> dry_run)."""
    weights = tiny_weights()
    weights["head.weight"] = torch.full_like(weights["head.weight"], value)
    return pack_ranker(root, artifact_id="ranker-nan", weights=weights)


def bad_normalization_artifact(root: Path) -> PackResult:
    """normalization.json lacks a feature of the schema (-> schema)."""

    def drop_feature(src: Path) -> None:
        path = src / NORMALIZATION_FILE
        doc = json.loads(path.read_text())
        doc["features"].pop(next(iter(doc["features"])))
        path.write_text(json.dumps(doc))

    return pack_ranker(root, artifact_id="ranker-badnorm", edit_source=drop_feature)


# --------------------------------------------------------------------------- tampering


def truncate_file(result: PackResult, rel: str, keep: int | None = None) -> None:
    """Cut a packed file short (default: to half its size) -> size."""
    path = result.out_dir / rel
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def flip_byte(result: PackResult, rel: str, offset: int = -1) -> None:
    """Flip one bit of one byte of a packed file (same size) -> digest."""
    path = result.out_dir / rel
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


__all__ = [
    "TINY_PARAMS",
    "bad_architecture_params_artifact",
    "bad_normalization_artifact",
    "fetch_verified",
    "flip_byte",
    "garbage_weights_artifact",
    "good_artifact",
    "half_artifact",
    "large_artifact",
    "mislabeled_precision_artifact",
    "missing_key_artifact",
    "nan_weights_artifact",
    "open_verified",
    "pack_ranker",
    "pickle_exploit_artifact",
    "state_dict_artifact",
    "tiny_weights",
    "torch_too_new_requirement_artifact",
    "truncate_file",
    "unexpected_key_artifact",
    "unknown_architecture_artifact",
    "unknown_precision_artifact",
    "unknown_runtime_artifact",
    "wrong_schema_artifact",
    "wrong_shape_artifact",
]
