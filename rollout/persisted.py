"""How the rollout's state and the dataclasses it holds are written and read.

Pure module. Each type is written and read by a pydantic ``TypeAdapter`` of that type (the
state's is ``RolloutState``'s, which covers everything the state holds); what the JSON cannot
say as it stands (a ruled-out alternative's -inf, the schema version, older versions' shapes)
is declared on the dataclasses themselves. Adapters are built on first use: the CLI imports
the state's modules without ever reading a state.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

from pydantic import TypeAdapter

Stored = TypeVar("Stored")


@cache
def adapter(kind: type[Stored]) -> TypeAdapter[Stored]:
    return TypeAdapter(kind)


def written(value: object) -> Any:
    """``value`` as the registry stores it: JSON-ready data. Floats are handed on as they
    are (a field that holds -inf declares how it is written), as the state always was."""
    return adapter(type(value)).dump_python(value, mode="json")


def read(kind: type[Stored], data: Any) -> Stored:
    """Stored ``data`` as a ``kind``; ValueError (a pydantic ValidationError) naming what
    does not read."""
    return adapter(kind).validate_python(data)


def stored_copy(value: Stored) -> Stored:
    """``value`` written and read back: a copy that shares nothing with it, exactly as a
    restarted controller reads it (every process' alternatives recorded)."""
    return read(type(value), written(value))
