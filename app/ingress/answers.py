"""The ingress core's HTTP answers, without Starlette: a status, a JSON body, headers.

The Serve shell turns an ``HttpAnswer`` into a Starlette ``Response`` as it is; the bodies
are written with ``json.dumps`` (the bytes the service has always sent).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from app.api import RankResponse
from app.contracts import ModelMeta

JSON: Final = "application/json"


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: str | bytes  # JSON text; bytes where the protocol carries binary tensors
    headers: dict[str, str] | None = None
    # The request's body was left unread: the connection cannot carry another request. Set
    # after the other headers, where the shell has always added it.
    close_connection: bool = False
    media_type: str = JSON


def json_answer(status: int, payload: Any, headers: dict[str, str] | None = None) -> HttpAnswer:
    return HttpAnswer(status, json.dumps(payload), headers)


# The answer to a request a cohort answered: (the model that answered, its ranking, whether
# it failed over, whether the cohort is shown) -> the HTTP answer, in the request's protocol
# (``rank_answer`` for ``/v1/rank``; app.ingress.oip_endpoint for the Open Inference Protocol).
BuildAnswer = Callable[[ModelMeta, Sequence[tuple[str, float, str]], bool, bool], HttpAnswer]


def rank_answer(
    meta: ModelMeta, ranking: Sequence[tuple[str, float, str]], failover: bool, reveal: bool
) -> HttpAnswer:
    """The ``/v1/rank`` answer (``RankResponse``)."""
    text, headers = RankResponse.encode(meta, ranking, failover=failover, reveal_cohort=reveal)
    return HttpAnswer(200, text, headers)
