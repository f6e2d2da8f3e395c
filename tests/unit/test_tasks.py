"""The tasks a family can declare (app.tasks): each task's dry-run checks and its comparison
of two answers, with values worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from app.errors import ArtifactRejected, ConfigError
from app.model_family import SHIPPED_FAMILIES, Families, import_family
from app.tasks import CLASSIFY, EMBED, RANK, SCORE, TASKS, task_named
from app.tasks.classify import check_probabilities, predicted_labels, total_variation
from app.tasks.embed import EmbeddingShape, check_embeddings, cosine_similarities
from app.tasks.score import ScoreBounds, check_scores, relative_differences

LABELS = ("negative", "positive")


def rejected(call, *args, **kwargs) -> str:
    with pytest.raises(ArtifactRejected) as info:
        call(*args, **kwargs)
    assert info.value.category == "dry_run"
    return info.value.detail


# ------------------------------------------------------------------ every task


def test_each_task_has_its_route_and_measures_and_the_names_are_unique() -> None:
    assert list(TASKS) == ["rank", "classify", "score", "embed"]
    assert {t.route for t in TASKS.values()} == {
        "/v1/rank", "/v1/classify", "/v1/score", "/v1/embed"
    }  # fmt: skip
    for task in TASKS.values():
        assert task.measures and task.primary is task.measures[0]
        assert len({m.name for m in task.measures}) == len(task.measures)
        assert task.standby_metric
    assert task_named("classify") is CLASSIFY
    with pytest.raises(
        ConfigError, match=r"models\[0\]: unknown task 'generate' \(known: rank, classify"
    ):
        task_named("generate", "models[0]")


def test_a_shipped_family_declares_the_rank_task_and_one_of_another_task_is_refused() -> None:
    for path in SHIPPED_FAMILIES:
        assert import_family(path).task is RANK
    ranker = import_family(SHIPPED_FAMILIES[0])
    assert Families([ranker]).serving().task.route == "/v1/rank"
    classifier = dataclasses.replace(ranker, name="a-classifier", task=CLASSIFY)
    with pytest.raises(ConfigError, match="'a-classifier' declares the task 'classify'"):
        Families([classifier], where="models")


def test_measures_put_every_task_on_one_agreement_scale() -> None:
    rbo, _, top1, _ = RANK.measures
    assert rbo.agreement(0.9) == pytest.approx(0.9)
    assert top1.agreement(1.0) == 0.0 and top1.agreement(0.0) == 1.0
    tv = CLASSIFY.measures[1]
    assert tv.agreement(0.2) == pytest.approx(0.8)
    cosine = EMBED.primary
    assert cosine.agreement(-1.0) == 0.0  # opposite counts as unrelated, not below it


def test_totals_add_up_the_comparisons_and_refuse_what_is_not_a_measure() -> None:
    totals = CLASSIFY.totals()
    assert totals.means() == {"label_agreement": None, "tv_distance": None}
    totals.add({"label_agreement": 1.0, "tv_distance": 0.1})
    totals.add({"label_agreement": 0.0, "tv_distance": 0.5})
    assert totals.compared == 2
    assert totals.means() == pytest.approx({"label_agreement": 0.5, "tv_distance": 0.3})
    with pytest.raises(ValueError, match="expected"):
        totals.add({"label_agreement": 1.0})
    with pytest.raises(ValueError, match="not finite"):
        totals.add({"label_agreement": math.nan, "tv_distance": 0.0})
    assert totals.compared == 2


# ------------------------------------------------------------------ rank


def test_rank_compares_two_rankings_as_the_divergence_metrics_do() -> None:
    stable = [("a", 0.9), ("b", 0.8), ("c", 0.1)]
    swapped = [("b", 0.85), ("a", 0.6), ("c", 0.1)]
    found = RANK.compare(stable, swapped)
    # RBO_ext at depth 3, p = 0.9: X = (0, 2, 3), so 1 * 0.9^3 + (0.1 / 0.9) * (0 + 1 * 0.81
    # + 1 * 0.729) = 0.729 + 0.171 = 0.9.
    assert found["rbo"] == pytest.approx(0.9)
    assert found["overlap"] == 1.0  # the same three, in another order
    assert found["top1_changed"] == 1.0
    assert found["max_score_diff"] == pytest.approx(0.3)  # a: 0.9 -> 0.6
    assert RANK.compare(stable, stable) == {
        "rbo": 1.0, "overlap": 1.0, "top1_changed": 0.0, "max_score_diff": 0.0
    }  # fmt: skip


# ------------------------------------------------------------------ classify


def test_classify_checks_shape_finiteness_range_and_sums() -> None:
    good = np.array([[0.25, 0.75], [1.0, 0.0]], dtype=np.float32)
    check_probabilities(good, LABELS, inputs=2)
    assert "shape (2, 2), expected (3, 2)" in rejected(check_probabilities, good, LABELS, inputs=3)
    assert "expected (2, 3)" in rejected(check_probabilities, good, (*LABELS, "x"), inputs=2)
    nan = good.copy()
    nan[1, 1] = np.nan
    assert "1 probabilities are not finite (first: input 1, 'positive')" in rejected(
        check_probabilities, nan, LABELS, inputs=2
    )
    negative = np.array([[-0.1, 1.1]])
    assert "-0.1 outside [0, 1] (input 0, 'negative')" in rejected(
        check_probabilities, negative, LABELS, inputs=1
    )
    short = np.array([[0.5, 0.5], [0.3, 0.6]])  # the second sums to 0.9
    assert "input 1 sum to 0.9, not 1" in rejected(check_probabilities, short, LABELS, inputs=2)
    # Within the tolerance a float32 softmax rounds to, a row passes.
    check_probabilities(np.array([[0.5, 0.5 + 5e-4]]), LABELS, inputs=1)
    assert "distinct labels" in rejected(check_probabilities, good, ("a", "a"), inputs=2)


def test_classify_compares_labels_and_total_variation_by_hand() -> None:
    stable = np.array([[0.7, 0.3], [0.2, 0.8]])
    candidate = np.array([[0.4, 0.6], [0.1, 0.9]])
    assert predicted_labels(stable, LABELS) == ["negative", "positive"]
    assert predicted_labels(candidate, LABELS) == ["positive", "positive"]
    # Row 0: (|0.7 - 0.4| + |0.3 - 0.6|) / 2 = 0.3; row 1: (0.1 + 0.1) / 2 = 0.1.
    assert total_variation(stable, candidate) == pytest.approx([0.3, 0.1])
    assert CLASSIFY.compare(stable, candidate) == pytest.approx(
        {"label_agreement": 0.5, "tv_distance": 0.2}
    )
    # Disjoint distributions are 1 apart; identical ones 0.
    assert total_variation(np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])) == pytest.approx([1])
    assert CLASSIFY.compare(stable, stable) == {"label_agreement": 1.0, "tv_distance": 0.0}
    with pytest.raises(ValueError):
        CLASSIFY.compare(stable, candidate[:1])


# ------------------------------------------------------------------ score


def test_score_checks_finiteness_and_the_declared_bounds() -> None:
    bounds = ScoreBounds(0.0, 5.0)
    check_scores(np.array([0.0, 2.5, 5.0]), items=3, bounds=bounds)
    assert "expected (2,)" in rejected(check_scores, np.array([1.0]), items=2, bounds=bounds)
    assert "1 of 2 scores are not finite (first: item 1)" in rejected(
        check_scores, np.array([1.0, np.inf]), items=2, bounds=bounds
    )
    assert "score 5.5 of item 0 outside [0, 5] (2 of 2 items)" in rejected(
        check_scores, np.array([5.5, -1.0]), items=2, bounds=bounds
    )
    with pytest.raises(ValueError):
        ScoreBounds(1.0, 1.0)


def test_score_compares_by_the_mean_relative_difference_by_hand() -> None:
    stable = np.array([1.0, 2.0, 0.0, -1.0])
    candidate = np.array([2.0, 2.0, 0.0, 1.0])
    # |1-2|/2 = 0.5; 0; both 0: 0; |-1-1|/1 = 2 (opposite signs).
    assert relative_differences(stable, candidate) == pytest.approx([0.5, 0.0, 0.0, 2.0])
    assert SCORE.compare(stable, candidate) == pytest.approx({"relative_diff": 0.625})
    assert SCORE.compare(stable, stable) == {"relative_diff": 0.0}


# ------------------------------------------------------------------ embed


def test_embed_checks_dimension_finiteness_and_norms() -> None:
    unit = EmbeddingShape(dimension=2, min_norm=0.99, max_norm=1.01)
    check_embeddings(np.array([[1.0, 0.0], [0.6, 0.8]]), inputs=2, shape=unit)
    assert "expected (2, 2)" in rejected(check_embeddings, np.zeros((2, 3)), inputs=2, shape=unit)
    assert "1 of 2 embeddings are not finite (first: input 0)" in rejected(
        check_embeddings, np.array([[np.nan, 0.0], [1.0, 0.0]]), inputs=2, shape=unit
    )
    # A collapsed model (zero vectors) is refused by a positive lower bound.
    assert "input 1 has norm 0, outside [0.99, 1.01]" in rejected(
        check_embeddings, np.array([[1.0, 0.0], [0.0, 0.0]]), inputs=2, shape=unit
    )


def test_embed_compares_by_the_mean_cosine_similarity_by_hand() -> None:
    stable = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    candidate = np.array([[1.0, 1.0], [0.0, -1.0], [1.0, 0.0]])
    # cos 45 deg = 0.7071; opposite: -1; a zero vector: 0.
    assert cosine_similarities(stable, candidate) == pytest.approx([math.sqrt(0.5), -1.0, 0.0])
    assert EMBED.compare(stable, candidate) == pytest.approx({"cosine": (math.sqrt(0.5) - 1.0) / 3})
    assert EMBED.compare(stable[:2], stable[:2]) == pytest.approx({"cosine": 1.0})
