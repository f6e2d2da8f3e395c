"""How far a candidate's ranking is from stable's for the same request.

Pure module: no Ray, no torch, no I/O. The router compares every mirrored request's two
rankings with ``compare_rankings``; ``rollout replay`` aggregates the same comparisons over a
held-out set with ``DivergenceTotals`` and writes the expectation a manifest carries
(``app.contracts.ExpectedDivergence``). Both use this one definition, so what is measured
live is what was recorded offline.

Measures of one comparison (rankings are lists of candidate ids, best first):

- ``overlap``: the share of stable's top ``k`` that is in the candidate's top ``k``
  (``|A[:k] & B[:k]| / k``, with ``k`` cut to the shorter list); 1 for the same top ``k`` in
  any order.
- ``rbo``: rank-biased overlap (Webber, Moffat and Zobel, "A similarity measure for indefinite
  rankings", TOIS 2010), the extrapolated form ``RBO_ext`` for two lists of the evaluated depth
  ``d``: ``(X_d / d) p^d + (1 - p) / p * sum_{i<=d} (X_i / i) p^i``, where ``X_i`` is the size of
  the overlap of the two prefixes of length ``i``. It weighs agreement at the top more
  (``p`` = 0.9 puts about 86% of the weight on the first 10 ranks), is 1 for identical lists
  and 0 for disjoint ones, and always lies in [0, 1].
- ``max_score_diff``: the largest absolute difference of the score given to one candidate by
  both models (over the candidates both returned; 0 when none is shared).
- ``top1_changed``: the first candidate differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

DEFAULT_TOP_K: Final = 10
DEFAULT_RBO_P: Final = 0.9
# RBO is evaluated to at most this depth: the weight left below it is p^depth (1e-46 for
# p = 0.9), and a router must not spend O(candidates) per mirrored request on 2048 of them.
MAX_RBO_DEPTH: Final = 1000

Ranking = Sequence[tuple[str, float]]  # (candidate id, score), best first


def _check_p(p: float) -> None:
    if not 0.0 < p < 1.0:
        raise ValueError(f"rbo p must be in (0, 1), got {p}")


def top_k_overlap(a: Sequence[str], b: Sequence[str], k: int) -> float:
    """``|a[:k] & b[:k]| / k`` with ``k`` cut to the shorter list; 1 for two empty lists."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    depth = min(k, len(a), len(b))
    if depth == 0:
        return 1.0 if not a and not b else 0.0
    return len(set(a[:depth]) & set(b[:depth])) / depth


def rank_biased_overlap(a: Sequence[str], b: Sequence[str], p: float = DEFAULT_RBO_P) -> float:
    """Extrapolated RBO of two rankings, evaluated to the shorter list's depth (at most
    ``MAX_RBO_DEPTH``); 1 for identical lists, 0 for disjoint ones. Ids within one list are
    expected to be distinct (a repeated id counts once)."""
    _check_p(p)
    depth = min(len(a), len(b), MAX_RBO_DEPTH)
    if depth == 0:
        return 1.0 if not a and not b else 0.0
    seen_a: set[str] = set()
    seen_b: set[str] = set()
    overlap = 0
    weighted = 0.0
    weight = 1.0
    for i in range(depth):
        x, y = a[i], b[i]
        if x == y:
            if x not in seen_a:
                overlap += 1
        else:
            if x in seen_b:
                overlap += 1
            if y in seen_a:
                overlap += 1
        seen_a.add(x)
        seen_b.add(y)
        weight *= p
        weighted += overlap / (i + 1) * weight
    value = overlap / depth * weight + (1 - p) / p * weighted
    # Rounding can leave identical lists a hair off 1 (and the histogram's top bucket is 1).
    return min(1.0, max(0.0, value))


@dataclass(frozen=True)
class Divergence:
    """One mirrored request: the candidate's ranking against stable's."""

    overlap: float
    rbo: float
    max_score_diff: float
    top1_changed: bool


def compare_rankings(
    stable: Ranking, canary: Ranking, *, top_k: int = DEFAULT_TOP_K, rbo_p: float = DEFAULT_RBO_P
) -> Divergence:
    """Compare two answers to the same request."""
    ids_a = [item[0] for item in stable]
    ids_b = [item[0] for item in canary]
    scores_b = {item[0]: item[1] for item in canary}
    diff = 0.0
    for cid, score in stable:
        other = scores_b.get(cid)
        if other is not None:
            gap = abs(float(score) - float(other))
            if math.isfinite(gap):
                diff = max(diff, gap)
    return Divergence(
        overlap=top_k_overlap(ids_a, ids_b, top_k),
        rbo=rank_biased_overlap(ids_a, ids_b, rbo_p),
        max_score_diff=diff,
        top1_changed=bool(ids_a) != bool(ids_b) or (bool(ids_a) and ids_a[0] != ids_b[0]),
    )


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by the nearest-rank method (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class DivergenceSums:
    """What every tally of ranking comparisons holds, whatever it is for (a replay's totals
    here, one window's increases read from the metrics, a window's statistics, the shadow
    phase's evidence over its windows): how many copies were compared and the sums of their
    RBO, top-k overlap and top-1 changes. The means are derived here, once; each tally is a
    dataclass of its own (its number types, frozen or not, persisted or not) declaring these
    four fields."""

    compared: float
    rbo_sum: float
    overlap_sum: float
    top1_changed: float

    @property
    def rbo_mean(self) -> float | None:
        return self.rbo_sum / self.compared if self.compared else None

    @property
    def overlap_mean(self) -> float | None:
        return self.overlap_sum / self.compared if self.compared else None

    @property
    def top1_change_rate(self) -> float | None:
        return self.top1_changed / self.compared if self.compared else None

    def add_sums(self, other: DivergenceSums) -> None:
        """Add ``other``'s comparisons to these (a mutable tally)."""
        self.compared += other.compared
        self.rbo_sum += other.rbo_sum
        self.overlap_sum += other.overlap_sum
        self.top1_changed += other.top1_changed

    def clamped(self) -> tuple[int, float, float, int]:
        """(compared, rbo_sum, overlap_sum, top1_changed) as whole counts, each sum within
        [0, compared]: the sums of values in [0, 1] over the compared copies (figures read
        from counters may be off by rounding, or by a counter reset)."""
        compared = max(round(self.compared), 0)
        return (
            compared,
            min(max(self.rbo_sum, 0.0), compared),
            min(max(self.overlap_sum, 0.0), compared),
            min(max(round(self.top1_changed), 0), compared),
        )


@dataclass
class DivergenceTotals(DivergenceSums):
    """Comparisons added up: what a window of mirrored requests (or an offline replay) saw."""

    compared: int = 0
    overlap_sum: float = 0.0
    rbo_sum: float = 0.0
    top1_changed: int = 0
    score_diffs: list[float] = field(default_factory=list)

    def add(self, d: Divergence) -> None:
        self.compared += 1
        self.overlap_sum += d.overlap
        self.rbo_sum += d.rbo
        self.top1_changed += int(d.top1_changed)
        self.score_diffs.append(d.max_score_diff)

    def summary(self) -> Mapping[str, float | int | None]:
        return {
            "compared": self.compared,
            "rbo_mean": self.rbo_mean,
            "overlap_mean": self.overlap_mean,
            "top1_change_rate": self.top1_change_rate,
            "max_score_diff_p99": quantile(self.score_diffs, 0.99) if self.score_diffs else None,
        }
