"""Where a model runs and in what precision: the device a replica uses, the runtime build it
reports, the dtype it computes in."""

from __future__ import annotations

from typing import Final

import torch

from app.compatibility import PRECISION_NAMES

PRECISIONS: Final = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


assert tuple(PRECISIONS) == PRECISION_NAMES


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def runtime_build() -> str:
    """e.g. ``torch-2.13.0+cpu`` or ``torch-2.13.0+cu130`` (the wheel's local version)."""
    return f"torch-{torch.__version__}"


def compute_dtype_for(precision: str, device: torch.device) -> torch.dtype:
    stored = PRECISIONS[precision]
    if device.type == "cpu":
        # Half-precision matmul on CPU is emulated or missing on most x86 parts and is several
        # times slower than fp32 where it exists; upcasting the weights is exact. Reports keep
        # the artifact's precision; compute_dtype says what actually runs.
        return torch.float32
    if stored is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float32
    return stored
