"""The ``rank`` task: a request names candidates, the answer is the top ``top_n`` of them by
score, each score in [0, 1] with the artifact's score band as its label. Two answers are
compared as rankings (``app.divergence``: rank-biased overlap, top-k overlap, a changed top
item, the largest score difference)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from app.divergence import DEFAULT_RBO_P, DEFAULT_TOP_K, Ranking, compare_rankings
from app.errors import ArtifactRejected
from app.tasks.base import Measure, Task, TaskName

if TYPE_CHECKING:
    from app.contracts import WireRequest
    from app.preprocessing import LabelMapping, RankedCandidate

RANK_ROUTE: Final = "/v1/rank"


def check_ranking(
    request: WireRequest, answer: Sequence[RankedCandidate], labels: LabelMapping
) -> None:
    """A valid top-N for ``request``: ``min(top_n, candidates)`` distinct candidates of the
    request, scores in [0, 1] and not increasing, labels from the artifact's score bands.
    ArtifactRejected("dry_run") says which rule failed."""
    expected_len = min(request.top_n, len(request.candidate_ids))
    if len(answer) != expected_len:
        raise ArtifactRejected(
            "dry_run",
            f"{len(answer)} results for top_n={request.top_n} of {len(request.candidate_ids)}",
        )
    ids = [c.id for c in answer]
    if len(set(ids)) != len(ids) or not set(ids) <= set(request.candidate_ids):
        raise ArtifactRejected("dry_run", "result ids are not distinct candidates of the request")
    scores = [c.score for c in answer]
    if not all(0.0 <= s <= 1.0 for s in scores):
        raise ArtifactRejected("dry_run", "a score is outside [0, 1]")
    if any(a < b for a, b in itertools.pairwise(scores)):
        raise ArtifactRejected("dry_run", "results are not sorted by score")
    if not all(c.label in labels.labels for c in answer):
        raise ArtifactRejected("dry_run", "a result carries an unknown label")


class RankTask(Task):
    name: TaskName = "rank"
    route = RANK_ROUTE
    measures = (
        Measure("rbo", "rank-biased overlap of the two rankings (p 0.9)", 1.0, 0.0),
        Measure("overlap", "share of stable's top 10 in the candidate's top 10", 1.0, 0.0),
        Measure("top1_changed", "the first candidate differs (1) or not (0)", 0.0, 1.0),
        Measure("max_score_diff", "largest score difference of a shared candidate", 0.0, 1.0),
    )
    standby_metric = "ndcg_at_10"

    def __init__(self, top_k: int = DEFAULT_TOP_K, rbo_p: float = DEFAULT_RBO_P) -> None:
        self.top_k = top_k
        self.rbo_p = rbo_p

    def compare(self, stable: Ranking, candidate: Ranking) -> dict[str, float]:
        found = compare_rankings(stable, candidate, top_k=self.top_k, rbo_p=self.rbo_p)
        return {
            "rbo": found.rbo,
            "overlap": found.overlap,
            "top1_changed": float(found.top1_changed),
            "max_score_diff": found.max_score_diff,
        }


RANK: Final = RankTask()
