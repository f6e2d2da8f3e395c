"""Deterministic ranker artifacts for the demo, the tests and the GPU checks.

``write_ranker_source`` writes a pack-able source directory (weights, normalization, label
mapping, architecture, metadata with an offline evaluation block) from a seed: the same seed
and parameters give the same bytes, so packing twice gives the same manifest digest.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import safetensors.torch
import torch

from app.artifact_store import manifest_uri_for
from app.errors import ConfigError
from app.features import (
    FEATURE_NAMES,
    FEATURE_SCHEMA,
    LABEL_MAPPING_FILE,
    NORMALIZATION_FILE,
)
from app.loader import PRECISIONS, WEIGHTS_FILES
from app.manifest import MANIFEST_NAME, Architecture
from app.packing import ARCHITECTURE_FILE, METADATA_FILE, PackResult, pack_artifact
from app.ranker import RANKER_MLP, build_ranker

DEMO_MODEL: Final = "ranker"
# Small enough to load and dry-run in a few milliseconds on a CPU.
DEMO_PARAMS: Final[Mapping[str, int]] = {"hidden_dim": 128, "num_layers": 3, "context_dim": 8}
SCORE_BANDS: Final = (("poor", 0.0), ("fair", 0.25), ("good", 0.5), ("excellent", 0.8))
TORCH_REQUIREMENT: Final = ">=2.4"
# The hot standby's model: half the width, one layer less; its offline ndcg@10 within 5% of
# ranker-v41's (the default accuracy margin of the router's fallback guard).
FALLBACK_PARAMS: Final[Mapping[str, int]] = {"hidden_dim": 64, "num_layers": 2, "context_dim": 8}
DEMO_FALLBACK: Final = "ranker-lite-v1"
# (artifact_id, seed, architecture params, offline evaluation)
DEMO_VERSIONS: Final = (
    ("ranker-v41", 41, DEMO_PARAMS, {"ndcg_at_10": 0.412, "auc": 0.781}),
    ("ranker-v42", 42, DEMO_PARAMS, {"ndcg_at_10": 0.419, "auc": 0.786}),
    (DEMO_FALLBACK, 7, FALLBACK_PARAMS, {"ndcg_at_10": 0.401, "auc": 0.772}),
)


def _dump(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def ranker_weights(
    arch: Architecture, *, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """He-initialised weights for ``arch`` from numpy's PCG64 (stable across torch versions)."""
    rng = np.random.default_rng(seed)
    shapes = build_ranker(arch, device="meta").state_dict()
    state: dict[str, torch.Tensor] = {}
    for key in sorted(shapes):
        shape = tuple(shapes[key].shape)
        if key.startswith("context_embeddings."):
            std = 0.5
        elif key.endswith(".weight"):
            std = float(np.sqrt(2.0 / shape[1]))
        else:  # biases
            std = 0.01
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        state[key] = torch.from_numpy(values).to(dtype)
    return state


def normalization_doc(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, 1])
    features = {}
    for name in FEATURE_NAMES:
        mean = round(float(rng.uniform(-2.0, 50.0)), 4)
        features[name] = {
            "mean": mean,
            "std": round(float(rng.uniform(0.5, 20.0)), 4),
            "fill": mean,  # impute the training mean for a missing feature
        }
    return {"feature_schema": FEATURE_SCHEMA, "clip": 8.0, "features": features}


def label_mapping_doc() -> dict[str, Any]:
    return {
        "feature_schema": FEATURE_SCHEMA,
        "score_bands": [{"label": label, "min_score": lo} for label, lo in SCORE_BANDS],
    }


def write_ranker_source(
    src_dir: Path,
    *,
    seed: int,
    params: Mapping[str, int] | None = None,
    precision: str = "fp32",
    runtime: str = "safetensors",
    evaluation: Mapping[str, Any] | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write a source directory for ``pack_artifact``. ``weights`` overrides the generated
    tensors (tests build broken artifacts that way); they are written as given."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision: {precision!r} is not one of {sorted(PRECISIONS)}")
    if runtime not in WEIGHTS_FILES:
        raise ConfigError(f"runtime: {runtime!r} is not one of {sorted(WEIGHTS_FILES)}")
    src_dir = Path(src_dir)
    src_dir.mkdir(parents=True, exist_ok=True)
    arch = Architecture(name=RANKER_MLP, version=1, params=dict(params or DEMO_PARAMS))
    state = (
        dict(weights)
        if weights is not None
        else ranker_weights(arch, seed=seed, dtype=PRECISIONS[precision])
    )
    weights_path = src_dir / WEIGHTS_FILES[runtime]
    if runtime == "safetensors":
        weights_path.write_bytes(safetensors.torch.save(state))
    else:
        torch.save(state, weights_path)
    _dump(src_dir / NORMALIZATION_FILE, normalization_doc(seed))
    _dump(src_dir / LABEL_MAPPING_FILE, label_mapping_doc())
    _dump(src_dir / ARCHITECTURE_FILE, arch.model_dump(mode="json"))
    _dump(
        src_dir / METADATA_FILE,
        {
            "offline_evaluation": {
                "dataset": "ranker-offline-holdout",
                "examples": 200_000,
                **(evaluation or {}),
            },
            "training": {"seed": seed},
            "requires": {"torch": TORCH_REQUIREMENT},
        },
    )


def make_demo_artifacts(out_dir: Path) -> list[PackResult]:
    """Pack ranker-v41, ranker-v42 and the fallback's ranker-lite-v1 under ``out_dir``.
    Idempotent: an artifact already there with the same manifest is kept; a different one is
    an error (artifacts are immutable)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for artifact_id, seed, params, evaluation in DEMO_VERSIONS:
        final = out_dir / artifact_id
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{artifact_id}.") as tmp:
            src, staged = Path(tmp) / "src", Path(tmp) / "out"
            write_ranker_source(src, seed=seed, params=params, evaluation=evaluation)
            packed = pack_artifact(
                src,
                staged,
                model=DEMO_MODEL,
                artifact_id=artifact_id,
                feature_schema=FEATURE_SCHEMA,
            )
            if (final / MANIFEST_NAME).exists():
                if (final / MANIFEST_NAME).read_bytes() != (staged / MANIFEST_NAME).read_bytes():
                    raise ConfigError(f"out_dir: {final} holds a different {artifact_id}")
            elif final.exists():
                raise ConfigError(f"out_dir: {final} exists but holds no {MANIFEST_NAME}")
            else:
                staged.rename(final)
        results.append(
            PackResult(
                artifact_id=artifact_id,
                out_dir=final.resolve(),
                manifest_uri=manifest_uri_for(final),
                manifest_sha256=packed.manifest_sha256,
            )
        )
    return results
