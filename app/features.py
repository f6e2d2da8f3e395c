"""The ``ranker-features-v3`` input contract: feature names, request context, normalization,
score-band labels, and the pre- and post-processing around the ranker's forward pass.

Pure module (numpy only). A request carries candidates, each with 80 numeric features, plus a
small typed request context; it is validated once, at the HTTP edge (``app.api``), and reaches
the model as an ``app.contracts.WireRequest``: the candidates' features as one float32 matrix,
NaN where a feature is missing. Everything an artifact contributes to pre/post-processing
(per-feature mean/std/fill, score bands) is parsed and checked here, so that a generation
carries the exact preprocessing its weights were trained with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from app.errors import ArtifactRejected

if TYPE_CHECKING:  # app.contracts imports this module (FEATURE_SCHEMA)
    from app.contracts import WireRequest

FEATURE_SCHEMA: Final = "ranker-features-v3"
NORMALIZATION_FILE: Final = "normalization.json"
LABEL_MAPPING_FILE: Final = "label_mapping.json"

# Limits of one request: the batch forward pads nothing, but a single request with an
# unbounded candidate list would still monopolise a replica.
MAX_CANDIDATES: Final = 2048
MAX_CANDIDATE_ID_CHARS: Final = 256
# Normalised features are clipped to this many standard deviations unless the artifact's
# normalization.json says otherwise: bounded inputs keep a finite-weight model finite.
DEFAULT_CLIP: Final = 8.0


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


@dataclass(frozen=True)
class ContextField:
    """One request-context key. Every field is categorical for the model (an embedding per
    field); ``hour_of_day`` is an integer whose 24 values are its categories."""

    name: str
    kind: type  # str or int
    values: tuple[str | int, ...]
    default: str | int


CONTEXT_FIELDS: Final[Mapping[str, ContextField]] = {
    f.name: f
    for f in (
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
}
CONTEXT_ORDER: Final[tuple[str, ...]] = tuple(CONTEXT_FIELDS)
_CONTEXT_INDEX: Final[dict[str, dict[str | int, int]]] = {
    f.name: {v: i for i, v in enumerate(f.values)} for f in CONTEXT_FIELDS.values()
}
_DEFAULT_CONTEXT_INDEX: Final = tuple(
    _CONTEXT_INDEX[f.name][f.default] for f in CONTEXT_FIELDS.values()
)


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    id: str
    score: float  # sigmoid of the model's logit, in [0, 1]
    label: str = ""  # score band from the artifact's label_mapping.json


def _context_value(name: str, value: Any) -> str | int:
    spec = CONTEXT_FIELDS.get(name)
    if spec is None:
        known = ", ".join(CONTEXT_ORDER)
        raise ValueError(f"context.{name}: unknown context field (known: {known})")
    if spec.kind is int:
        # Integral floats (13.0) arrive from JSON clients; booleans are not hours.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"context.{name}: expected an integer, got {type(value).__name__}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"context.{name}: expected an integer, got {value!r}")
        value = int(value)
    elif not isinstance(value, str):
        raise ValueError(f"context.{name}: expected a string, got {type(value).__name__}")
    if value not in _CONTEXT_INDEX[name]:
        raise ValueError(f"context.{name}: {value!r} is not one of {list(spec.values)}")
    return value


def encode_context(context: Mapping[str, str | int | float]) -> tuple[int, ...]:
    """Category index of every context field, in CONTEXT_ORDER, defaults filled in."""
    if not context:
        return _DEFAULT_CONTEXT_INDEX
    out = list(_DEFAULT_CONTEXT_INDEX)
    for pos, name in enumerate(CONTEXT_ORDER):
        if name in context:
            out[pos] = _CONTEXT_INDEX[name][_context_value(name, context[name])]
    return tuple(out)


# --------------------------------------------------------------------------- artifact files


def _reject(detail: str) -> ArtifactRejected:
    return ArtifactRejected("schema", detail)


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _reject(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _load_json(data: bytes, name: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _reject(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _reject(f"{name}: expected a JSON object")
    declared = doc.get("feature_schema")
    if declared != FEATURE_SCHEMA:
        raise _reject(f"{name}: feature_schema is {declared!r}, expected {FEATURE_SCHEMA!r}")
    return doc


@dataclass(frozen=True, eq=False)
class Normalization:
    """Per-feature mean/std and the raw fill value used for a missing feature."""

    mean: np.ndarray  # float32 [80]
    std: np.ndarray  # float32 [80], all > 0
    fill: np.ndarray  # float32 [80], raw units
    clip: float

    @classmethod
    def from_json(cls, data: bytes) -> Normalization:
        doc = _load_json(data, NORMALIZATION_FILE)
        feats = doc.get("features")
        if not isinstance(feats, dict):
            raise _reject(f"{NORMALIZATION_FILE}: 'features' must be an object keyed by name")
        missing = [n for n in FEATURE_NAMES if n not in feats]
        extra = sorted(set(feats) - set(FEATURE_NAMES))
        if missing or extra:
            raise _reject(
                f"{NORMALIZATION_FILE}: features do not match {FEATURE_SCHEMA} "
                f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, extra {extra[:5]})"
            )
        mean, std, fill = [], [], []
        for name in FEATURE_NAMES:
            entry = feats[name]
            if not isinstance(entry, dict) or set(entry) != {"mean", "std", "fill"}:
                raise _reject(f"{NORMALIZATION_FILE}: {name}: expected keys mean, std, fill")
            mean.append(_finite(entry["mean"], f"{NORMALIZATION_FILE}: {name}.mean"))
            s = _finite(entry["std"], f"{NORMALIZATION_FILE}: {name}.std")
            if s <= 0:
                raise _reject(f"{NORMALIZATION_FILE}: {name}.std must be > 0, got {s}")
            std.append(s)
            fill.append(_finite(entry["fill"], f"{NORMALIZATION_FILE}: {name}.fill"))
        clip = _finite(doc.get("clip", DEFAULT_CLIP), f"{NORMALIZATION_FILE}: clip")
        if clip <= 0:
            raise _reject(f"{NORMALIZATION_FILE}: clip must be > 0, got {clip}")
        as32 = lambda xs: np.asarray(xs, dtype=np.float32)  # noqa: E731
        return cls(as32(mean), as32(std), as32(fill), clip)


@dataclass(frozen=True, eq=False)
class LabelMapping:
    """Score bands: a score s gets the label of the last band whose min_score <= s."""

    labels: tuple[str, ...]
    min_scores: np.ndarray  # float64, ascending, first is 0.0

    @classmethod
    def from_json(cls, data: bytes) -> LabelMapping:
        doc = _load_json(data, LABEL_MAPPING_FILE)
        bands = doc.get("score_bands")
        if not isinstance(bands, list) or not bands:
            raise _reject(f"{LABEL_MAPPING_FILE}: 'score_bands' must be a non-empty list")
        labels: list[str] = []
        mins: list[float] = []
        for i, band in enumerate(bands):
            where = f"{LABEL_MAPPING_FILE}: score_bands[{i}]"
            if not isinstance(band, dict) or set(band) != {"label", "min_score"}:
                raise _reject(f"{where}: expected keys label, min_score")
            label = band["label"]
            if not isinstance(label, str) or not label or len(label) > 64:
                raise _reject(f"{where}: label must be a non-empty string (max 64 chars)")
            lo = _finite(band["min_score"], f"{where}.min_score")
            if not 0.0 <= lo <= 1.0:
                raise _reject(f"{where}: min_score {lo} outside [0, 1]")
            if mins and lo <= mins[-1]:
                raise _reject(f"{where}: min_score must increase strictly")
            labels.append(label)
            mins.append(lo)
        if mins[0] != 0.0:
            raise _reject(f"{LABEL_MAPPING_FILE}: the first band must start at min_score 0")
        if len(set(labels)) != len(labels):
            raise _reject(f"{LABEL_MAPPING_FILE}: duplicate labels")
        return cls(tuple(labels), np.asarray(mins, dtype=np.float64))

    def label_indices(self, scores: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.min_scores, scores, side="right") - 1


# --------------------------------------------------------------------------- pre/post


@dataclass(frozen=True, eq=False)
class EncodedBatch:
    """Candidates of many requests flattened into rows (no padding: no wasted compute)."""

    features: np.ndarray  # float32 [rows, 80], normalised and clipped
    context: np.ndarray  # int64 [rows, len(CONTEXT_ORDER)], category index per field
    offsets: np.ndarray  # int64 [requests + 1]; request i owns rows offsets[i]:offsets[i+1]


def encode_batch(requests: Sequence[WireRequest], norm: Normalization) -> EncodedBatch:
    """Missing (NaN) -> fill (raw units) -> (x - mean) / std -> clip. Requests must be
    validated."""
    counts = np.fromiter((len(r.candidate_ids) for r in requests), np.int64, len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    raw = np.empty((int(offsets[-1]), NUM_FEATURES), dtype=np.float32)
    for i, req in enumerate(requests):
        raw[offsets[i] : offsets[i + 1]] = req.features
    missing = np.isnan(raw)
    if missing.any():
        raw = np.where(missing, norm.fill, raw)
    raw -= norm.mean
    raw /= norm.std
    np.clip(raw, -norm.clip, norm.clip, out=raw)
    ctx = np.asarray([encode_context(r.context) for r in requests], dtype=np.int64)
    return EncodedBatch(raw, np.repeat(ctx, counts, axis=0), offsets)


def rank_from_logits(
    requests: Sequence[WireRequest],
    logits: np.ndarray,
    offsets: np.ndarray,
    labels: LabelMapping,
) -> list[list[RankedCandidate]]:
    """Top-N per request, by score descending; ties keep the request's candidate order."""
    logits64 = logits.astype(np.float64, copy=False)
    scores = 1.0 / (1.0 + np.exp(-logits64))
    label_idx = labels.label_indices(scores)
    names = labels.labels
    out: list[list[RankedCandidate]] = []
    for i, req in enumerate(requests):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        # Stable sort on the negated logit: higher score first, equal scores in input order.
        order = np.argsort(-logits64[lo:hi], kind="stable")[: req.top_n]
        ids = req.candidate_ids
        s = scores[lo:hi]
        li = label_idx[lo:hi]
        out.append([RankedCandidate(ids[j], float(s[j]), names[li[j]]) for j in order.tolist()])
    return out
