"""Pre- and post-processing every model family shares: named-feature normalization, typed
categorical request context, the artifact's score bands, and the ranked answer.

Pure module (numpy only). What an artifact contributes (per-feature mean/std/fill, score
bands) is parsed and checked here against the family's schema, so a generation carries the
exact preprocessing its weights were trained with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from app.errors import ArtifactRejected

if TYPE_CHECKING:
    from app.contracts import WireRequest

NORMALIZATION_FILE: Final = "normalization.json"
LABEL_MAPPING_FILE: Final = "label_mapping.json"
# Normalised features are clipped to this many standard deviations unless the artifact's
# normalization.json says otherwise: bounded inputs keep a finite-weight model finite.
DEFAULT_CLIP: Final = 8.0


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    id: str
    score: float  # sigmoid of the model's logit, in [0, 1]
    label: str = ""  # score band from the artifact's label_mapping.json


# --------------------------------------------------------------------------- request context


@dataclass(frozen=True)
class ContextField:
    """One request-context key. Every field is categorical for the model (an embedding per
    field); an integer field (``hour_of_day``) has its values as categories."""

    name: str
    kind: type  # str or int
    values: tuple[str | int, ...]
    default: str | int


class ContextSpec:
    """A family's request-context fields, and their encoding as category indices."""

    def __init__(self, fields: Sequence[ContextField]) -> None:
        self.fields: Mapping[str, ContextField] = {f.name: f for f in fields}
        self.order: tuple[str, ...] = tuple(self.fields)
        self._index = {f.name: {v: i for i, v in enumerate(f.values)} for f in fields}
        self._defaults = tuple(self._index[f.name][f.default] for f in fields)

    def value(self, name: str, value: Any) -> str | int:
        """``value`` of field ``name`` as the model takes it; ValueError names the field."""
        spec = self.fields.get(name)
        if spec is None:
            known = ", ".join(self.order)
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
        if value not in self._index[name]:
            raise ValueError(f"context.{name}: {value!r} is not one of {list(spec.values)}")
        return value

    def check(self, context: Any) -> Any:
        """A pydantic ``mode="before"`` check of the context as sent (ValueError naming
        ``context.<field>``); returns it unchanged."""
        if isinstance(context, dict):
            for name in context:
                if name not in self.fields:
                    known = ", ".join(self.order)
                    raise ValueError(f"context.{name}: unknown context field (known: {known})")
            self.encode(context)
        return context

    def encode(self, context: Mapping[str, str | int | float]) -> tuple[int, ...]:
        """Category index of every field, in ``order``, defaults filled in."""
        if not context:
            return self._defaults
        out = list(self._defaults)
        for pos, name in enumerate(self.order):
            if name in context:
                out[pos] = self._index[name][self.value(name, context[name])]
        return tuple(out)

    def cardinalities(self) -> tuple[int, ...]:
        return tuple(len(f.values) for f in self.fields.values())


# --------------------------------------------------------------------------- artifact files


def _reject(detail: str) -> ArtifactRejected:
    return ArtifactRejected("schema", detail)


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _reject(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def load_schema_json(data: bytes, name: str, schema: str) -> dict[str, Any]:
    """An artifact's JSON file that declares the ``feature_schema`` it was made for."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _reject(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _reject(f"{name}: expected a JSON object")
    declared = doc.get("feature_schema")
    if declared != schema:
        raise _reject(f"{name}: feature_schema is {declared!r}, expected {schema!r}")
    return doc


@dataclass(frozen=True, eq=False)
class Normalization:
    """Per-feature mean/std and the raw fill value used for a missing feature, in the order
    of the schema's feature names."""

    mean: np.ndarray  # float32 [features]
    std: np.ndarray  # float32 [features], all > 0
    fill: np.ndarray  # float32 [features], raw units
    clip: float

    @classmethod
    def from_json(cls, data: bytes, feature_names: Sequence[str], schema: str) -> Normalization:
        doc = load_schema_json(data, NORMALIZATION_FILE, schema)
        feats = doc.get("features")
        if not isinstance(feats, dict):
            raise _reject(f"{NORMALIZATION_FILE}: 'features' must be an object keyed by name")
        missing = [n for n in feature_names if n not in feats]
        extra = sorted(set(feats) - set(feature_names))
        if missing or extra:
            raise _reject(
                f"{NORMALIZATION_FILE}: features do not match {schema} "
                f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, extra {extra[:5]})"
            )
        mean, std, fill = [], [], []
        for name in feature_names:
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

    def part(self, start: int, stop: int) -> Normalization:
        """The normalization of features ``start:stop`` (a family with feature groups)."""
        s = slice(start, stop)
        return Normalization(self.mean[s], self.std[s], self.fill[s], self.clip)

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """Missing (NaN) -> fill (raw units) -> (x - mean) / std -> clip. ``raw`` is a float32
        array the caller gives up: it is normalised in place (the hot path copies nothing
        when no feature is missing)."""
        missing = np.isnan(raw)
        if missing.any():
            raw = np.where(missing, self.fill, raw)
        raw -= self.mean
        raw /= self.std
        np.clip(raw, -self.clip, self.clip, out=raw)
        return raw


@dataclass(frozen=True, eq=False)
class LabelMapping:
    """Score bands: a score s gets the label of the last band whose min_score <= s."""

    labels: tuple[str, ...]
    min_scores: np.ndarray  # float64, ascending, first is 0.0

    @classmethod
    def from_json(cls, data: bytes, schema: str) -> LabelMapping:
        doc = load_schema_json(data, LABEL_MAPPING_FILE, schema)
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


# --------------------------------------------------------------------------- the answer


def candidate_offsets(requests: Sequence[WireRequest]) -> tuple[np.ndarray, np.ndarray]:
    """(candidates per request, row offsets [requests + 1]) of a flattened batch."""
    counts = np.fromiter((len(r.candidate_ids) for r in requests), np.int64, len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return counts, offsets


def stack_features(requests: Sequence[WireRequest], offsets: np.ndarray, width: int) -> np.ndarray:
    """Every request's candidate feature matrix, one float32 [rows, width] array."""
    raw = np.empty((int(offsets[-1]), width), dtype=np.float32)
    for i, req in enumerate(requests):
        raw[offsets[i] : offsets[i + 1]] = req.features
    return raw


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
