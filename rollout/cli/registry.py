"""``rollout registry ...``: the model registry from the command line.

Tables for people by default, ``--json`` for scripts. Exit codes: the one table of
``rollout/cli/exit_codes.py`` (3 rejected, 4 conflict, 5 not found / invalid state / schema to
migrate, 6 configuration, 7 out of reach). Only ``init`` (creates) and ``migrate`` change a
database's schema; the other commands need it there and current, and reads open it read-only.

Errors print ``error[<category>]: <message>`` on stderr (and, with ``--json``, an object with
``error``, ``message`` and, for a conflict, ``current`` on stdout), never a traceback, with
the registry URL's secrets masked and control characters escaped. Manifest URIs are shown
redacted (a presigned URL's signature is a credential).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from app.contracts import COHORTS, Target
from app.errors import (
    ArtifactRejected,
    ConfigError,
    InvalidState,
    RevisionConflict,
    RolloutSystemError,
)
from app.manifest import Manifest, is_sha256_hex
from app.registry import (
    DEFAULT_REGISTRY_URL,
    ArtifactRecord,
    AuditEntry,
    Registry,
    TargetRecord,
    open_registry,
)
from app.registry.base import ArtifactAuditEntry, RegistryAccess
from app.safe_text import redact_in, redact_uri, terminal_safe
from rollout.cli.exit_codes import EXIT_REJECTED, error_line, exit_code_for
from rollout.cli.options import (
    LIST_LIMIT,
    REVISION,
    actor_option,
    check_reason,
    reason_option,
    trust_from_options,
    trust_options,
)


@dataclass
class _Session:
    ctx: click.Context
    db_url: str
    model: str
    env: str
    as_json: bool
    _registry: Registry | None = field(default=None, repr=False)
    # URIs whose secrets an error of this command must not show (the registry URL, a
    # manifest URI given to it).
    secret_uris: list[str] = field(default_factory=list)

    def open(self, access: RegistryAccess) -> Registry:
        """The registry, opened on first use (so `--help` never touches a database) with the
        access the command needs: only `init` and `migrate` create or change a schema."""
        if self._registry is None:
            self._registry = open_registry(self.db_url, access=access)
            self.ctx.call_on_close(self._registry.close)
        return self._registry

    @property
    def reader(self) -> Registry:
        return self.open("read")

    @property
    def writer(self) -> Registry:
        return self.open("write")


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    # Values come from manifests and users: escaped, so none can drive the terminal.
    cells = [[("-" if v is None else terminal_safe(str(v))) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        click.echo("(none)")


def _print_json(payload: Any) -> None:
    click.echo(json.dumps(payload, indent=2, sort_keys=True))


def _redacted(record: dict[str, Any]) -> dict[str, Any]:
    uri = record.get("manifest_uri")
    return {**record, "manifest_uri": redact_uri(uri)} if isinstance(uri, str) else record


def _ts(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%SZ")


def _show_artifacts(session: _Session, records: Sequence[ArtifactRecord]) -> None:
    if session.as_json:
        _print_json([_redacted(r.to_dict()) for r in records])
        return
    _print_table(
        ["model", "artifact", "state", "manifest_sha256", "feature_schema", "created"],
        [
            (r.model, r.artifact_id, r.state, r.manifest_sha256[:16], r.feature_schema,
             _ts(r.created_at))
            for r in records
        ],
    )  # fmt: skip


def _show_targets(session: _Session, targets: Sequence[TargetRecord]) -> None:
    if session.as_json:
        _print_json([_redacted(t.to_dict()) for t in targets])
        return
    _print_table(
        ["cohort", "revision", "artifact", "manifest_sha256", "updated"],
        [
            (t.cohort, t.revision, t.artifact_id, t.manifest_sha256[:16], _ts(t.updated_at))
            for t in targets
        ],
    )


def _show_history(session: _Session, entries: Sequence[AuditEntry]) -> None:
    if session.as_json:
        _print_json([e.to_dict() for e in entries])
        return
    _print_table(
        ["at", "cohort", "revision", "from", "to", "actor", "reason", "approval"],
        [
            (_ts(e.at), e.cohort, f"{e.old_revision}->{e.new_revision}", e.old_artifact_id,
             e.new_artifact_id, e.actor, e.reason, e.approval)
            for e in entries
        ],
    )  # fmt: skip


class _RegistryGroup(click.Group):
    """Turns the project's typed errors into one line on stderr and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ArtifactRejected as exc:
            click.echo(_shown(ctx, f"rejected: {exc.category}: {exc.detail}"), err=True)
            _json_error(ctx, exc)
            ctx.exit(EXIT_REJECTED)
        except RolloutSystemError as exc:
            # A RevisionConflict's message names the current revision already.
            click.echo(_shown(ctx, error_line(exc.category, str(exc))), err=True)
            _json_error(ctx, exc)
            ctx.exit(exit_code_for(exc))


def _shown(ctx: click.Context, text: str) -> str:
    """An error as the terminal may show it: the registry URL's secrets masked (a driver may
    quote them), controls escaped (a file name may hold escapes), one line."""
    session = ctx.find_object(_Session)
    if session is not None:
        text = redact_in(text, session.db_url, *session.secret_uris)
    return terminal_safe(" ".join(text.split()))


def _json_error(ctx: click.Context, exc: RolloutSystemError) -> None:
    session = ctx.find_object(_Session)
    if session is None or not session.as_json:
        return
    payload: dict[str, Any] = {"error": exc.category, "message": _shown(ctx, str(exc))}
    if isinstance(exc, RevisionConflict):
        current = exc.current
        payload["current"] = current.to_dict() if hasattr(current, "to_dict") else None
    _print_json(payload)


def _check_sha256(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not is_sha256_hex(value.strip().lower()):
        raise click.BadParameter("must be 64 hex characters (the manifest's SHA-256)")
    return value.strip().lower()


@click.group("registry", cls=_RegistryGroup)
@click.option(
    "--db",
    "db_url",
    envvar="ROLLOUT_DB",
    default=DEFAULT_REGISTRY_URL,
    show_default=True,
    help="Registry URL: postgresql://... or sqlite:///path (env: ROLLOUT_DB).",
)
@click.option("--model", default="ranker", show_default=True, help="Model name.")
@click.option("--env", "env", default="default", show_default=True, help="Environment name.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")
@click.pass_context
def registry_group(ctx: click.Context, db_url: str, model: str, env: str, as_json: bool) -> None:
    """The model registry: artifacts, per-cohort targets (compare-and-set), audit history."""
    ctx.obj = _Session(ctx=ctx, db_url=db_url, model=model, env=env, as_json=as_json)


def _show_schema(session: _Session, registry: Registry) -> None:
    shown = terminal_safe(redact_uri(session.db_url))
    if session.as_json:
        _print_json({"db": shown, "schema_version": registry.schema_version})
    else:
        click.echo(f"registry {shown} at schema version {registry.schema_version}")


@registry_group.command("init")
@click.pass_obj
def init_command(session: _Session) -> None:
    """Create the registry (an SQLite file and its directory if absent) and migrate its
    schema (idempotent)."""
    _show_schema(session, session.open("create"))


@registry_group.command("migrate")
@click.pass_obj
def migrate_command(session: _Session) -> None:
    """Migrate an existing registry to this code's schema (idempotent); creates nothing."""
    _show_schema(session, session.open("migrate"))


@registry_group.command("register")
@click.argument("manifest_uri")
@click.option("--sha256", "sha256", required=True, callback=_check_sha256,
              help="Pinned SHA-256 of the manifest bytes.")  # fmt: skip
@click.option("--ready", is_flag=True, help="Register as ready (skip the approval step).")
@click.option(
    "--require-signature",
    is_flag=True,
    help="Refuse to register without a trusted signature over the artifact (needs a --trust-* "
    "anchor; anchors given without this flag are checked too).",
)
@trust_options
@actor_option
@click.pass_obj
def register_command(
    session: _Session,
    manifest_uri: str,
    sha256: str,
    ready: bool,
    require_signature: bool,
    actor: str,
    **trust_args: Any,
) -> None:
    """Register the artifact whose manifest is at MANIFEST_URI.

    Model and artifact id come from the manifest (not from --model). Registering the same
    artifact with the same digest again is a no-op. What this service could never serve
    (runtime, feature schema, precision, architecture) is refused (exit 3), and so is, with a
    --trust-* anchor, an artifact without a signature the anchors accept (checked as replicas
    check it: the manifest and its signature files are read, no weights)."""
    from app.compatibility import check_servable
    from app.trust import TrustPolicy, verify_at_source

    session.secret_uris.append(manifest_uri)
    trust = trust_from_options(trust_args)
    if require_signature and not trust.has_anchors:
        raise click.UsageError(
            "--require-signature needs a trust anchor: --trust-key, --trust-cert-chain or "
            "--trust-identity with --trust-issuer"
        )
    metadata: dict[str, Any] = {}
    if trust.has_anchors:
        policy = TrustPolicy(trust, cli=True)
        _, mode = verify_at_source(policy, manifest_uri, sha256)
        metadata["registered_signature"] = mode  # the registry row says what was checked

    def servable(manifest: Manifest) -> None:
        # The artifact is registered under the manifest's model: one of another model than
        # the command's would land where no rollout of --model looks.
        check_servable(manifest, session.model, "--model")

    record = session.writer.register_artifact(
        manifest_uri,
        sha256,
        state="ready" if ready else "pending",
        accept=servable,
        actor=actor,
        metadata=metadata or None,
    )
    _show_artifacts(session, [record])


@registry_group.command("approve")
@click.argument("artifact_id")
@reason_option()
@actor_option
@click.pass_obj
def approve_command(session: _Session, artifact_id: str, reason: str | None, actor: str) -> None:
    """Mark a pending artifact ready to publish."""
    record = session.writer.approve_artifact(session.model, artifact_id, actor=actor, reason=reason)
    _show_artifacts(session, [record])


@registry_group.command("reject")
@click.argument("artifact_id")
@reason_option(required=True)
@actor_option
@click.pass_obj
def reject_command(session: _Session, artifact_id: str, reason: str, actor: str) -> None:
    """Mark an artifact rejected: it can never be published."""
    record = session.writer.reject_artifact(session.model, artifact_id, actor=actor, reason=reason)
    _show_artifacts(session, [record])


@registry_group.command("artifacts")
@click.pass_obj
def artifacts_command(session: _Session) -> None:
    """List the model's artifacts."""
    _show_artifacts(session, session.reader.list_artifacts(session.model))


@registry_group.command("targets")
@click.pass_obj
def targets_command(session: _Session) -> None:
    """Show what each cohort should serve, with its revision."""
    _show_targets(session, session.reader.list_targets(session.model, session.env))


@registry_group.command("publish")
@click.argument("cohort", type=click.Choice(COHORTS))
@click.argument("artifact_id")
@click.option("--expected-revision", type=REVISION, required=True,
              help="The revision you read; 0 creates the cohort's first target.")  # fmt: skip
@reason_option(required=True, help_text="Why (recorded in the audit log).")
@click.option(
    "--approval",
    default=None,
    callback=check_reason,
    help="Approval reference (ticket, reviewer).",
)
@actor_option
@click.pass_obj
def publish_command(
    session: _Session,
    cohort: str,
    artifact_id: str,
    expected_revision: int,
    reason: str,
    approval: str | None,
    actor: str,
) -> None:
    """Point COHORT at ARTIFACT_ID, if its revision is still --expected-revision.

    On a conflict (exit 4) nothing changed: re-read `targets` and decide again."""
    target = session.writer.publish(
        session.model,
        session.env,
        cohort,
        artifact_id,
        expected_revision,
        actor=actor,
        reason=reason,
        approval=approval,
    )
    _show_targets(session, [target])


@registry_group.command("history")
@click.option("--cohort", type=click.Choice(COHORTS), default=None, help="Only this cohort.")
@click.option(
    "--artifacts",
    "artifact_decisions",
    is_flag=True,
    help="The artifacts' audit log instead: registrations, approvals, rejections.",
)
@click.option("--limit", type=LIST_LIMIT, default=50, show_default=True)
@click.pass_obj
def history_command(
    session: _Session, cohort: str | None, artifact_decisions: bool, limit: int
) -> None:
    """The audit log, newest first: target publishes (default) or artifact decisions."""
    if artifact_decisions:
        if cohort is not None:
            raise click.BadParameter("not with --artifacts", param_hint="--cohort")
        decisions = session.reader.artifact_history(session.model, limit=limit)
        _show_artifact_history(session, decisions)
        return
    entries = session.reader.history(session.model, session.env, cohort=cohort, limit=limit)
    _show_history(session, entries)


def _show_artifact_history(session: _Session, entries: Sequence[ArtifactAuditEntry]) -> None:
    if session.as_json:
        _print_json([e.to_dict() for e in entries])
        return
    _print_table(
        ["at", "artifact", "action", "from", "to", "actor", "reason"],
        [
            (_ts(e.at), e.artifact_id, e.action, e.old_state, e.new_state, e.actor, e.reason)
            for e in entries
        ],
    )


@registry_group.command("serve-config")
@click.argument("template", type=click.Path(exists=True, dir_okay=False, readable=True))
@click.option("--app", "app_name", default="ranker", show_default=True,
              help="The application whose targets are filled in.")  # fmt: skip
@click.option("--fallback", "fallback_id", default=None,
              help="Artifact the hot standby serves (if the app has one).")  # fmt: skip
@click.option("--out", "out_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write here instead of standard output.")  # fmt: skip
@click.pass_obj
def serve_config_command(
    session: _Session, template: str, app_name: str, fallback_id: str | None, out_path: str | None
) -> None:
    """The Serve config to deploy: TEMPLATE (a Serve config such as configs/serve.yaml, or a
    KubeRay RayService manifest) with the app's stable target set to the registry's and its
    fallback's to --fallback's artifact (ready), and no canary target.

    The stable revision is the registry's, so the controller's first drift repair changes
    nothing. Exit 5 when the registry has no stable target or the fallback is not ready."""
    from pathlib import Path

    from rollout.serve_config import render_document

    stable = session.reader.get_target(session.model, session.env, "stable").target()
    fallback = None
    if fallback_id is not None:
        record = session.reader.get_artifact(session.model, fallback_id)
        if record.state != "ready":
            raise InvalidState(f"fallback {fallback_id} is {record.state}, not ready")
        fallback = Target(
            revision=1,  # the template's where it has one (render_document keeps it)
            artifact_id=record.artifact_id,
            manifest_uri=record.manifest_uri,
            manifest_sha256=record.manifest_sha256,
            feature_schema=record.feature_schema,
        )
    text = Path(template).read_text()
    rendered = render_document(text, app_name=app_name, stable=stable, fallback=fallback)
    header = (
        f"# Rendered from {Path(template).name} by `rollout registry serve-config`: "
        f"stable {stable.artifact_id} at revision {stable.revision}"
        + (f", fallback {fallback.artifact_id}" if fallback is not None else "")
        + ".\n"
    )
    if out_path is None:
        click.echo(header + rendered, nl=False)
        return
    try:
        Path(out_path).write_text(header + rendered)
    except OSError as exc:
        raise ConfigError(f"--out {out_path}: {exc.strerror or exc}") from None
    click.echo(f"wrote {out_path}", err=True)
