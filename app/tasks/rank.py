"""The ``rank`` task: a request names candidates, the answer is the top ``top_n`` of them by
score, each score in [0, 1] with the artifact's score band as its label. Two answers are
compared as rankings (``app.divergence``: rank-biased overlap, top-k overlap, a changed top
item, the largest score difference). On the Open Inference Protocol a ranking family's
request is tensors and parameters (``RankTensors``) and its answer three output tensors
(``OIP_OUTPUTS``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from app.divergence import DEFAULT_RBO_P, DEFAULT_TOP_K, Ranking, compare_rankings
from app.errors import ArtifactRejected, RequestInvalid
from app.ingress.oip import OutputTensor, TensorSpec
from app.tasks.base import Measure, Task, TaskName

if TYPE_CHECKING:
    from app.contracts import WireRequest
    from app.preprocessing import ContextSpec, LabelMapping, RankedCandidate

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


# ------------------------------------------------------------------ the Open Inference Protocol

# What a ranking answers on /v2/models/{name}/infer: its top-N, best first.
OIP_OUTPUTS: Final = (
    TensorSpec("candidate_ids", "BYTES", (-1,)),
    TensorSpec("scores", "FP32", (-1,)),
    TensorSpec("labels", "BYTES", (-1,)),
)
# Request parameters every ranking family reads; its context fields are parameters too.
# Triton's own (binary_data_output, priority, timeout, sequence_*) are accepted and ignored.
RANK_PARAMETERS: Final = ("user_id", "session_id", "top_n")
PROTOCOL_PARAMETERS: Final = frozenset(
    {"binary_data_output", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end"}
)


def oip_outputs(ranking: Sequence[tuple[str, float, str]]) -> list[OutputTensor]:
    """A replica's ranking as the three output tensors (the same top-N as ``/v1/rank``)."""
    return [
        OutputTensor(
            "candidate_ids", "BYTES", np.array([c.encode() for c, _, _ in ranking], dtype=object)
        ),
        OutputTensor("scores", "FP32", np.array([s for _, s, _ in ranking], dtype=np.float32)),
        OutputTensor(
            "labels", "BYTES", np.array([lb.encode() for _, _, lb in ranking], dtype=object)
        ),
    ]


def _finite_or_missing(row: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else v for v in row.tolist()]


@dataclass(frozen=True)
class RankTensors:
    """How a ranking family's request reads as Open Inference Protocol tensors: the items'
    features as one ``FP32 [items, width]`` tensor (NaN: missing), their ids as an optional
    ``BYTES [items]`` tensor (default "0", "1", ...), a per-request feature vector where the
    family has one, and the rest (user, session, top_n, the context fields) as request
    parameters. ``body`` builds the family's ``/v1/rank`` body from them, so the family's own
    validation applies unchanged; ``field`` says where a body field came from."""

    item_list: str  # the body's list of items ("candidates", "items")
    item_width: int
    context: ContextSpec
    # A per-request vector: (its tensor, the body's object holding it as ``features``, width).
    query: tuple[str, str, int] | None = None

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        specs = [
            TensorSpec("features", "FP32", (-1, self.item_width)),
            TensorSpec("candidate_ids", "BYTES", (-1,), optional=True),
        ]
        if self.query is not None:
            specs.append(TensorSpec(self.query[0], "FP32", (self.query[2],)))
        return tuple(specs)

    def _tensor(
        self, tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]
    ) -> np.ndarray:
        array = tensors.get(name)
        where = f"inputs.{name}"
        if array is None:
            raise RequestInvalid(where, "missing")
        if array.dtype != np.float32:
            raise RequestInvalid(where, f"expected datatype FP32, got {array.dtype}")
        if len(shape) != array.ndim or any(
            w not in (-1, s) for w, s in zip(shape, array.shape, strict=True)
        ):
            raise RequestInvalid(
                where, f"shape {list(array.shape)}, expected {list(shape)} (-1: any)"
            )
        infinite = np.argwhere(np.isinf(array))
        if infinite.size:
            where = f"{where}[{infinite[0][0]}]" if array.ndim > 1 else where
            raise RequestInvalid(where, "not finite (NaN marks a missing value; inf is refused)")
        return array

    def body(
        self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The family's ``/v1/rank`` body; RequestInvalid names a tensor or parameter."""
        known = {spec.name for spec in self.inputs}
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise RequestInvalid(
                "inputs", f"unknown inputs {unknown} (known: {', '.join(sorted(known))})"
            )
        allowed = {*RANK_PARAMETERS, *self.context.order}
        stray = sorted(set(parameters) - allowed - PROTOCOL_PARAMETERS)
        if stray:
            raise RequestInvalid(
                "parameters", f"unknown parameters {stray} (known: {', '.join(sorted(allowed))})"
            )
        features = self._tensor(tensors, "features", (-1, self.item_width))
        ids_tensor = tensors.get("candidate_ids")
        if ids_tensor is None:
            ids = [str(i) for i in range(len(features))]
        else:
            if ids_tensor.dtype != object or ids_tensor.shape != (len(features),):
                raise RequestInvalid(
                    "inputs.candidate_ids",
                    f"expected BYTES of shape [{len(features)}] (one per row of features)",
                )
            try:
                ids = [bytes(v).decode("utf-8") for v in ids_tensor.tolist()]
            except UnicodeDecodeError:
                raise RequestInvalid("inputs.candidate_ids", "ids must be UTF-8") from None
        body: dict[str, Any] = {
            self.item_list: [
                {"id": cid, "features": _finite_or_missing(row)}
                for cid, row in zip(ids, features, strict=True)
            ],
            # Every row scored and ranked unless the client asks for fewer.
            "top_n": parameters.get("top_n", max(1, len(ids))),
        }
        for key in ("user_id", "session_id"):
            if key in parameters:
                body[key] = parameters[key]
        context = {k: parameters[k] for k in self.context.order if k in parameters}
        if context:
            body["context"] = context
        if self.query is not None:
            name, holder, width = self.query
            vector = self._tensor(tensors, name, (width,))
            body[holder] = {"features": _finite_or_missing(vector)}
        return body

    def field(self, body_field: str) -> str:
        """Where a field of the body came from: ``candidates[3].features`` ->
        ``inputs.features[3]``, ``context.surface`` -> ``parameters.surface``."""
        head, _, rest = body_field.partition(".")
        if head.startswith(f"{self.item_list}["):
            index = head[len(self.item_list) :]
            tensor = "candidate_ids" if rest == "id" else "features"
            return f"inputs.{tensor}{index}"
        if head == "context" and rest:
            return f"parameters.{rest}"
        if head in RANK_PARAMETERS:
            return f"parameters.{head}"
        if self.query is not None and head == self.query[1]:
            return f"inputs.{self.query[0]}"
        return body_field
