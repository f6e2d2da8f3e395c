"""The ``ranker-features-v3`` request contract of the ``ranker-mlp`` family: feature names,
request context, the HTTP body, its preprocessing, and the synthetic bodies of the live load.

Torch-free (pydantic and numpy): the router holds it. A request carries candidates, each with
80 numeric features, plus a small typed request context; it is validated once, at the HTTP
edge, and reaches the model as an ``app.contracts.WireRequest``: the candidates' features as
one float32 matrix, NaN where a feature is missing. The artifact's ``normalization.json``
(per-feature mean/std/fill) is parsed and checked here, so a generation carries the exact
preprocessing its weights were trained with.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
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

FEATURE_SCHEMA: Final = "ranker-features-v3"
# Every this-many candidates (the first, the eighth, ...) of a synthetic body lacks one
# feature: sparse inputs happen.
SPARSE_EVERY: Final = 7


def _windowed(prefix: str, measures: Sequence[str], windows: Sequence[str]) -> list[str]:
    return [f"{prefix}_{m}_{w}" for m in measures for w in windows]


FEATURE_NAMES: Final[tuple[str, ...]] = tuple(
    # Item engagement over three windows (24).
    _windowed(
        "item",
        ("impressions", "clicks", "ctr", "add_to_cart", "purchases", "cvr", "dwell_s", "skips"),
        ("1d", "7d", "28d"),
    )
    # User activity over three windows (18).
    + _windowed(
        "user",
        ("sessions", "clicks", "ctr", "purchases", "cvr", "avg_dwell_s"),
        ("1d", "7d", "28d"),
    )
    # User-item affinities (8).
    + _windowed("affinity", ("category", "brand", "price_band", "seller"), ("7d", "28d"))
    # Static item attributes (10).
    + [
        "item_price_log",
        "item_age_days",
        "item_rating",
        "item_rating_count_log",
        "item_stock_level",
        "item_discount_pct",
        "item_image_count",
        "item_title_len",
        "item_description_len",
        "item_return_rate",
    ]
    # Query / retrieval signals (10).
    + [
        "retrieval_score_bm25",
        "retrieval_score_embedding",
        "retrieval_score_collab",
        "retrieval_score_popularity",
        "query_item_title_match",
        "query_item_category_match",
        "query_item_brand_match",
        "retrieval_rank",
        "query_length",
        "query_freq_log",
    ]
    # Seller, freshness and trend signals (10).
    + [
        "seller_rating",
        "seller_ship_days",
        "seller_cancel_rate",
        "seller_response_h",
        "hours_since_update",
        "hours_since_restock",
        "previous_position",
        "price_vs_category_median",
        "popularity_trend_7d",
        "popularity_trend_28d",
    ]
)
NUM_FEATURES: Final = 80
assert len(FEATURE_NAMES) == NUM_FEATURES and len(set(FEATURE_NAMES)) == NUM_FEATURES


CONTEXT: Final = ContextSpec(
    (
        ContextField("surface", str, ("home", "search", "product_page", "cart", "email"), "home"),
        ContextField("hour_of_day", int, tuple(range(24)), 12),
        ContextField(
            "device_class",
            str,
            ("desktop", "mobile_web", "app_ios", "app_android", "tablet"),
            "mobile_web",
        ),
        ContextField(
            "locale_bucket", str, ("en", "de", "fr", "es", "it", "ja", "pt", "other"), "other"
        ),
    )
)
CONTEXT_FIELDS: Final[Mapping[str, ContextField]] = CONTEXT.fields
CONTEXT_ORDER: Final[tuple[str, ...]] = CONTEXT.order
encode_context = CONTEXT.encode


class CandidateIn(BaseModel):
    # strict: no coercion of strings or booleans into numbers (or numbers into strings).
    model_config = ConfigDict(extra="forbid", strict=True)

    id: Annotated[str, Field(min_length=1, max_length=MAX_CANDIDATE_ID_CHARS)]
    features: Annotated[
        list[Feature | None], Field(min_length=NUM_FEATURES, max_length=NUM_FEATURES)
    ]


class RankBody(BaseModel):
    """``POST /v1/rank``. ``null`` marks a missing feature; NaN and infinities are refused."""

    # strict: ``true`` is no top_n, ``"5"`` no number, ``17`` no user id.
    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: Annotated[str, Field(max_length=256)] | None = None
    session_id: Annotated[str, Field(max_length=256)] | None = None
    context: dict[str, ContextValue] = Field(default_factory=dict)
    candidates: Annotated[list[CandidateIn], Field(min_length=1, max_length=MAX_CANDIDATES)]
    top_n: Annotated[int, Field(ge=1, le=MAX_CANDIDATES)] = DEFAULT_TOP_N
    # The candidates' features as the float32 matrix the model takes (NaN: missing), built
    # once while validating (to_wire hands it on).
    _features: np.ndarray = PrivateAttr()

    @field_validator("context", mode="before")
    @classmethod
    def _known_context(cls, value: Any) -> Any:
        # Before pydantic's own checks, on the values as sent: the context's own rules name
        # the field ("context.hour_of_day: expected an integer, got bool"); a union's
        # errors would name a union member instead.
        return CONTEXT.check(value)

    @model_validator(mode="after")
    def _unique_ids(self) -> RankBody:
        seen: set[str] = set()
        for i, cand in enumerate(self.candidates):
            if cand.id in seen:
                raise ValueError(f"candidates[{i}].id: duplicate id {cand.id!r}")
            seen.add(cand.id)
        # None -> NaN (missing); the model's preprocessing fills it. Every value was checked
        # to stay finite in float32 (Feature).
        self._features = np.asarray([c.features for c in self.candidates], dtype=np.float32)
        return self


def parse_rank_body(raw: bytes) -> RankBody:
    """Parse and validate a body; RequestInvalid names the first bad field."""
    return parse_body(raw, RankBody)


def to_wire(body: RankBody) -> WireRequest:
    from app.contracts import WireRequest

    ids = tuple(c.id for c in body.candidates)
    return WireRequest(ids, body._features, body.context, body.top_n)


class RankerFeaturesV3:
    """The family's ``app.model_family.RequestSchema``."""

    name = FEATURE_SCHEMA
    preprocessing_files = (NORMALIZATION_FILE,)
    oip = RankTensors(item_list="candidates", item_width=NUM_FEATURES, context=CONTEXT)

    def parse(self, raw: bytes) -> ParsedRequest:
        body = parse_rank_body(raw)
        return ParsedRequest(to_wire(body), body.user_id, body.session_id)

    def preprocessing(self, files: Mapping[str, bytes]) -> Normalization:
        return Normalization.from_json(files[NORMALIZATION_FILE], FEATURE_NAMES, FEATURE_SCHEMA)

    def encode(self, requests: Sequence[WireRequest], preprocessing: Any) -> EncodedBatch:
        """Candidates of many requests flattened into rows (no padding: no wasted compute):
        ``features`` float32 [rows, 80] normalised and clipped, ``context`` int64
        [rows, fields] category indices. Requests must be validated."""
        norm: Normalization = preprocessing
        counts, offsets = candidate_offsets(requests)
        features = norm.apply(stack_features(requests, offsets, NUM_FEATURES))
        ctx = np.asarray([CONTEXT.encode(r.context) for r in requests], dtype=np.int64)
        return EncodedBatch(
            {"features": features, "context": np.repeat(ctx, counts, axis=0)}, offsets
        )

    def synthetic_bodies(
        self, count: int, *, seed: int, candidates: int, top_n: int
    ) -> Iterator[dict[str, Any]]:
        """Bodies without a user id (``{"context", "candidates", "top_n"}``, in that key
        order): candidate ``j`` of body ``i`` is ``item-i-j`` with 80 features drawn from
        N(0, 1) and rounded to 4 decimals (one missing, ``null``, on every seventh), the
        context one random value per field."""
        rng = random.Random(seed)
        for i in range(count):
            cands = []
            for j in range(candidates):
                features: list[float | None] = [
                    round(rng.gauss(0, 1), 4) for _ in range(NUM_FEATURES)
                ]
                if j % SPARSE_EVERY == 0:
                    features[rng.randrange(NUM_FEATURES)] = None
                cands.append({"id": f"item-{i}-{j}", "features": features})
            context = {name: rng.choice(f.values) for name, f in CONTEXT_FIELDS.items()}
            yield {"context": context, "candidates": cands, "top_n": top_n}


SCHEMA: Final = RankerFeaturesV3()
