"""The ``two-tower-features-v1`` request contract of the ``two-tower`` family.

Torch-free (pydantic and numpy): the router holds it. A request carries one user (16 numeric
features) with a small categorical context, and the items to rank (24 numeric features
each)::

    {"user_id": "u-1", "user": {"features": [...16]}, "context": {"surface": "feed"},
     "items": [{"id": "sku-1", "features": [...24]}, ...], "top_n": 10}

It reaches the model as an ``app.contracts.WireRequest`` whose ``query`` is the user's
features and ``features`` the items' (NaN where a value is missing). The artifact's
``normalization.json`` names all 40 features, the user's first.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from app.api import (
    DEFAULT_TOP_N,
    MAX_CANDIDATE_ID_CHARS,
    MAX_CANDIDATES,
    ContextValue,
    Feature,
    parse_body,
)
from app.model_family import EncodedBatch, ParsedRequest
from app.preprocessing import (
    NORMALIZATION_FILE,
    ContextField,
    ContextSpec,
    Normalization,
    candidate_offsets,
    stack_features,
)
from app.tasks.rank import RankTensors

if TYPE_CHECKING:
    from app.contracts import WireRequest

FEATURE_SCHEMA: Final = "two-tower-features-v1"

USER_FEATURE_NAMES: Final[tuple[str, ...]] = tuple(
    f"user_{m}_{w}"
    for m in ("sessions", "clicks", "purchases", "dwell_s")
    for w in ("1d", "7d", "28d", "90d")
)
ITEM_FEATURE_NAMES: Final[tuple[str, ...]] = (
    *tuple(
        f"item_{m}_{w}"
        for m in ("impressions", "clicks", "ctr", "purchases", "cvr", "returns")
        for w in ("1d", "7d", "28d")
    ),
    "item_price_log",
    "item_age_days",
    "item_rating",
    "item_rating_count_log",
    "item_stock_level",
    "item_discount_pct",
)
NUM_USER_FEATURES: Final = 16
NUM_ITEM_FEATURES: Final = 24
assert len(set(USER_FEATURE_NAMES)) == NUM_USER_FEATURES
assert len(set(ITEM_FEATURE_NAMES)) == NUM_ITEM_FEATURES

CONTEXT: Final = ContextSpec(
    (
        ContextField("surface", str, ("feed", "search", "related", "notification"), "feed"),
        ContextField("device_class", str, ("desktop", "mobile", "tablet", "tv"), "mobile"),
    )
)


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    features: Annotated[
        list[Feature | None],
        Field(min_length=NUM_USER_FEATURES, max_length=NUM_USER_FEATURES),
    ]


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: Annotated[str, Field(min_length=1, max_length=MAX_CANDIDATE_ID_CHARS)]
    features: Annotated[
        list[Feature | None],
        Field(min_length=NUM_ITEM_FEATURES, max_length=NUM_ITEM_FEATURES),
    ]


class TwoTowerBody(BaseModel):
    """``POST /v1/rank`` of an app serving this schema. ``null``: a missing feature."""

    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: Annotated[str, Field(max_length=256)] | None = None
    session_id: Annotated[str, Field(max_length=256)] | None = None
    user: UserIn
    context: dict[str, ContextValue] = Field(default_factory=dict)
    items: Annotated[list[ItemIn], Field(min_length=1, max_length=MAX_CANDIDATES)]
    top_n: Annotated[int, Field(ge=1, le=MAX_CANDIDATES)] = DEFAULT_TOP_N
    _query: np.ndarray = PrivateAttr()
    _features: np.ndarray = PrivateAttr()

    @field_validator("context", mode="before")
    @classmethod
    def _known_context(cls, value: Any) -> Any:
        return CONTEXT.check(value)

    @model_validator(mode="after")
    def _unique_ids(self) -> TwoTowerBody:
        seen: set[str] = set()
        for i, item in enumerate(self.items):
            if item.id in seen:
                raise ValueError(f"items[{i}].id: duplicate id {item.id!r}")
            seen.add(item.id)
        self._query = np.asarray(self.user.features, dtype=np.float32)
        self._features = np.asarray([it.features for it in self.items], dtype=np.float32)
        return self


@dataclass(frozen=True, eq=False)
class TwoTowerPreprocessing:
    user: Normalization
    item: Normalization


class TwoTowerFeaturesV1:
    """The family's ``app.model_family.RequestSchema``."""

    name = FEATURE_SCHEMA
    preprocessing_files = (NORMALIZATION_FILE,)
    oip = RankTensors(
        item_list="items",
        item_width=NUM_ITEM_FEATURES,
        context=CONTEXT,
        query=("user_features", "user", NUM_USER_FEATURES),
    )

    def parse(self, raw: bytes) -> ParsedRequest:
        from app.contracts import WireRequest

        body = parse_body(raw, TwoTowerBody)
        ids = tuple(it.id for it in body.items)
        wire = WireRequest(ids, body._features, body.context, body.top_n, body._query)
        return ParsedRequest(wire, body.user_id, body.session_id)

    def preprocessing(self, files: Mapping[str, bytes]) -> TwoTowerPreprocessing:
        norm = Normalization.from_json(
            files[NORMALIZATION_FILE], USER_FEATURE_NAMES + ITEM_FEATURE_NAMES, FEATURE_SCHEMA
        )
        return TwoTowerPreprocessing(
            user=norm.part(0, NUM_USER_FEATURES),
            item=norm.part(NUM_USER_FEATURES, NUM_USER_FEATURES + NUM_ITEM_FEATURES),
        )

    def encode(self, requests: Sequence[WireRequest], preprocessing: Any) -> EncodedBatch:
        """One user row per request (the user tower runs once per request, not once per
        item): ``query`` float32 [requests, 16], ``context`` int64 [requests, fields];
        ``features`` float32 [rows, 24] and ``request_index`` int64 [rows], the request
        each item row belongs to."""
        pre: TwoTowerPreprocessing = preprocessing
        counts, offsets = candidate_offsets(requests)
        query = np.empty((len(requests), NUM_USER_FEATURES), dtype=np.float32)
        for i, req in enumerate(requests):
            assert req.query is not None  # a validated request of this schema has one
            query[i] = req.query
        return EncodedBatch(
            {
                "query": pre.user.apply(query),
                "context": np.asarray([CONTEXT.encode(r.context) for r in requests], np.int64),
                "features": pre.item.apply(stack_features(requests, offsets, NUM_ITEM_FEATURES)),
                "request_index": np.repeat(np.arange(len(requests), dtype=np.int64), counts),
            },
            offsets,
        )

    def synthetic_bodies(
        self, count: int, *, seed: int, candidates: int, top_n: int
    ) -> Iterator[dict[str, Any]]:
        """Body ``i`` ranks items ``sku-i-j`` for one user; features from N(0, 1) rounded to
        4 decimals, one item feature missing on every fifth item, one random value per
        context field."""
        rng = random.Random(seed)
        for i in range(count):
            user = [round(rng.gauss(0, 1), 4) for _ in range(NUM_USER_FEATURES)]
            items = []
            for j in range(candidates):
                features: list[float | None] = [
                    round(rng.gauss(0, 1), 4) for _ in range(NUM_ITEM_FEATURES)
                ]
                if j % 5 == 0:
                    features[rng.randrange(NUM_ITEM_FEATURES)] = None
                items.append({"id": f"sku-{i}-{j}", "features": features})
            context = {name: rng.choice(f.values) for name, f in CONTEXT.fields.items()}
            yield {"user": {"features": user}, "context": context, "items": items, "top_n": top_n}


SCHEMA: Final = TwoTowerFeaturesV1()
