"""The ``ranker-mlp`` model family (the service's default): every candidate scored on its own
from its 80 normalised features (``ranker-features-v3``) and one learned embedding per
request-context field, through ``num_layers`` ReLU layers of width ``hidden_dim`` and a
linear head giving one logit per candidate.

This module is the family's torch-free declaration (``app.model_family.ModelFamily``); the
network is ``app.models.ranker_mlp.network``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from app.model_family import ArchitectureSpec, ModelFamily, ParamSpec
from app.models.ranker_mlp.features import SCHEMA
from app.tasks import RANK

RANKER_MLP: Final = "ranker-mlp"

ARCHITECTURES: Final = (
    ArchitectureSpec(
        name=RANKER_MLP,
        version=1,
        params={
            # Wide enough for multi-GB GPU checks (65536^2 * 4 B = 16 GiB per layer at fp32).
            "hidden_dim": ParamSpec(default=64, low=1, high=65536),
            "num_layers": ParamSpec(default=2, low=1, high=256),
            "context_dim": ParamSpec(default=8, low=1, high=512),
            # Of the layers, how many top ones belong to the head (a backbone + head
            # artifact pair fine-tuned above a frozen bottom); 0: the output layer alone.
            # Below num_layers. A whole model's tensors are the same either way.
            "head_layers": ParamSpec(default=0, low=0, high=255),
        },
        # load_state_dict(assign=True) arrived in 2.1.
        min_torch="2.1",
    ),
)


def _head(params: Mapping[str, int]) -> tuple[str, ...]:
    """The output layer and the top ``head_layers`` blocks."""
    layers, top = params["num_layers"], params["head_layers"]
    return (*(f"blocks.{i}." for i in range(layers - top, layers)), "head.")


FAMILY: Final = ModelFamily(
    name=RANKER_MLP,
    architectures=ARCHITECTURES,
    schema=SCHEMA,
    task=RANK,
    network_path="app.models.ranker_mlp.network:NETWORK",
    # The scoring layer: a head artifact retrains it over a resident backbone.
    head=_head,
)
