"""The ``rollout`` command.

Exit codes (scripts key on them):
    0 ok, 2 usage, 3 artifact rejected, 4 conflict (compare-and-set lost),
    5 not found or invalid state, 6 configuration error, 1 anything unexpected.
Errors print one line, ``error[<category>]: <message>`` (``rejected: <category>: <detail>`` for
artifacts), never a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import click

from app.errors import (
    ArtifactRejected,
    ConfigError,
    InvalidState,
    NotFound,
    RegistryError,
    RevisionConflict,
    RolloutSystemError,
)
from app.manifest import Architecture, is_sha256_hex

EXIT_OK: Final = 0
EXIT_UNEXPECTED: Final = 1
EXIT_USAGE: Final = 2
EXIT_REJECTED: Final = 3
EXIT_CONFLICT: Final = 4
EXIT_NOT_FOUND: Final = 5
EXIT_CONFIG: Final = 6

DEFAULT_CACHE_DIR: Final = "var/cache"


def exit_code_for(error: RolloutSystemError) -> int:
    if isinstance(error, ArtifactRejected):
        return EXIT_REJECTED
    if isinstance(error, RevisionConflict):
        return EXIT_CONFLICT
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    if isinstance(error, NotFound | InvalidState | RegistryError):
        return EXIT_NOT_FOUND
    return EXIT_UNEXPECTED


def emit(payload: dict[str, Any]) -> None:
    click.echo(json.dumps(payload, sort_keys=True))


def _sha256_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not is_sha256_hex(value.lower()):
        raise click.BadParameter("must be 64 hex characters")
    return value.lower()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Zero-downtime model rollouts on Ray Serve."""


@cli.command()
@click.argument("src_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--model", required=True, help="Model name, e.g. ranker.")
@click.option("--artifact-id", required=True, help="Immutable id, e.g. ranker-v42.")
@click.option("--feature-schema", required=True, help="e.g. ranker-features-v3.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path))
@click.option(
    "--runtime", type=click.Choice(["safetensors", "pytorch-state-dict"]), default="safetensors"
)
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32")
@click.option(
    "--architecture",
    "architecture_json",
    help="Architecture as JSON ({name, version, params}); default: SRC_DIR/architecture.json.",
)
@click.option("--sign-key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def pack(
    src_dir: Path,
    model: str,
    artifact_id: str,
    feature_schema: str,
    out_dir: Path,
    runtime: str,
    precision: str,
    architecture_json: str | None,
    sign_key: Path | None,
) -> None:
    """Pack SRC_DIR into an immutable artifact directory with a manifest."""
    from app.packing import pack_artifact

    architecture = None
    if architecture_json is not None:
        try:
            architecture = Architecture.model_validate_json(architecture_json)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--architecture") from exc
    result = pack_artifact(
        src_dir,
        out_dir,
        model=model,
        artifact_id=artifact_id,
        feature_schema=feature_schema,
        runtime=runtime,
        precision=precision,
        architecture=architecture,
        sign_key=sign_key,
    )
    emit(result.as_json())


@cli.command()
@click.argument("manifest_uri")
@click.option("--sha256", "manifest_sha256", required=True, callback=_sha256_option)
@click.option("--cache", "cache_dir", default=DEFAULT_CACHE_DIR, show_default=True)
@click.option("--trust-key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--load", is_flag=True, help="Also build, strictly load and dry-run the model.")
@click.option(
    "--memory-budget",
    type=click.IntRange(min=1),
    default=None,
    help="Device memory capacity in bytes for the budget check (default: ask the device).",
)
def verify(
    manifest_uri: str,
    manifest_sha256: str,
    cache_dir: str,
    trust_key: Path | None,
    load: bool,
    memory_budget: int | None,
) -> None:
    """Fetch MANIFEST_URI into the verified cache and check every file (and the model)."""
    from app.cache import ArtifactCache

    started = time.monotonic()
    cache = ArtifactCache(cache_dir, trust_key=trust_key)
    artifact = cache.fetch_verified(manifest_uri, manifest_sha256, recheck="digests")
    payload: dict[str, Any] = {
        "artifact_id": artifact.manifest.artifact_id,
        "cache_path": str(artifact.path),
        "bytes": artifact.total_bytes,
        "cached": artifact.cached,
    }
    if load:
        from app.loader import load_verified
        from app.memory import MemoryBudget

        budget = MemoryBudget(capacity_bytes=memory_budget) if memory_budget else None
        with cache.lease(manifest_sha256):
            model = load_verified(artifact, budget=budget)
            payload["loaded"] = {
                "device": str(model.device),
                "runtime_build": model.runtime_build,
                "param_bytes": model.param_bytes,
                **{f"{k}_s": round(v, 4) for k, v in model.timings.items()},
            }
            model.close()
    payload["seconds"] = round(time.monotonic() - started, 4)
    emit(payload)


@cli.command("make-demo-artifacts")
@click.argument("out_dir", type=click.Path(path_type=Path))
def make_demo_artifacts_command(out_dir: Path) -> None:
    """Write the demo artifacts ranker-v41 and ranker-v42 (deterministic) into OUT_DIR."""
    from app.demo_artifacts import make_demo_artifacts

    for result in make_demo_artifacts(out_dir):
        emit(result.as_json())


@cli.command()
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("public_key", type=click.Path(dir_okay=False, path_type=Path))
def keygen(private_key: Path, public_key: Path) -> None:
    """Write an ed25519 key pair for signing manifests (PEM)."""
    from app.signing import generate_keypair

    for path in (private_key, public_key):
        if path.exists():
            raise click.BadParameter(f"{path} exists; refusing to overwrite a key")
    generate_keypair(private_key, public_key)
    emit({"private_key": str(private_key), "public_key": str(public_key)})


def _register_subcommands() -> None:
    """Command groups that live in their own modules."""
    try:
        from rollout.registry_cli import registry_group
    except ImportError:  # pragma: no cover - during bootstrap only
        return
    cli.add_command(registry_group, "registry")


_register_subcommands()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_USAGE
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE
    except ArtifactRejected as exc:
        click.echo(f"rejected: {exc.category}: {exc.detail}", err=True)
        return EXIT_REJECTED
    except RolloutSystemError as exc:
        click.echo(f"error[{exc.category}]: {exc}", err=True)
        return exit_code_for(exc)
    except OSError as exc:
        click.echo(f"error[io]: {exc}", err=True)
        return EXIT_UNEXPECTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
