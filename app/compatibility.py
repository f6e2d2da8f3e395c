"""Can this service run an artifact at all? What its manifest says, checked without loading a
weight: runtime, precision, architecture (its family and version), feature schema, the torch
range it asks for, the files its runtime and family need.

Kept apart from app.loading so that what reads only manifests (``rollout verify`` without
``--load``, ``rollout registry register``) never imports torch: that import is about two
seconds of every such command on a small machine, and most of a CLI call's time. The running
torch's version is read from the installed distribution, which is what ``torch.__version__``
reports (``2.13.0+cpu``, ``2.13.0+cu130``).
"""

from __future__ import annotations

import importlib.metadata
from functools import cache
from typing import Any, Final

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from app.errors import ArtifactRejected
from app.manifest import Manifest
from app.model_family import SHIPPED_FAMILIES, Families, ModelFamily, families_for
from app.preprocessing import LABEL_MAPPING_FILE

WEIGHTS_FILES: Final = {"safetensors": "weights.safetensors", "pytorch-state-dict": "weights.pt"}
# The precisions an artifact may store its weights in (app.loading maps them to torch dtypes).
PRECISION_NAMES: Final = ("fp32", "fp16", "bf16")
# manifest.metadata["requires"]["torch"]: a PEP 440 specifier such as ">=2.10,<3".
TORCH_REQUIREMENT_KEY: Final = ("requires", "torch")


@cache
def installed_torch_version() -> str:
    """The torch this process would import, e.g. ``2.13.0+cpu``, without importing it (where
    no distribution metadata names it, as in a source build on the path, by importing it)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return str(torch.__version__)


def torch_requirement(manifest: Manifest) -> str | None:
    node: Any = manifest.metadata
    for key in TORCH_REQUIREMENT_KEY:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if not isinstance(node, str):
        raise ArtifactRejected("runtime", f"metadata.requires.torch must be a string, got {node!r}")
    return node


def check_compatibility(
    manifest: Manifest, families: Families | None = None, torch_version: str | None = None
) -> ModelFamily:
    """Can this service run the artifact at all? Its family (of ``families``, default every
    family the service ships); ArtifactRejected ``runtime`` / ``schema``. ``torch_version``:
    the running torch's (default: the installed one)."""
    aid = manifest.artifact_id
    families = families or families_for(SHIPPED_FAMILIES)
    torch_version = torch_version or installed_torch_version()
    if manifest.runtime not in WEIGHTS_FILES:
        raise ArtifactRejected(
            "runtime",
            f"unknown runtime {manifest.runtime!r} (supported: {sorted(WEIGHTS_FILES)})",
            artifact_id=aid,
        )
    if manifest.precision not in PRECISION_NAMES:
        raise ArtifactRejected(
            "runtime",
            f"unknown precision {manifest.precision!r} (supported: {sorted(PRECISION_NAMES)})",
            artifact_id=aid,
        )
    try:
        family, spec = families.resolve(manifest.architecture)
        spec.validate(manifest.architecture)
        if manifest.feature_schema != family.schema.name:
            raise ArtifactRejected(
                "schema",
                f"feature schema {manifest.feature_schema!r}; architecture {spec.name} "
                f"(family {family.name}) reads {family.schema.name!r}",
            )
        running = Version(torch_version)
        if running.release < Version(spec.min_torch).release:
            raise ArtifactRejected(
                "runtime", f"{spec.name} v{spec.version} needs torch >= {spec.min_torch}"
            )
        requirement = torch_requirement(manifest)
        if requirement is not None:
            try:
                allowed = SpecifierSet(requirement)
            except InvalidSpecifier:
                raise ArtifactRejected(
                    "runtime", f"metadata.requires.torch {requirement!r} is not a version range"
                ) from None
            # Compare the public version: a "+cu130" build satisfies ">=2.10" like "+cpu" does.
            if not allowed.contains(running.public, prereleases=True):
                raise ArtifactRejected(
                    "runtime", f"artifact requires torch {requirement}, this is {torch_version}"
                )
    except ArtifactRejected as exc:
        raise ArtifactRejected(exc.category, exc.detail, artifact_id=aid) from None
    except InvalidVersion as exc:  # a local torch build with an odd version string
        raise ArtifactRejected(
            "runtime", f"cannot read torch version: {exc}", artifact_id=aid
        ) from None
    if manifest.kind != "model" and not family.splits:
        raise ArtifactRejected(
            "runtime",
            f"family {family.name} loads whole models only: it has no head to split off "
            f"(artifact kind {manifest.kind})",
            artifact_id=aid,
        )
    listed = {f.path for f in manifest.files}
    if manifest.kind == "backbone":
        # Never served alone: the preprocessing and score bands are its heads'.
        if WEIGHTS_FILES[manifest.runtime] not in listed:
            raise ArtifactRejected(
                "schema",
                f"runtime {manifest.runtime} needs {WEIGHTS_FILES[manifest.runtime]!r} in the "
                "artifact",
                artifact_id=aid,
            )
        return family
    for needed in (WEIGHTS_FILES[manifest.runtime], LABEL_MAPPING_FILE):
        if needed not in listed:
            raise ArtifactRejected(
                "schema",
                f"runtime {manifest.runtime} needs {needed!r} in the artifact",
                artifact_id=aid,
            )
    for needed in family.schema.preprocessing_files:
        if needed not in listed:
            raise ArtifactRejected(
                "schema",
                f"feature schema {family.schema.name} needs {needed!r} in the artifact",
                artifact_id=aid,
            )
    return family


def check_model(manifest: Manifest, model: str, setting: str) -> None:
    """The manifest is for ``model``, the model the caller serves or registers under
    (``setting`` names where that comes from, for the message: ``--model``,
    ``loading.model``). ArtifactRejected ``schema`` otherwise."""
    if manifest.model != model:
        raise ArtifactRejected(
            "schema",
            f"manifest is for model {manifest.model!r}; {model!r} is served here ({setting})",
            artifact_id=manifest.artifact_id,
        )


def check_servable(
    manifest: Manifest, model: str, setting: str, families: Families | None = None
) -> ModelFamily:
    """The one answer to "could this service serve this manifest as ``model``", from the
    manifest alone: its model (``check_model``) and everything ``check_compatibility`` reads.
    ``rollout verify`` and ``rollout registry register`` ask it; a replica asks the same two
    checks with its own families (``app.loading.candidate``)."""
    check_model(manifest, model, setting)
    return check_compatibility(manifest, families)
