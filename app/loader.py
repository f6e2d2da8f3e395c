"""Moved to the app.loading package (device, formats, model, backbones, candidate); this path
is kept for one release."""

from app.compatibility import WEIGHTS_FILES, check_compatibility
from app.loading.backbones import (
    DRY_RUN_FEATURE_CACHE_BYTES,
    BackboneFreed,
    BackboneSource,
    ResidentBackbone,
)
from app.loading.candidate import (
    CandidateLoad,
    load_backbone,
    load_verified,
)
from app.loading.device import (
    PRECISIONS,
    compute_dtype_for,
    default_device,
    runtime_build,
)
from app.loading.formats import (
    CHUNK_BYTES,
    MAX_SAFETENSORS_HEADER_BYTES,
    MAX_ZIP_RECORDS,
    READ_BUFFERS,
    SAFETENSORS_DIMENSION_ALLOWANCE,
    SAFETENSORS_DTYPES,
    SAFETENSORS_ENTRY_ALLOWANCE,
    SAFETENSORS_METADATA_ALLOWANCE,
    SAFETENSORS_PARSE_BYTES_PER_BYTE,
    ZIP_FLAG_ENCRYPTED,
    ZIP_LOCAL_HEADER_BYTES,
    ZIP_LOCAL_HEADER_SIGNATURE,
    SafetensorsAssembler,
    Shapes,
    artifact_shapes,
    check_state,
    deserialize_torch,
    safetensors_header_limit,
)
from app.loading.model import (
    BATCH_INVARIANCE_ATOL,
    DRY_RUN_MAX_ROWS,
    LoadedModel,
)

__all__ = [
    "BATCH_INVARIANCE_ATOL",
    "CHUNK_BYTES",
    "DRY_RUN_FEATURE_CACHE_BYTES",
    "DRY_RUN_MAX_ROWS",
    "MAX_SAFETENSORS_HEADER_BYTES",
    "MAX_ZIP_RECORDS",
    "PRECISIONS",
    "READ_BUFFERS",
    "SAFETENSORS_DIMENSION_ALLOWANCE",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_ENTRY_ALLOWANCE",
    "SAFETENSORS_METADATA_ALLOWANCE",
    "SAFETENSORS_PARSE_BYTES_PER_BYTE",
    "WEIGHTS_FILES",
    "ZIP_FLAG_ENCRYPTED",
    "ZIP_LOCAL_HEADER_BYTES",
    "ZIP_LOCAL_HEADER_SIGNATURE",
    "BackboneFreed",
    "BackboneSource",
    "CandidateLoad",
    "LoadedModel",
    "ResidentBackbone",
    "SafetensorsAssembler",
    "Shapes",
    "artifact_shapes",
    "check_compatibility",
    "check_state",
    "compute_dtype_for",
    "default_device",
    "deserialize_torch",
    "load_backbone",
    "load_verified",
    "runtime_build",
    "safetensors_header_limit",
]
