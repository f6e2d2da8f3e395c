"""The ``ranker-mlp`` network: the torch half of the family (``app.model_family.Network``).

Nothing from an artifact is executed: the manifest only *names* the architecture and gives
its hyper-parameters; the module is built here and the artifact supplies nothing but tensors
for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from app.contracts import WireRequest
from app.errors import ArtifactRejected
from app.manifest import Architecture
from app.model_family import ArchitectureSpec, Families, NetworkMemory
from app.models.ranker_mlp import ARCHITECTURES, FAMILY, RANKER_MLP
from app.models.ranker_mlp.features import CONTEXT_FIELDS, NUM_FEATURES
from app.preprocessing import Normalization

__all__ = ["KNOWN_ARCHITECTURES", "NETWORK", "RANKER_MLP", "RankerMLP", "build_ranker"]

KNOWN_ARCHITECTURES: Final[Mapping[tuple[str, int], ArchitectureSpec]] = {
    (s.name, s.version): s for s in ARCHITECTURES
}
_FAMILIES: Final = Families([FAMILY])


@dataclass(frozen=True)
class RankerParams:
    hidden_dim: int
    num_layers: int
    context_dim: int
    head_layers: int = 0

    def __post_init__(self) -> None:
        if self.head_layers >= self.num_layers:
            raise ArtifactRejected(
                "runtime",
                f"architecture param head_layers={self.head_layers} must be below "
                f"num_layers={self.num_layers} (a backbone keeps the first layer)",
            )

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


def ranker_params(arch: Architecture) -> RankerParams:
    """Validate the manifest's architecture against the table; ArtifactRejected("runtime")."""
    _, spec = _FAMILIES.resolve(arch)
    return RankerParams(**spec.validate(arch))


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
        return self.head_forward(self.backbone_forward(features, context))

    def backbone_forward(self, features: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The embeddings and the blocks below the head's: [rows, hidden_dim]."""
        parts = [features.to(self.head.weight.dtype)]
        for i, emb in enumerate(self.context_embeddings.values()):
            parts.append(emb(context[:, i]))
        h = torch.cat(parts, dim=1)
        for block in self.blocks[: self.params.num_layers - self.params.head_layers]:
            h = block(h).relu_()  # in place: one activation fewer alive per layer
        return h

    def head_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The head's blocks and the output layer: [rows]."""
        for block in self.blocks[self.params.num_layers - self.params.head_layers :]:
            h = block(h).relu_()
        return self.head(h).squeeze(-1)


def build_ranker(arch: Architecture, *, device: torch.device | str = "meta") -> RankerMLP:
    """Build the named architecture from service code. On the ``meta`` device (default) no
    memory is allocated and nothing is initialised: the loader assigns the artifact's tensors."""
    params = ranker_params(arch)
    with torch.device(device):
        return RankerMLP(params)


class RankerMlpNetwork:
    """``app.model_family.Network`` of the family."""

    def build(self, params: Mapping[str, int]) -> nn.Module:
        return RankerMLP(RankerParams(**params))

    def forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["features"], batch["context"])

    def backbone_forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        assert isinstance(model, RankerMLP)
        return model.backbone_forward(batch["features"], batch["context"])

    def head_forward(self, model: nn.Module, features: torch.Tensor) -> torch.Tensor:
        assert isinstance(model, RankerMLP)
        return model.head_forward(features)

    def representative_batches(
        self, preprocessing: Any, seed: int = 20261008
    ) -> list[list[WireRequest]]:
        """Several batch sizes, dense / sparse / all-missing / extreme features, top-N
        below, at and above the candidate count, every context value."""
        norm: Normalization = preprocessing
        rng = np.random.default_rng(seed)

        def rows(n: int, missing: float = 0.0, scale: float = 1.0) -> np.ndarray:
            raw = norm.mean + norm.std * scale * rng.standard_normal((n, NUM_FEATURES))
            drop = rng.random((n, NUM_FEATURES)) < missing
            return np.where(drop, np.nan, raw).astype(np.float32)  # NaN = missing

        def request(
            tag: str, feats: np.ndarray, top_n: int, ctx: dict[str, str | int] | None = None
        ) -> WireRequest:
            ids = tuple(f"{tag}-{i}" for i in range(len(feats)))
            return WireRequest(ids, feats, dict(ctx or {}), top_n)

        all_missing = np.full((3, NUM_FEATURES), np.nan, dtype=np.float32)
        single = [request("single", rows(1), 1)]
        mixed = [
            request("one", rows(1), 5, {"surface": "search"}),
            request(
                "sparse", rows(7, missing=0.7), 3, {"hour_of_day": 23, "device_class": "tablet"}
            ),
            request("extreme", rows(33, scale=1e6), 33, {"locale_bucket": "ja"}),
            request("dense", rows(64), 100),
            request(
                "empty",
                np.concatenate([all_missing, rows(2, missing=0.95)]),
                4,
                {"surface": "email"},
            ),
        ]
        widest = max(len(f.values) for f in CONTEXT_FIELDS.values())
        every_context = [
            request(
                f"ctx{j}",
                rows(16, missing=0.1),
                10,
                {name: f.values[j % len(f.values)] for name, f in CONTEXT_FIELDS.items()},
            )
            for j in range(widest)
        ]
        return [single, mixed, every_context]

    def check_invariants(
        self,
        score: Callable[[Sequence[WireRequest]], list[np.ndarray]],
        batch: Sequence[WireRequest],
        scores: Sequence[np.ndarray],
        tol: float,
    ) -> None:
        """None beyond the service's: each candidate is scored on its own features and
        the request's context, which batch invariance already covers."""

    def memory(self, params: Mapping[str, int]) -> NetworkMemory:
        p = RankerParams(**params)
        widest = max(p.input_dim, p.hidden_dim)
        return NetworkMemory(
            param_count=p.param_count,
            largest_tensor=max(p.input_dim, p.hidden_dim) * p.hidden_dim,
            workspace_per_row=p.input_dim + 3 * widest,
        )


NETWORK: Final = RankerMlpNetwork()
