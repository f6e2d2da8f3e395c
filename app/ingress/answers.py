"""The ingress core's HTTP answers, without Starlette: a status, a JSON body, headers.

The Serve shell turns an ``HttpAnswer`` into a Starlette ``Response`` as it is; the bodies
are written with ``json.dumps`` (the bytes the service has always sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

JSON: Final = "application/json"


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: str  # JSON text
    headers: dict[str, str] | None = None
    # The request's body was left unread: the connection cannot carry another request. Set
    # after the other headers, where the shell has always added it.
    close_connection: bool = False


def json_answer(status: int, payload: Any, headers: dict[str, str] | None = None) -> HttpAnswer:
    return HttpAnswer(status, json.dumps(payload), headers)
