"""The Open Inference Protocol routes of the router (``/v2/...``), over the ingress core.

A request to ``POST /v2/models/{name}/infer`` goes the way of a ``/v1/rank`` request:
admitted under the same bounds, bucketed by its user, routed by weight, failed over, counted
in the judged metrics and offered for mirroring; only its body (tensors, ``app.ingress.oip``)
and its answer differ. ``{name}`` is the served family's name (``ranker-mlp``); the answer's
``model_version`` is the artifact that answered, and its ``parameters`` carry the tags a
``/v1/rank`` answer carries in ``model`` (``artifact_id``, ``revision``, ``runtime_build``,
``replica``, ``backbone_artifact_id`` for a head, ``cohort`` where revealed, ``failover``),
with the same ``X-Model-*`` headers.

The user a request is bucketed by is its ``user_id`` parameter; without one, its ``id`` (a
client that numbers its requests spreads them over the cohorts by weight, each request on
its own); with neither, it is routed by weight at random, as a ``/v1/rank`` request without a
user is.

Errors are answered as the protocol has them, ``{"error": "<reason>: <field>: <detail>"}``
(the field also under ``field``, as on ``/v1/rank``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import replace
from typing import Any, Final

from app.contracts import ModelMeta
from app.errors import RequestInvalid
from app.ingress.answers import HttpAnswer, json_answer
from app.ingress.core import IngressCore
from app.ingress.oip import InferRequest, decode_infer, encode_infer, model_metadata
from app.model_family import ParsedRequest
from app.tasks.rank import OIP_OUTPUTS, oip_outputs

PLATFORM: Final = "ray-serve-rollout"
# What the router speaks of the protocol's optional parts.
EXTENSIONS: Final = ("binary_tensor_data",)


def protocol_path(path: str) -> str | None:
    """The part of a request's path from ``/v2`` on (below the app's route prefix), or None
    for a path outside the protocol."""
    at = path.find("/v2/")
    if at < 0 and (path == "/v2" or path.endswith("/v2")):
        at = len(path) - 3
    return path[at:] if at >= 0 else None


def _protocol_error(answer: HttpAnswer) -> HttpAnswer:
    """An error answer of the core as the protocol words it: the reason and detail in
    ``error``; the other fields (``field``, ``limit_bytes``) kept."""
    if answer.status < 400:
        return answer
    payload = json.loads(answer.body)
    reason = payload.pop("error", "error")
    detail = payload.pop("detail", "")
    # A client library shows the message alone: the field goes into it too.
    if "field" in payload and detail:
        detail = f"{payload['field']}: {detail}"
    message = f"{reason}: {detail}" if detail else str(reason)
    out = json_answer(answer.status, {"error": message, **payload}, answer.headers)
    return replace(out, close_connection=answer.close_connection)


class OipEndpoint:
    def __init__(self, core: IngressCore, model_name: str) -> None:
        self.core = core
        self.model_name = model_name
        self.mapping = core.schema.oip

    def _not_found(self, detail: str) -> HttpAnswer:
        return json_answer(404, {"error": f"not_found: {detail}"})

    def _model(self, name: str) -> HttpAnswer | None:
        """None for the served model, else the 404 naming it."""
        if name == self.model_name:
            return None
        return self._not_found(f"no model {name!r}; this service serves {self.model_name!r}")

    async def handle(
        self,
        method: str,
        path: str,
        headers: Callable[[str], str | None],
        chunks: AsyncIterable[bytes],
    ) -> HttpAnswer:
        """One request whose path is at or below ``/v2`` (after the app's route prefix)."""
        parts = [p for p in path.split("/") if p]
        if parts[:1] != ["v2"]:
            return self._not_found(f"no route {path}")
        rest = parts[1:]
        if method == "POST":
            if len(rest) in (3, 5) and rest[0] == "models" and rest[-1] == "infer":
                # /v2/models/{name}[/versions/{version}]/infer: one version is served (the
                # weights decide which artifact answers), so a version is not a selector.
                missing = self._model(rest[1])
                if missing is not None:
                    return missing
                return await self.infer(
                    headers("content-length"),
                    chunks,
                    headers("inference-header-content-length"),
                    headers("x-ranker-cohort"),
                )
            return json_answer(405, {"error": "method_not_allowed: use GET"})
        if method != "GET":
            return json_answer(405, {"error": "method_not_allowed: use GET or POST"})
        if not rest:
            return json_answer(
                200, {"name": PLATFORM, "version": "2", "extensions": list(EXTENSIONS)}
            )
        if rest == ["health", "live"]:
            return json_answer(200, {"live": True})
        if rest == ["health", "ready"]:
            return _protocol_error(await self.core.readiness())
        if rest[0] == "models" and len(rest) >= 2:
            missing = self._model(rest[1])
            if missing is not None:
                return missing
            tail = rest[2:]
            if tail[:1] == ["versions"] and len(tail) >= 2:
                tail = tail[2:]
            if not tail:
                return json_answer(
                    200,
                    model_metadata(self.model_name, (), self.mapping.inputs, OIP_OUTPUTS),
                )
            if tail == ["ready"]:
                ready = await self.core.readiness()
                if ready.status != 200:
                    return _protocol_error(ready)
                return json_answer(200, {"name": self.model_name, "ready": True})
        return self._not_found(f"no route {path}")

    async def infer(
        self,
        content_length: str | None,
        chunks: AsyncIterable[bytes],
        header_length: str | None,
        cohort_header: str | None,
    ) -> HttpAnswer:
        decoded: list[InferRequest] = []
        known_outputs = {spec.name for spec in OIP_OUTPUTS}

        def parse(raw: bytes) -> ParsedRequest:
            request = decode_infer(raw, header_length)
            unknown = sorted(set(request.outputs or ()) - known_outputs)
            if unknown:
                raise RequestInvalid(
                    "outputs", f"unknown outputs {unknown} (known: {', '.join(known_outputs)})"
                )
            decoded.append(request)
            body = self.mapping.body(request.inputs, request.parameters)
            try:
                parsed = self.core.schema.parse(json.dumps(body).encode())
            except RequestInvalid as exc:
                raise RequestInvalid(self.mapping.field(exc.field), exc.detail) from None
            if parsed.user_id is None and parsed.session_id is None and request.id:
                # Bucketed by the request's id where it names no user (see the docstring).
                parsed = replace(parsed, user_id=f"oip-request:{request.id}")
            return parsed

        def build(
            meta: ModelMeta,
            ranking: Sequence[tuple[str, float, str]],
            failover: bool,
            reveal: bool,
        ) -> HttpAnswer:
            parameters: dict[str, Any] = {
                "artifact_id": meta.artifact_id,
                "revision": meta.revision,
                "runtime_build": meta.runtime_build,
                "replica": meta.replica,
                "failover": failover,
            }
            headers = {
                "X-Model-Artifact": meta.artifact_id,
                "X-Model-Revision": str(meta.revision),
            }
            if meta.backbone is not None:
                parameters["backbone_artifact_id"] = meta.backbone
                headers["X-Model-Backbone"] = meta.backbone
            if reveal:
                parameters["cohort"] = meta.cohort
                headers["X-Model-Cohort"] = meta.cohort
            return encode_infer(
                model_name=self.model_name,
                model_version=meta.artifact_id,
                request=decoded[0],
                outputs=oip_outputs(ranking),
                parameters=parameters,
                headers=headers,
            )

        answer = await self.core.serve(content_length, chunks, cohort_header, parse, build)
        return _protocol_error(answer)
