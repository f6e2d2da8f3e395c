"""The ``rollout`` command: its group of commands, and ``main``, which runs it.

Exit codes (scripts key on them): the table of ``rollout/cli/exit_codes.py``.
Errors print one line, ``error[<category>]: <message>`` (``rejected: <category>: <detail>`` for
artifacts), never a traceback. Only ``rollout controller start`` and ``rollout start`` create
the controller; every other command that talks to the cluster needs one running (exit 5) and
gives up after ``--timeout`` seconds (exit 7).

The commands live one family to a module: ``artifacts`` (pack, verify, replay, keygen,
make-demo-artifacts), ``operate`` (the controller and the rollouts), ``registry`` (``rollout
registry ...``, imported when named) and the demo (``rollout.local.demo``, imported when named).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Final

import click
from pydantic import ValidationError

from app.contracts import clip_text
from app.errors import ArtifactRejected, RolloutSystemError
from app.safe_text import redact_in, terminal_safe
from rollout.cli import artifacts, operate
from rollout.cli.exit_codes import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    error_line,
    exit_code_for,
)


class _Commands(click.Group):
    """The CLI's commands; the groups that live in modules of their own are imported when
    named (the demo's, with the artifact store's HTTP clients, would cost every other command a
    fifth of a second: CI scripts and shells call this binary often)."""

    LAZY: Final = {
        "demo": ("rollout.local.demo", "demo_command"),
        "registry": ("rollout.cli.registry", "registry_group"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY and cmd_name not in self.commands:
            module, attribute = self.LAZY[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ray-rollout", prog_name="rollout")
def cli() -> None:
    """Zero-downtime model rollouts on Ray Serve."""


# The families loaded with the group (LAZY names those imported when named).
for _command in (*artifacts.COMMANDS, *operate.COMMANDS):
    cli.add_command(_command)


# Environment variables whose values may carry credentials (a registry URL, an address).
_CREDENTIAL_ENV: Final = ("ROLLOUT_DB", "RAY_ADDRESS")


def _credentials_in(argv: Sequence[str]) -> tuple[str, ...]:
    """The command-line and environment values that may carry a credential (URIs, libpq
    ``key=value`` strings): no error line shows their secrets, whatever raised it."""
    values = [*argv, *(os.environ.get(name, "") for name in _CREDENTIAL_ENV)]
    return tuple(value for value in values if "://" in value or "=" in value)


def _say(line: str, credentials: Sequence[str] = ()) -> None:
    """One line on stderr, without the secrets of ``credentials``, capped, and safe for a
    terminal (an error may quote a file name, a URI or a driver's message)."""
    shown = redact_in(" ".join(line.split()), *credentials)
    click.echo(terminal_safe(clip_text(shown) or ""), err=True)


def main(argv: Sequence[str] | None = None) -> int:
    credentials = _credentials_in(list(argv) if argv is not None else sys.argv[1:])

    def say(line: str) -> None:
        _say(line, credentials)

    try:
        # Without standalone mode click returns what a command passed to ``ctx.exit`` (the
        # registry commands and the demo end that way) instead of exiting: it is the code.
        code = cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_USAGE
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE
    except ArtifactRejected as exc:
        say(f"rejected: {exc.category}: {exc.detail}")
        return EXIT_REJECTED
    except RolloutSystemError as exc:
        # Raised inside the controller actor, it arrives as Ray's RayTaskError subclass of
        # the same type, whose str() carries the remote traceback: show the cause's message.
        # Its ``message`` is the text without the category, which error_line puts first.
        cause = getattr(exc, "cause", None)
        source = cause if isinstance(cause, RolloutSystemError) else exc
        message = getattr(source, "message", None) or str(source)
        say(error_line(exc.category, message))
        return exit_code_for(exc)
    except OSError as exc:
        say(f"error[io]: {exc}")
        return EXIT_UNEXPECTED
    except ValidationError as exc:
        # An answer of the controller that this CLI's contracts do not read (another version).
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        say(f"error[contract]: {exc.title}.{where}: {first.get('msg')}")
        return EXIT_UNEXPECTED
    except Exception as exc:
        # A bug, or a foreign error no boundary translated: still one line, never a
        # traceback (the type names it for a bug report).
        say(f"error[internal]: {type(exc).__name__}: {exc}")
        return EXIT_UNEXPECTED
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
