"""The ``two-tower`` model family: a user/context tower and an item tower, each an MLP to an
``embed_dim`` embedding, feed a scoring head over their element-wise product; one logit per
item. The user tower runs once per request, the item tower once per item.

It ships with the service to prove the plug-in interface (``app.model_family``) with a
model of another shape and another request schema (``two-tower-features-v1``). This module
is the torch-free declaration; the network is ``app.models.two_tower.network``.
"""

from __future__ import annotations

from typing import Final

from app.model_family import ArchitectureSpec, ModelFamily, ParamSpec
from app.models.two_tower.features import SCHEMA
from app.tasks import RANK

TWO_TOWER: Final = "two-tower"

ARCHITECTURES: Final = (
    ArchitectureSpec(
        name=TWO_TOWER,
        version=1,
        params={
            "hidden_dim": ParamSpec(default=64, low=1, high=16384),
            "tower_layers": ParamSpec(default=2, low=1, high=16),
            "embed_dim": ParamSpec(default=32, low=1, high=4096),
            "context_dim": ParamSpec(default=8, low=1, high=512),
        },
        min_torch="2.1",
    ),
)

FAMILY: Final = ModelFamily(
    name=TWO_TOWER,
    architectures=ARCHITECTURES,
    schema=SCHEMA,
    task=RANK,
    network_path="app.models.two_tower.network:NETWORK",
    # The scoring layer: a head artifact retrains it over a resident backbone.
    head=lambda params: ("head.",),
)
