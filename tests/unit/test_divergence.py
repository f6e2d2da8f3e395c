"""Ranking comparisons against hand-computed values (app/divergence.py)."""

from __future__ import annotations

import math
import random

import pytest

from app.divergence import (
    DivergenceTotals,
    compare_rankings,
    quantile,
    rank_biased_overlap,
    top_k_overlap,
)


def test_top_k_overlap_by_hand() -> None:
    assert top_k_overlap(list("abcd"), list("dcba"), 4) == 1.0  # same set, any order
    assert top_k_overlap(list("abcd"), list("abxy"), 4) == 0.5
    assert top_k_overlap(list("abcd"), list("xyzw"), 4) == 0.0
    # k cut to the shorter list: the 2 of "ab" both in the other's first 2.
    assert top_k_overlap(list("ab"), list("bacd"), 10) == 1.0
    assert top_k_overlap(list("abc"), list("cxb"), 2) == 0.0  # {a,b} vs {c,x}
    assert top_k_overlap([], [], 10) == 1.0
    assert top_k_overlap(["a"], [], 10) == 0.0
    with pytest.raises(ValueError, match="k must be"):
        top_k_overlap(["a"], ["a"], 0)


def _rbo_ext_by_definition(a: list[str], b: list[str], p: float) -> float:
    """RBO_ext computed straight from its formula with explicit prefix sets."""
    d = min(len(a), len(b))
    x = [len(set(a[:i]) & set(b[:i])) for i in range(1, d + 1)]
    tail = sum(x[i - 1] / i * p**i for i in range(1, d + 1))
    return x[d - 1] / d * p**d + (1 - p) / p * tail


def test_rbo_by_hand() -> None:
    # Identical lists: exactly 1 whatever p; disjoint: 0.
    for p in (0.5, 0.9, 0.98):
        assert rank_biased_overlap(list("abcdef"), list("abcdef"), p) == pytest.approx(1.0)
        assert rank_biased_overlap(list("abc"), list("xyz"), p) == 0.0
    # "ab" vs "ba" at p = 0.5: X_1 = 0, X_2 = 2.
    # RBO_ext = (2/2) * 0.25 + (0.5/0.5) * (0 * 0.5 + (2/2) * 0.25) = 0.25 + 0.25 = 0.5
    assert rank_biased_overlap(["a", "b"], ["b", "a"], 0.5) == pytest.approx(0.5)
    # "abc" vs "acb" at p = 0.5: X = 1, 1, 3.
    # (3/3) * 0.125 + 1 * (1 * 0.5 + 0.5 * 0.25 + 1 * 0.125) = 0.125 + 0.75 = 0.875
    assert rank_biased_overlap(list("abc"), list("acb"), 0.5) == pytest.approx(0.875)
    # A swap at the top costs more than the same swap at the bottom.
    top = rank_biased_overlap(list("bacdefgh"), list("abcdefgh"), 0.9)
    bottom = rank_biased_overlap(list("abcdefhg"), list("abcdefgh"), 0.9)
    assert top < bottom < 1.0


def test_rbo_matches_its_definition_on_random_rankings() -> None:
    rng = random.Random(7)
    items = [f"c{i}" for i in range(30)]
    for _ in range(200):
        n = rng.randint(1, 20)
        a = rng.sample(items, n)
        b = rng.sample(items, n)
        p = rng.choice((0.5, 0.8, 0.9, 0.95))
        got = rank_biased_overlap(a, b, p)
        assert got == pytest.approx(_rbo_ext_by_definition(a, b, p), abs=1e-12)
        assert 0.0 <= got <= 1.0
        assert got == pytest.approx(rank_biased_overlap(b, a, p), abs=1e-12)  # symmetric


def test_rbo_refuses_a_p_outside_the_open_interval() -> None:
    for p in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="p must be in"):
            rank_biased_overlap(["a"], ["a"], p)


def test_compare_rankings_reports_all_four_measures() -> None:
    stable = [("a", 0.9), ("b", 0.8), ("c", 0.5)]
    same = compare_rankings(stable, list(stable), top_k=3)
    assert (same.overlap, same.rbo, same.max_score_diff, same.top1_changed) == (
        1.0,
        pytest.approx(1.0),
        0.0,
        False,
    )
    canary = [("b", 0.95), ("a", 0.7), ("d", 0.4)]
    d = compare_rankings(stable, canary, top_k=3, rbo_p=0.9)
    assert d.top1_changed is True
    assert d.overlap == pytest.approx(2 / 3)
    # Score differences over the shared candidates only: a 0.2, b 0.15 (c and d unshared).
    assert d.max_score_diff == pytest.approx(0.2)
    assert d.rbo == pytest.approx(_rbo_ext_by_definition(list("abc"), list("bad"), 0.9))
    # Nothing shared: no score difference to measure; an empty answer changes the top.
    assert compare_rankings(stable, [("z", 0.1)]).max_score_diff == 0.0
    assert compare_rankings(stable, []).top1_changed is True


def test_totals_add_up_means_and_the_p99() -> None:
    totals = DivergenceTotals()
    stable = [("a", 0.9), ("b", 0.8)]
    totals.add(compare_rankings(stable, stable))
    totals.add(compare_rankings(stable, [("b", 0.9), ("a", 0.8)], rbo_p=0.5))
    summary = totals.summary()
    assert summary["compared"] == 2
    assert summary["rbo_mean"] == pytest.approx((1.0 + 0.5) / 2)
    assert summary["top1_change_rate"] == 0.5
    assert summary["overlap_mean"] == 1.0
    assert summary["max_score_diff_p99"] == pytest.approx(0.1)
    assert DivergenceTotals().summary()["rbo_mean"] is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert math.isclose(quantile(list(range(1, 101)), 0.99), 99)
