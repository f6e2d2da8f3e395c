"""Validated options shared by the ``rollout`` commands (``rollout/cli/artifacts.py``,
``operate.py``, ``registry.py``): what reaches a command is in range and printable, and a bad
value is a usage error (exit 2) that names the option, never a traceback from deeper down (an
``OverflowError`` of the database driver, a ``ValueError`` of the registry)."""

from __future__ import annotations

import getpass
import math
import os
from typing import Any, Final

import click
from pydantic import ValidationError

from app.contracts import MAX_TEXT, KeylessSigner, SignatureTrust
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


def check_signature_file(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """A plain file name that the artifact format does not reserve (usage error otherwise)."""
    try:
        return SignatureTrust(signature_file=value).signature_file
    except ValidationError as exc:
        raise click.BadParameter(str(exc.errors(include_url=False)[0]["msg"])) from None


_TRUST_PARAMS: Final = (
    "trust_keys",
    "trust_cert_chains",
    "trust_cert_identities",
    "trust_identities",
    "trust_issuers",
    "sigstore_trust_config",
    "signature_file",
)


def trust_options(func: Any) -> Any:
    """The ``--trust-*`` options of the commands that check signatures (``verify``,
    ``registry register``); the command receives them as one ``trust`` (a SignatureTrust)."""
    existing = click.Path(exists=True, dir_okay=False)
    options = [
        click.option(
            "--trust-key",
            "trust_keys",
            multiple=True,
            type=existing,
            help="A public key (PEM) artifacts may be signed with: ed25519 (the project's "
            "signature) or EC P-256/384/521 (OpenSSF key mode). Repeatable.",
        ),
        click.option(
            "--trust-cert-chain",
            "trust_cert_chains",
            multiple=True,
            type=existing,
            help="CA certificates (PEM) an OpenSSF certificate-mode signature must chain to.",
        ),
        click.option(
            "--trust-cert-identity",
            "trust_cert_identities",
            multiple=True,
            help="With --trust-cert-chain: the signer its signing certificate must name (an "
            "e-mail, URI or DNS name among its SANs, or its subject as 'CN=...,O=...'). "
            "Repeatable: any one of them.",
        ),
        click.option(
            "--trust-identity",
            "trust_identities",
            multiple=True,
            help="A Sigstore keyless signer's identity (with --trust-issuer). Repeatable.",
        ),
        click.option(
            "--trust-issuer",
            "trust_issuers",
            multiple=True,
            help="The OIDC issuer of the --trust-identity at the same position.",
        ),
        click.option(
            "--sigstore-trust-config",
            type=existing,
            default=None,
            help="A Sigstore ClientTrustConfig JSON to check keyless signatures offline "
            "(default: Sigstore's public-good instance, online).",
        ),
        click.option(
            "--signature-file",
            default="model.sig",
            show_default=True,
            callback=check_signature_file,
            help="Where an OpenSSF signature lies in the artifact directory.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def trust_from_options(params: dict[str, Any]) -> SignatureTrust:
    """The ``--trust-*`` values of a command's ``params`` as a SignatureTrust; a bad
    combination is a usage error naming the option."""
    values = {name: params[name] for name in _TRUST_PARAMS}
    identities, issuers = values["trust_identities"], values["trust_issuers"]
    if len(identities) != len(issuers):
        raise click.BadParameter(
            f"{len(identities)} identities and {len(issuers)} issuers: give one --trust-issuer "
            "per --trust-identity",
            param_hint="--trust-issuer",
        )
    if values["trust_cert_identities"] and not values["trust_cert_chains"]:
        raise click.BadParameter(
            "names the signer of a certificate chain: give --trust-cert-chain too",
            param_hint="--trust-cert-identity",
        )
    try:
        keyless = [
            KeylessSigner(identity=identity, oidc_issuer=issuer)
            for identity, issuer in zip(identities, issuers, strict=True)
        ]
        return SignatureTrust(
            keys=list(values["trust_keys"]),
            certificate_chains=list(values["trust_cert_chains"]),
            certificate_identities=list(values["trust_cert_identities"]),
            keyless=keyless,
            sigstore_trust_config=values["sigstore_trust_config"],
            signature_file=values["signature_file"],
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = str(first["loc"][0]) if first.get("loc") else "trust"
        hint = {
            "certificate_identities": "--trust-cert-identity",
            "identity": "--trust-identity",
            "oidc_issuer": "--trust-issuer",
            "signature_file": "--signature-file",
        }.get(where, "--trust-*")
        raise click.BadParameter(str(first.get("msg")), param_hint=hint) from None
