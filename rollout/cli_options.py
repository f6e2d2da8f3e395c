"""Validated options shared by the ``rollout`` commands (``rollout/cli.py``,
``rollout/registry_cli.py``): what reaches a command is in range and printable, and a bad value
is a usage error (exit 2) that names the option, never a traceback from deeper down (an
``OverflowError`` of the database driver, a ``ValueError`` of the registry)."""

from __future__ import annotations

import getpass
import math
import os
from typing import Any, Final

import click

from app.contracts import MAX_TEXT
from app.safe_text import terminal_safe

MAX_REASON: Final = MAX_TEXT  # what a rollout event and an audit row keep
MAX_ACTOR: Final = 200  # a Name of the contracts
# The largest integer either registry backend stores (SQLite and PostgreSQL BIGINT).
MAX_DB_INT: Final = 2**63 - 1
MAX_LIST_LIMIT: Final = 10_000  # rows a listing returns at most


class Seconds(click.FloatRange):
    """A duration in seconds within a range, refusing ``nan`` too (which every comparison
    lets through); ``--help`` shows it as SECONDS."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        converted = super().convert(value, param, ctx)
        if math.isnan(converted):
            self.fail(f"{value!r} is not a number", param, ctx)
        return converted


LIST_LIMIT: Final = click.IntRange(min=1, max=MAX_LIST_LIMIT)
REVISION: Final = click.IntRange(min=0, max=MAX_DB_INT)


def _one_line(text: str, what: str, limit: int) -> str:
    value = text.strip()
    if not value:
        raise click.BadParameter(f"must not be empty (say {what})")
    if len(value) > limit:
        raise click.BadParameter(f"at most {limit} characters, got {len(value)}")
    if terminal_safe(value) != value:
        raise click.BadParameter("must be one line of printable text (no control characters)")
    return value


def check_reason(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A given ``--reason`` is one non-empty printable line; absent stays None (unless the
    option is required: click 8.3 lets an explicit ``default=None`` satisfy ``required``)."""
    if value is None:
        if param.required:
            raise click.MissingParameter(param=param)
        return None
    return _one_line(value, "why", MAX_REASON)


def check_actor(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    return _one_line(value, "who", MAX_ACTOR)


def default_actor() -> str:
    """``$ROLLOUT_ACTOR``, else the login name."""
    try:
        return os.environ.get("ROLLOUT_ACTOR") or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def reason_option(*, required: bool = False, help_text: str = "Why (recorded).") -> Any:
    """The ``--reason`` option (a decorator)."""
    return click.option(
        "--reason", default=None, required=required, callback=check_reason, help=help_text
    )


actor_option = click.option(
    "--actor",
    default=default_actor,
    callback=check_actor,
    show_default="$ROLLOUT_ACTOR or the login name",
    help="Who does this (recorded).",
)
