"""The service-owned ranker architecture.

Nothing from an artifact is executed: the manifest only *names* an architecture the service
knows (``KNOWN_ARCHITECTURES``) and gives its hyper-parameters; the module is built here and
the artifact supplies nothing but tensors for it.

``ranker-mlp`` version 1 scores every candidate independently from its 80 normalised features
concatenated with one learned embedding per request-context field, through ``num_layers``
ReLU layers of width ``hidden_dim`` and a linear head giving one logit per candidate.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from app.errors import ArtifactRejected
from app.features import CONTEXT_FIELDS, NUM_FEATURES
from app.manifest import Architecture

RANKER_MLP: Final = "ranker-mlp"


@dataclass(frozen=True)
class ParamSpec:
    default: int
    low: int
    high: int


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    version: int
    params: Mapping[str, ParamSpec]
    # Oldest torch the service's build of this architecture is known to work with
    # (load_state_dict(assign=True) arrived in 2.1).
    min_torch: str


KNOWN_ARCHITECTURES: Final[Mapping[tuple[str, int], ArchitectureSpec]] = {
    (RANKER_MLP, 1): ArchitectureSpec(
        name=RANKER_MLP,
        version=1,
        params={
            # Wide enough for multi-GB GPU checks (65536^2 * 4 B = 16 GiB per layer at fp32).
            "hidden_dim": ParamSpec(default=64, low=1, high=65536),
            "num_layers": ParamSpec(default=2, low=1, high=64),
            "context_dim": ParamSpec(default=8, low=1, high=512),
        },
        min_torch="2.1",
    )
}


@dataclass(frozen=True)
class RankerParams:
    hidden_dim: int
    num_layers: int
    context_dim: int

    @property
    def input_dim(self) -> int:
        return NUM_FEATURES + len(CONTEXT_FIELDS) * self.context_dim

    @property
    def param_count(self) -> int:
        embeddings = sum(len(f.values) for f in CONTEXT_FIELDS.values()) * self.context_dim
        first = self.input_dim * self.hidden_dim + self.hidden_dim
        rest = (self.num_layers - 1) * (self.hidden_dim * self.hidden_dim + self.hidden_dim)
        head = self.hidden_dim + 1
        return embeddings + first + rest + head


def architecture_spec(arch: Architecture) -> ArchitectureSpec:
    spec = KNOWN_ARCHITECTURES.get((arch.name, arch.version))
    if spec is None:
        known = ", ".join(f"{n} v{v}" for n, v in KNOWN_ARCHITECTURES)
        raise ArtifactRejected(
            "runtime", f"unknown architecture {arch.name!r} version {arch.version} (known: {known})"
        )
    return spec


def ranker_params(arch: Architecture) -> RankerParams:
    """Validate the manifest's architecture against the table; ArtifactRejected("runtime")."""
    spec = architecture_spec(arch)
    unknown = sorted(set(arch.params) - set(spec.params))
    if unknown:
        raise ArtifactRejected(
            "runtime",
            f"architecture {spec.name} v{spec.version}: unknown params {unknown} "
            f"(known: {sorted(spec.params)})",
        )
    values: dict[str, int] = {}
    for name, ps in spec.params.items():
        value = arch.params.get(name, ps.default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArtifactRejected(
                "runtime", f"architecture param {name}: expected an integer, got {value!r}"
            )
        if not ps.low <= value <= ps.high:
            raise ArtifactRejected(
                "runtime", f"architecture param {name}={value} outside [{ps.low}, {ps.high}]"
            )
        values[name] = value
    return RankerParams(**values)


class RankerMLP(nn.Module):
    def __init__(self, params: RankerParams) -> None:
        super().__init__()
        self.params = params
        self.context_embeddings = nn.ModuleDict(
            {
                name: nn.Embedding(len(f.values), params.context_dim)
                for name, f in CONTEXT_FIELDS.items()
            }
        )
        dims = [params.input_dim] + [params.hidden_dim] * params.num_layers
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.head = nn.Linear(params.hidden_dim, 1)

    def forward(self, features: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """features: float [rows, 80] (normalised); context: int64 [rows, fields] -> [rows]."""
        parts = [features.to(self.head.weight.dtype)]
        for i, emb in enumerate(self.context_embeddings.values()):
            parts.append(emb(context[:, i]))
        h = torch.cat(parts, dim=1)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h).squeeze(-1)


def build_ranker(arch: Architecture, *, device: torch.device | str = "meta") -> RankerMLP:
    """Build the named architecture from service code. On the ``meta`` device (default) no
    memory is allocated and nothing is initialised: the loader assigns the artifact's tensors."""
    params = ranker_params(arch)
    with torch.device(device):
        return RankerMLP(params)
