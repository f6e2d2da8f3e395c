"""The ``two-tower`` network: the torch half of the family (``app.model_family.Network``)."""

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
from app.model_family import NetworkMemory
from app.models.two_tower.features import (
    CONTEXT,
    NUM_ITEM_FEATURES,
    NUM_USER_FEATURES,
    TwoTowerPreprocessing,
)


@dataclass(frozen=True)
class TwoTowerParams:
    hidden_dim: int
    tower_layers: int
    embed_dim: int
    context_dim: int

    @property
    def user_input(self) -> int:
        return NUM_USER_FEATURES + len(CONTEXT.fields) * self.context_dim

    def tower_params(self, inputs: int) -> int:
        dims = [inputs] + [self.hidden_dim] * self.tower_layers + [self.embed_dim]
        return sum(a * b + b for a, b in itertools.pairwise(dims))

    @property
    def param_count(self) -> int:
        embeddings = sum(CONTEXT.cardinalities()) * self.context_dim
        return (
            embeddings
            + self.tower_params(self.user_input)
            + self.tower_params(NUM_ITEM_FEATURES)
            + self.embed_dim
            + 1
        )


def _tower(inputs: int, p: TwoTowerParams) -> nn.Sequential:
    dims = [inputs] + [p.hidden_dim] * p.tower_layers
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(p.hidden_dim, p.embed_dim))
    return nn.Sequential(*layers)


class TwoTower(nn.Module):
    def __init__(self, params: TwoTowerParams) -> None:
        super().__init__()
        self.params = params
        self.context_embeddings = nn.ModuleDict(
            {
                name: nn.Embedding(len(f.values), params.context_dim)
                for name, f in CONTEXT.fields.items()
            }
        )
        self.user_tower = _tower(params.user_input, params)
        self.item_tower = _tower(NUM_ITEM_FEATURES, params)
        self.head = nn.Linear(params.embed_dim, 1)

    def forward(
        self,
        query: torch.Tensor,
        context: torch.Tensor,
        features: torch.Tensor,
        request_index: torch.Tensor,
    ) -> torch.Tensor:
        """query: float [requests, 16]; context: int64 [requests, fields]; features: float
        [rows, 24]; request_index: int64 [rows] -> one logit per row."""
        return self.head_forward(self.backbone_forward(query, context, features, request_index))

    def backbone_forward(
        self,
        query: torch.Tensor,
        context: torch.Tensor,
        features: torch.Tensor,
        request_index: torch.Tensor,
    ) -> torch.Tensor:
        """The towers: each row's user embedding times its item's, [rows, embed_dim]."""
        dtype = self.head.weight.dtype
        parts = [query.to(dtype)]
        for i, emb in enumerate(self.context_embeddings.values()):
            parts.append(emb(context[:, i]))
        user = self.user_tower(torch.cat(parts, dim=1))  # once per request
        items = self.item_tower(features.to(dtype))  # once per item
        return user[request_index] * items

    def head_forward(self, product: torch.Tensor) -> torch.Tensor:
        return self.head(product).squeeze(-1)


class TwoTowerNetwork:
    def build(self, params: Mapping[str, int]) -> nn.Module:
        return TwoTower(TwoTowerParams(**params))

    def forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["query"], batch["context"], batch["features"], batch["request_index"])

    def backbone_forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        assert isinstance(model, TwoTower)
        return model.backbone_forward(
            batch["query"], batch["context"], batch["features"], batch["request_index"]
        )

    def head_forward(self, model: nn.Module, features: torch.Tensor) -> torch.Tensor:
        assert isinstance(model, TwoTower)
        return model.head_forward(features)

    def representative_batches(
        self, preprocessing: Any, seed: int = 20261201
    ) -> list[list[WireRequest]]:
        """One item, many items, sparse and all-missing users and items, extreme values,
        top-N below, at and above the item count, every context value."""
        pre: TwoTowerPreprocessing = preprocessing
        rng = np.random.default_rng(seed)

        def values(norm: Any, shape: tuple[int, ...], missing: float, scale: float) -> np.ndarray:
            raw = norm.mean + norm.std * scale * rng.standard_normal(shape)
            return np.where(rng.random(shape) < missing, np.nan, raw).astype(np.float32)

        def request(
            tag: str,
            items: int,
            top_n: int,
            ctx: dict[str, str | int] | None = None,
            missing: float = 0.0,
            scale: float = 1.0,
        ) -> WireRequest:
            query = values(pre.user, (NUM_USER_FEATURES,), missing, scale)
            feats = values(pre.item, (items, NUM_ITEM_FEATURES), missing, scale)
            ids = tuple(f"{tag}-{i}" for i in range(items))
            return WireRequest(ids, feats, dict(ctx or {}), top_n, query)

        single = [request("single", 1, 1)]
        mixed = [
            request("few", 3, 5, {"surface": "search"}),
            request("sparse", 9, 4, {"device_class": "tv"}, missing=0.7),
            request("empty", 4, 4, {"surface": "notification"}, missing=1.0),
            request("extreme", 17, 17, scale=1e6),
            request("wide", 64, 100),
        ]
        widest = max(CONTEXT.cardinalities())
        every_context = [
            request(
                f"ctx{j}",
                12,
                6,
                {name: f.values[j % len(f.values)] for name, f in CONTEXT.fields.items()},
                missing=0.1,
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
        """An item's score depends on the user and on that item alone: the items of a
        request in reverse order score the same, reversed (a model that mixes items, e.g.
        a normalisation over the batch, fails)."""
        for req, got in zip(batch, scores, strict=True):
            if len(req.candidate_ids) < 2:
                continue
            flipped = req._replace(
                candidate_ids=req.candidate_ids[::-1], features=req.features[::-1].copy()
            )
            (again,) = score([flipped])
            diff = float(np.max(np.abs(again[::-1] - got)))
            if not diff <= tol:
                raise ArtifactRejected(
                    "dry_run",
                    f"item scores change by {diff:.3g} with the items' order (tol {tol})",
                )
            return  # one request per batch is enough to catch a mixing model

    def memory(self, params: Mapping[str, int]) -> NetworkMemory:
        p = TwoTowerParams(**params)
        widest = max(p.user_input, NUM_ITEM_FEATURES, p.hidden_dim, p.embed_dim)
        return NetworkMemory(
            param_count=p.param_count,
            largest_tensor=widest * max(p.hidden_dim, p.embed_dim),
            workspace_per_row=NUM_ITEM_FEATURES + 2 * p.hidden_dim + 2 * p.embed_dim + widest,
        )


NETWORK: Final = TwoTowerNetwork()
