"""Offline replay: a set of rank requests through a baseline and a candidate model, compared
as the router compares a mirrored request live.

Each request takes the replicas' own path: the HTTP body is validated by the request schema
of the models' family (``app.model_family.RequestSchema.parse``, as the router validates
it), which gives the ``WireRequest`` the router hands a replica, and ranked by a loaded
model (``app.loading.model.LoadedModel.rank_batch``).
The two answers are compared with ``app.divergence.compare_rankings`` and added up in a
``DivergenceTotals``, the very comparison and totals of the shadow phase (``app.ingress.shadow``);
``expected_divergence`` turns the totals into the ``metadata.expected_divergence`` block a
candidate's manifest carries (``rollout replay`` writes it, ``rollout pack
--expected-divergence`` embeds it).

Requests come from the live load's own generator (``generated_requests``:
``app.request_bodies``) or from a file of JSON lines, one ``POST /v1/rank`` body a line
(``requests_file``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from app.api import MAX_BODY_BYTES
from app.contracts import DEFAULT_FEATURE_SCHEMA, ExpectedDivergence, WireRequest
from app.divergence import (
    DEFAULT_RBO_P,
    DEFAULT_TOP_K,
    DivergenceTotals,
    compare_rankings,
    quantile,
)
from app.errors import ConfigError, RequestInvalid
from app.preprocessing import RankedCandidate
from app.request_bodies import DEFAULT_CANDIDATES, DEFAULT_SEED, DEFAULT_TOP_N, rank_bodies

if TYPE_CHECKING:
    from app.model_family import RequestSchema

DEFAULT_REQUESTS: Final = 2000
MAX_GENERATED: Final = 1_000_000
# Requests ranked in one forward of each model (a replica's batch is of this order).
REPLAY_BATCH: Final = 64
# Decimals the measured figures are recorded with: rounding noise of another machine's
# kernels stays below them, so the block (and the manifest it is packed into) keeps its bytes.
RECORDED_DECIMALS: Final = 4


class Ranker(Protocol):
    """What replay needs of a model: ``app.loading.model.LoadedModel``'s batch ranking."""

    artifact_id: str

    def rank_batch(self, requests: Sequence[WireRequest]) -> list[list[RankedCandidate]]: ...


def _schema(schema: RequestSchema | None) -> RequestSchema:
    if schema is None:
        from app.models.ranker_mlp.features import SCHEMA

        return SCHEMA
    return schema


def wire_request(
    body: bytes | Mapping[str, Any], schema: RequestSchema | None = None
) -> WireRequest:
    """A rank body (its JSON bytes, or the object) validated as the router validates it with
    ``schema`` (default: ``ranker-features-v3``) and turned into what a replica gets;
    RequestInvalid names the first bad field."""
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return _schema(schema).parse(raw).wire


@dataclass(frozen=True)
class RequestSet:
    """Requests to replay: ``count`` of them, and where they came from (the block's
    ``source``). Iterating yields them anew each time, validated as they are read."""

    source: str
    count: int
    _read: Callable[[], Iterator[WireRequest]]

    def __iter__(self) -> Iterator[WireRequest]:
        return self._read()


def generated_requests(
    count: int = DEFAULT_REQUESTS,
    *,
    seed: int = DEFAULT_SEED,
    candidates: int = DEFAULT_CANDIDATES,
    top_n: int = DEFAULT_TOP_N,
    schema: RequestSchema | None = None,
) -> RequestSet:
    """``count`` bodies of the live load's generator (``app.request_bodies.rank_bodies``)
    of ``schema``, each through its validation."""
    if not 1 <= count <= MAX_GENERATED:
        raise ConfigError(
            f"generated requests: {count} is not in [1, {MAX_GENERATED}]", field="generated"
        )
    shape = ""
    if (candidates, top_n) != (DEFAULT_CANDIDATES, DEFAULT_TOP_N):
        shape = f", {candidates} candidates, top_n {top_n}"
    schema = _schema(schema)
    source = f"generated: {count} requests, seed {seed}{shape}"
    if schema.name != DEFAULT_FEATURE_SCHEMA:
        source += f", {schema.name}"

    def read() -> Iterator[WireRequest]:
        bodies = rank_bodies(count, seed=seed, candidates=candidates, top_n=top_n, schema=schema)
        for body in bodies:
            yield wire_request(body, schema)

    return RequestSet(source, count, read)


def _file_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, body) of every non-blank line; a line over the API's body limit is
    refused before more of it is read."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, also when the reader stops
    except OSError as exc:
        raise ConfigError(
            f"requests file {path}: {exc.strerror or exc}", field="requests"
        ) from None
    with handle:
        number = 0
        while True:
            line = handle.readline(MAX_BODY_BYTES + 2)  # room for the line's own \r\n
            if not line:
                return
            number += 1
            body = line.rstrip(b"\r\n")
            if len(body) > MAX_BODY_BYTES:
                raise ConfigError(
                    f"requests file {path}, line {number}: body: over the limit of "
                    f"{MAX_BODY_BYTES} bytes",
                    field="body",
                    line=number,
                )
            if body.strip():
                yield number, body


def _file_requests(path: Path, schema: RequestSchema | None) -> Iterator[WireRequest]:
    for number, body in _file_lines(path):
        try:
            yield wire_request(body, schema)
        except RequestInvalid as exc:
            raise ConfigError(
                f"requests file {path}, line {number}: {exc.field}: {exc.detail}",
                field=exc.field,
                line=number,
            ) from None


def requests_file(path: Path | str, schema: RequestSchema | None = None) -> RequestSet:
    """The requests of a JSON-lines file, one ``POST /v1/rank`` body a line (blank lines are
    skipped). Every line is validated here, before anything is replayed (and again as it is
    replayed): ConfigError names the file, the line number and the field."""
    path = Path(path)
    count = sum(1 for _ in _file_requests(path, schema))
    if count == 0:
        raise ConfigError(f"requests file {path}: holds no requests", field="requests")
    return RequestSet(
        f"requests file {path.name}: {count} requests", count, lambda: _file_requests(path, schema)
    )


def _batches(requests: Iterable[WireRequest], size: int) -> Iterator[list[WireRequest]]:
    batch: list[WireRequest] = []
    for request in requests:
        batch.append(request)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def replay(
    baseline: Ranker,
    candidate: Ranker,
    requests: Iterable[WireRequest],
    *,
    top_k: int = DEFAULT_TOP_K,
    rbo_p: float = DEFAULT_RBO_P,
    batch_size: int = REPLAY_BATCH,
    on_batch: Callable[[int], None] | None = None,
) -> DivergenceTotals:
    """Rank every request with both models and add up the comparisons, the baseline in the
    place of stable (``compare_rankings(stable=baseline's, canary=candidate's)``).
    ``on_batch(n)`` is called after each batch of ``n`` requests (progress)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    totals = DivergenceTotals()
    for batch in _batches(requests, batch_size):
        stable = baseline.rank_batch(batch)
        canary = candidate.rank_batch(batch)
        for a, b in zip(stable, canary, strict=True):
            totals.add(
                compare_rankings(
                    [(c.id, c.score) for c in a],
                    [(c.id, c.score) for c in b],
                    top_k=top_k,
                    rbo_p=rbo_p,
                )
            )
        if on_batch is not None:
            on_batch(len(batch))
    return totals


def _recorded(value: float) -> float:
    return round(min(1.0, max(0.0, float(value))), RECORDED_DECIMALS)


def expected_divergence(
    totals: DivergenceTotals,
    *,
    baseline_artifact_id: str,
    baseline_manifest_sha256: str,
    top_k: int = DEFAULT_TOP_K,
    rbo_p: float = DEFAULT_RBO_P,
    source: str = "",
) -> ExpectedDivergence:
    """The ``metadata.expected_divergence`` block of what ``totals`` measured: the means
    rounded to 4 decimals, the p99 of the largest score difference clamped to [0, 1] (scores
    are probabilities) and rounded too. ConfigError when nothing was compared or a field is
    out of its range (named)."""
    if totals.compared == 0:
        raise ConfigError("replay: no requests were compared", field="requests")
    assert totals.rbo_mean is not None and totals.overlap_mean is not None
    assert totals.top1_change_rate is not None
    return ExpectedDivergence.parse(
        {
            "baseline_artifact_id": baseline_artifact_id,
            "baseline_manifest_sha256": baseline_manifest_sha256,
            "requests": totals.compared,
            "top_k": top_k,
            "rbo_p": rbo_p,
            "rbo_mean": _recorded(totals.rbo_mean),
            "overlap_mean": _recorded(totals.overlap_mean),
            "top1_change_rate": _recorded(totals.top1_change_rate),
            "max_score_diff_p99": _recorded(quantile(totals.score_diffs, 0.99)),
            "source": source,
        },
        where="expected_divergence",
    )


def replay_expectation(
    baseline: Ranker,
    candidate: Ranker,
    requests: RequestSet,
    *,
    baseline_manifest_sha256: str,
    top_k: int = DEFAULT_TOP_K,
    rbo_p: float = DEFAULT_RBO_P,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[ExpectedDivergence, DivergenceTotals]:
    """``replay`` then ``expected_divergence``: the block, with the baseline's id and the
    requests' source, and the unrounded totals."""
    totals = replay(baseline, candidate, requests, top_k=top_k, rbo_p=rbo_p, on_batch=on_batch)
    block = expected_divergence(
        totals,
        baseline_artifact_id=baseline.artifact_id,
        baseline_manifest_sha256=baseline_manifest_sha256,
        top_k=top_k,
        rbo_p=rbo_p,
        source=requests.source,
    )
    return block, totals


def block_json(block: ExpectedDivergence) -> str:
    """The block as the file ``rollout pack --expected-divergence`` reads (stable bytes)."""
    return json.dumps(block.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
