"""The ``rollout`` command.

Exit codes (scripts key on them): the table of ``rollout/exit_codes.py``.
Errors print one line, ``error[<category>]: <message>`` (``rejected: <category>: <detail>`` for
artifacts), never a traceback. Only ``rollout controller start`` and ``rollout start`` create
the controller; every other command that talks to the cluster needs one running (exit 5) and
gives up after ``--timeout`` seconds (exit 7).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import click
from pydantic import ValidationError

from app.contracts import (
    EXPECTED_DIVERGENCE_KEY,
    CommandAccepted,
    ControllerPing,
    ControllerSettings,
    ControllerStatus,
    OperatorCommandName,
    PublishedTarget,
    RolloutSummary,
    StandbyView,
    clip_text,
)
from app.errors import (
    ArtifactRejected,
    ConfigError,
    FetchFailed,
    NotFound,
    RolloutSystemError,
)
from app.manifest import Architecture, Manifest, is_sha256_hex
from app.safe_text import redact_in, redact_uri, terminal_safe
from app.signing import KEY_KINDS, KeyKind
from rollout.cli_options import (
    LIST_LIMIT,
    Seconds,
    actor_option,
    check_signature_file,
    reason_option,
    trust_from_options,
    trust_options,
)
from rollout.cluster import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from rollout.exit_codes import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_ROLLOUT_ABORTED,
    EXIT_ROLLOUT_FAILED,
    EXIT_ROLLOUT_ROLLED_BACK,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    error_line,
    exit_code_for,
    exit_code_for_phase,
)

if TYPE_CHECKING:  # imported where used: the CLI starts without torch, the cache or rich
    from app.cache import ArtifactCache, VerifiedArtifact
    from app.contracts import ExpectedDivergence
    from app.loader import CandidateLoad, LoadedModel
    from rollout.progress_bar import Bars

DEFAULT_CACHE_DIR: Final = "var/cache"

# `pack` and `verify` print one JSON line either way; --json also keeps the terminal quiet.
_json_mode_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Machine mode: the JSON line only, never a progress bar (one is drawn on stderr "
    "when it is a terminal).",
)


def emit(payload: dict[str, Any]) -> None:
    click.echo(json.dumps(payload, sort_keys=True))


def _sha256_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not is_sha256_hex(value.lower()):
        raise click.BadParameter("must be 64 hex characters")
    return value.lower()


class _Commands(click.Group):
    """The CLI's commands; the groups that live in modules of their own are imported when
    named (the demo's, with the artifact store's HTTP clients, would cost every other command a
    fifth of a second: CI scripts and shells call this binary often)."""

    LAZY: Final = {
        "demo": ("rollout.demo", "demo_command"),
        "registry": ("rollout.registry_cli", "registry_group"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY and cmd_name not in self.commands:
            module, attribute = self.LAZY[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option(
    "--sign-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Sign with this private key (PEM): EC P-256/384/521 writes an OpenSSF model signature "
    "(--signature-file), ed25519 the project's manifest.json.sig.",
)
@click.option(
    "--signature-file",
    default="model.sig",
    show_default=True,
    callback=check_signature_file,
    help="Name of the OpenSSF signature file in the artifact directory (reserved: a source "
    "file of that name is refused).",
)
@click.option(
    "--expected-divergence",
    "expected_divergence_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="An expected_divergence block (JSON, as `rollout replay --out` writes it) to embed "
    "as the manifest's metadata.expected_divergence.",
)
@click.option(
    "--backbone-only",
    is_flag=True,
    help="Pack a backbone artifact: every tensor but the family's head, never served alone.",
)
@click.option(
    "--backbone",
    "backbone_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Pack a head artifact on the backbone packed in this directory (its manifest's id "
    "and digest are pinned). Publish the head beside it in the same store.",
)
@_json_mode_option
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
    signature_file: str,
    expected_divergence_file: Path | None,
    backbone_only: bool,
    backbone_dir: Path | None,
    as_json: bool,
) -> None:
    """Pack SRC_DIR into an immutable artifact directory with a manifest."""
    from app.packing import backbone_ref, pack_artifact

    if backbone_only and backbone_dir is not None:
        raise click.BadParameter(
            "a backbone has no backbone: give --backbone-only or --backbone",
            param_hint="--backbone",
        )
    backbone = backbone_ref(backbone_dir) if backbone_dir is not None else None
    kind = "backbone" if backbone_only else "head" if backbone is not None else "model"
    from rollout.progress_bar import progress_bars, wanted

    architecture = None
    if architecture_json is not None:
        try:
            architecture = Architecture.model_validate_json(architecture_json)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--architecture") from exc
    metadata = None
    if expected_divergence_file is not None:
        # Refused before anything is written, naming the field.
        block = _read_expected_divergence(expected_divergence_file, artifact_id)
        metadata = {EXPECTED_DIVERGENCE_KEY: block}
    with progress_bars(wanted(as_json)) as bars:
        result = pack_artifact(
            src_dir,
            out_dir,
            model=model,
            artifact_id=artifact_id,
            feature_schema=feature_schema,
            runtime=runtime,
            precision=precision,
            architecture=architecture,
            metadata=metadata,
            sign_key=sign_key,
            signature_file=signature_file,
            on_start=lambda total: bars.start("copy + hash", total),
            on_bytes=lambda n: bars.advance("copy + hash", n),
            kind=kind,
            backbone=backbone,
        )
    emit(result.as_json())


MAX_EXPECTED_DIVERGENCE_BYTES: Final = 64 << 10


def _read_expected_divergence(path: Path, artifact_id: str) -> dict[str, Any]:
    """The block of ``pack --expected-divergence`` for ``artifact_id``, validated
    (``app.packing.check_expected_divergence``); ConfigError names the file and the field."""
    from app.packing import check_expected_divergence

    where = f"--expected-divergence {path}"
    with open(path, "rb") as handle:
        raw = handle.read(MAX_EXPECTED_DIVERGENCE_BYTES + 1)
    if len(raw) > MAX_EXPECTED_DIVERGENCE_BYTES:
        raise ConfigError(f"{where}: over {MAX_EXPECTED_DIVERGENCE_BYTES} bytes; not a block")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    try:
        block = check_expected_divergence({EXPECTED_DIVERGENCE_KEY: doc}, artifact_id)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}", **exc.ids) from None
    if block is None:
        raise ConfigError(f"{where}: holds null, not an {EXPECTED_DIVERGENCE_KEY} block")
    return block.model_dump(mode="json")


@contextmanager
def _redacting(*uris: str) -> Iterator[None]:
    """Errors raised inside come out with the secrets of ``uris`` masked (a manifest URI may
    carry userinfo or a presigned signature, which a fetch error would quote)."""
    try:
        yield
    except ArtifactRejected as exc:
        detail = redact_in(exc.detail, *uris)
        raise ArtifactRejected(exc.category, detail, artifact_id=exc.artifact_id) from None
    except FetchFailed as exc:
        raise FetchFailed(redact_in(exc.detail, *uris)) from None
    except RolloutSystemError as exc:
        exc.message = redact_in(exc.message, *uris)
        raise


@cli.command()
@click.argument("manifest_uri")
@click.option("--sha256", "manifest_sha256", required=True, callback=_sha256_option)
@click.option("--cache", "cache_dir", default=DEFAULT_CACHE_DIR, show_default=True)
@trust_options
@click.option("--load", is_flag=True, help="Also build, strictly load and dry-run the model.")
@click.option(
    "--memory-budget",
    type=click.IntRange(min=1),
    default=None,
    help="Device memory capacity in bytes for the budget check (default: ask the device).",
)
@click.option(
    "--model",
    default="ranker",
    show_default=True,
    help="The model the service serves (loading.model): a manifest of another is refused.",
)
@_json_mode_option
def verify(
    manifest_uri: str,
    manifest_sha256: str,
    cache_dir: str,
    load: bool,
    memory_budget: int | None,
    model: str,
    as_json: bool,
    **trust_args: Any,
) -> None:
    """Fetch MANIFEST_URI into the verified cache and check every file and that this service
    can serve it (runtime, feature schema, precision, architecture); ``--load`` also loads."""
    from app.cache import ArtifactCache
    from app.trust import TrustPolicy
    from rollout.progress_bar import progress_bars, wanted

    trust = trust_from_options(trust_args)
    started = time.monotonic()
    with _redacting(manifest_uri), progress_bars(wanted(as_json)) as bars:
        cache = ArtifactCache(cache_dir, trust=TrustPolicy.of(trust, cli=True))
        servable = _servable_check(model)
        # With --load, a cold fetch feeds the weights into the model as it hashes them.
        prepared = _candidate_load(memory_budget, servable, cache, manifest_uri) if load else None
        artifact = _fetch_servable(cache, manifest_uri, manifest_sha256, servable, prepared, bars)
        if prepared is not None:
            payload_loaded = _load_for_verify(cache, artifact, manifest_sha256, prepared, bars)
    payload: dict[str, Any] = {
        "artifact_id": artifact.manifest.artifact_id,
        "cache_path": str(artifact.path),
        "bytes": artifact.total_bytes,
        "cached": artifact.cached,
        "signature": artifact.signature,
    }
    if load:
        payload["loaded"] = payload_loaded
    payload["seconds"] = round(time.monotonic() - started, 4)
    emit(payload)


def _servable_check(model: str) -> Callable[[Manifest], None]:
    """What the manifest says decides whether the service could ever serve it: no weights
    need loading to refuse an unknown runtime, schema, precision or architecture."""
    from app.compatibility import check_compatibility

    def servable(manifest: Manifest) -> None:
        if manifest.model != model:
            raise ArtifactRejected(
                "schema",
                f"manifest is for model {manifest.model!r}; the service serves {model!r} (--model)",
                artifact_id=manifest.artifact_id,
            )
        check_compatibility(manifest)

    return servable


def _candidate_load(
    memory_budget: int | None,
    servable: Callable[[Manifest], None],
    cache: ArtifactCache,
    manifest_uri: str,
) -> CandidateLoad:
    """The load of ``verify --load``; a head's pinned backbone is fetched from beside it,
    every byte re-hashed like the head's, and loaded first (within the budget)."""
    from app.loader import CandidateLoad, ResidentBackbone, default_device
    from app.memory import MemoryBudget
    from app.model_family import SHIPPED_FAMILIES, families_for
    from app.model_loading import load_pinned_backbone

    budget = MemoryBudget(capacity_bytes=memory_budget) if memory_budget else None
    device = default_device()

    def backbones(head: Manifest) -> ResidentBackbone:
        pinned = load_pinned_backbone(
            cache,
            head,
            manifest_uri,
            device=device,
            budget=budget,
            resident_bytes=0,
            families=families_for(SHIPPED_FAMILIES),
            on_free=lambda _backbone: pinned.lease.release(),
            recheck="digests",
        )
        return pinned.backbone.acquire()

    return CandidateLoad(device=device, budget=budget, expect=servable, backbones=backbones)


def _fetch_servable(
    cache: ArtifactCache,
    manifest_uri: str,
    manifest_sha256: str,
    servable: Callable[[Manifest], None],
    prepared: CandidateLoad | None,
    bars: Bars,
) -> VerifiedArtifact:
    """``verify``'s fetch: into the verified cache, a hit re-hashed (every byte checked), the
    manifest checked servable; a cold fetch feeds ``prepared`` as it hashes."""
    from app.load_control import LoadControl
    from rollout.progress_bar import watching

    try:
        with watching(LoadControl(), bars) as control:
            artifact = cache.fetch_verified(
                manifest_uri, manifest_sha256, recheck="digests", control=control, sink=prepared
            )
        servable(artifact.manifest)
    except BaseException:
        if prepared is not None:
            prepared.abandon()  # a head's use of its backbone, and that one's cache lease
        raise
    return artifact


def _load_strictly(
    cache: ArtifactCache,
    artifact: VerifiedArtifact,
    manifest_sha256: str,
    prepared: CandidateLoad,
    bars: Bars,
) -> LoadedModel:
    """``verify --load``'s load: build, strictly load and dry-run, with the load's bar."""
    from app.load_control import LoadControl
    from app.loader import load_verified
    from rollout.progress_bar import watching

    with cache.lease(manifest_sha256), watching(LoadControl(), bars) as control:
        return load_verified(artifact, control=control, prepared=prepared)


def _load_for_verify(
    cache: ArtifactCache,
    artifact: VerifiedArtifact,
    manifest_sha256: str,
    prepared: CandidateLoad,
    bars: Bars,
) -> dict[str, Any]:
    """``verify --load``: build, strictly load and dry-run, with the load's bar."""
    model = _load_strictly(cache, artifact, manifest_sha256, prepared, bars)
    try:
        return {
            "device": str(model.device),
            "runtime_build": model.runtime_build,
            "param_bytes": model.param_bytes,
            "loaded_bytes": model.loaded_bytes,
            "backbone": model.backbone.artifact_id if model.backbone is not None else None,
            **{f"{k}_s": round(v, 4) for k, v in model.timings.items()},
        }
    finally:
        model.close()


def _verified_model(
    cache: ArtifactCache, directory: Path, manifest_sha256: str, model: str, bars: Bars
) -> LoadedModel:
    """The artifact in ``directory`` as ``verify --load`` takes it: every byte verified into
    the cache, servable, strictly loaded and dry-run."""
    from app.artifact_store import manifest_uri_for
    from app.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, sha256_hex

    # The cache finds an entry by its digest alone: the directory must hold that manifest,
    # or a digest of another artifact would replay that one under this directory's name.
    try:
        with open(directory / MANIFEST_NAME, "rb") as handle:
            found = sha256_hex(handle.read(MAX_MANIFEST_BYTES + 1))
    except FileNotFoundError:
        raise ArtifactRejected("missing", f"{directory} holds no {MANIFEST_NAME}") from None
    if found != manifest_sha256:
        raise ArtifactRejected(
            "manifest_digest",
            f"{directory / MANIFEST_NAME} has sha256 {found}, not the given {manifest_sha256}",
        )
    servable = _servable_check(model)
    uri = manifest_uri_for(directory)
    prepared = _candidate_load(None, servable, cache, uri)
    artifact = _fetch_servable(cache, uri, manifest_sha256, servable, prepared, bars)
    return _load_strictly(cache, artifact, manifest_sha256, prepared, bars)


def _requests_option_check(
    requests_path: Path | None, generated: int | None, seed: int | None
) -> tuple[Path | None, int, int]:
    if requests_path is not None and generated is not None:
        raise click.BadParameter(
            "give --requests or --generated, not both", param_hint="--requests"
        )
    if requests_path is not None and seed is not None:
        raise click.BadParameter("--seed is for --generated requests only", param_hint="--seed")
    from app.replay import DEFAULT_REQUESTS
    from app.request_bodies import DEFAULT_SEED

    return requests_path, generated or DEFAULT_REQUESTS, DEFAULT_SEED if seed is None else seed


def _replay_summary(block: ExpectedDivergence, candidate: str) -> list[str]:
    """What ``replay`` says on stderr: the figures the block records, one a line."""
    rows = [
        ("mean RBO", block.rbo_mean),
        (f"top-{block.top_k} overlap", block.overlap_mean),
        ("top-1 change rate", block.top1_change_rate),
        ("p99 max score diff", block.max_score_diff_p99),
    ]
    return [
        f"replayed {block.requests} requests ({block.source}) through {candidate} and "
        f"{block.baseline_artifact_id} (top_k {block.top_k}, rbo_p {block.rbo_p:g})",
        *(f"  {name:<20} {value:.4f}" for name, value in rows),
    ]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_ARTIFACT_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@cli.command()
@click.option("--baseline", "baseline_dir", required=True, type=_ARTIFACT_DIR,
              help="The baseline's artifact directory (the rollout's stable model).")  # fmt: skip
@click.option("--baseline-sha256", required=True, callback=_sha256_option)
@click.option("--candidate", "candidate_dir", required=True, type=_ARTIFACT_DIR,
              help="The candidate's artifact directory.")  # fmt: skip
@click.option("--candidate-sha256", required=True, callback=_sha256_option)
@click.option(
    "--requests",
    "requests_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A JSON-lines file, one POST /v1/rank body a line.",
)
@click.option(
    "--generated",
    type=click.IntRange(min=1, max=1_000_000),
    default=None,
    help="Replay this many requests of the live load's generator (default: 2000 when no "
    "--requests is given).",
)
@click.option("--seed", type=click.IntRange(min=0, max=2**63 - 1), default=None,
              help="Seed of the --generated requests (default: the live load's, 7).")  # fmt: skip
@click.option("--top-k", type=click.IntRange(min=1, max=2048), default=10, show_default=True,
              help="Depth of the top-k overlap (the shadow phase's top_k).")  # fmt: skip
@click.option(
    "--rbo-p",
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    default=0.9,
    show_default=True,
    help="Persistence of rank-biased overlap (the shadow phase's rbo_p).",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the expected_divergence block here (default: stdout, one JSON line).",
)
@click.option("--cache", "cache_dir", default=DEFAULT_CACHE_DIR, show_default=True)
@trust_options
@click.option(
    "--model",
    default="ranker",
    show_default=True,
    help="The model the service serves (loading.model): a manifest of another is refused.",
)
@_json_mode_option
def replay(
    baseline_dir: Path,
    baseline_sha256: str,
    candidate_dir: Path,
    candidate_sha256: str,
    requests_path: Path | None,
    generated: int | None,
    seed: int | None,
    top_k: int,
    rbo_p: float,
    out_path: Path | None,
    cache_dir: str,
    model: str,
    as_json: bool,
    **trust_args: Any,
) -> None:
    """Replay requests through the baseline and the candidate and record how far the
    candidate's rankings are from the baseline's, as the shadow phase measures them live.

    Both artifacts are verified and loaded as ``verify --load`` does (every byte checked,
    strict load, dry run). The ``expected_divergence`` block goes to --out (for ``pack
    --expected-divergence``) or to stdout as one JSON line; a summary goes to stderr (not
    with --json)."""
    from app.cache import ArtifactCache
    from app.replay import block_json, generated_requests, replay_expectation, requests_file
    from app.trust import TrustPolicy
    from rollout.progress_bar import progress_bars, wanted

    trust = trust_from_options(trust_args)
    path, count, seed = _requests_option_check(requests_path, generated, seed)
    with progress_bars(wanted(as_json)) as bars:
        cache = ArtifactCache(cache_dir, trust=TrustPolicy.of(trust, cli=True))
        baseline = _verified_model(cache, baseline_dir, baseline_sha256, model, bars)
        try:
            # The requests are the baseline's schema (its family's); a bad requests file is
            # refused before the candidate is fetched.
            schema = baseline.family.schema
            requests = (
                requests_file(path, schema)
                if path is not None
                else generated_requests(count, seed=seed, schema=schema)
            )
            candidate = _verified_model(cache, candidate_dir, candidate_sha256, model, bars)
            try:
                if candidate.manifest.feature_schema != schema.name:
                    raise ConfigError(
                        f"candidate: {candidate.artifact_id} speaks "
                        f"{candidate.manifest.feature_schema!r}, the baseline {schema.name!r}: "
                        "no request is valid for both",
                        field="candidate",
                    )
                block, _ = replay_expectation(
                    baseline,
                    candidate,
                    requests,
                    baseline_manifest_sha256=baseline_sha256,
                    top_k=top_k,
                    rbo_p=rbo_p,
                )
            finally:
                candidate.close()
        finally:
            baseline.close()
    if not as_json:
        for line in _replay_summary(block, candidate.artifact_id):
            click.echo(terminal_safe(line), err=True)
    if out_path is not None:
        _write_atomically(out_path, block_json(block))
        if not as_json:
            click.echo(terminal_safe(f"wrote {out_path}"), err=True)
    else:
        emit(block.model_dump(mode="json"))


@cli.command("make-demo-artifacts")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--shadow",
    is_flag=True,
    help="Also the shadow phase's candidates: ranker-v41-renorm and ranker-v41-permuted "
    "(packaging bugs) and ranker-v43 (fine-tuned, with its expected divergence from "
    "ranker-v41 recorded).",
)
@click.option(
    "--two-tower",
    is_flag=True,
    help="Also the two-tower family's two-tower-v1 and two-tower-v2 (model recs-two-tower, "
    "schema two-tower-features-v1).",
)
def make_demo_artifacts_command(out_dir: Path, shadow: bool, two_tower: bool) -> None:
    """Write the demo artifacts ranker-v41, ranker-v42 and ranker-lite-v1 (deterministic)
    into OUT_DIR: one JSON line each."""
    from app.demo_artifacts import (
        SHADOW_BASELINE,
        make_demo_artifacts,
        make_shadow_artifacts,
        make_two_tower_artifacts,
    )

    results = make_demo_artifacts(out_dir)
    if shadow:
        baseline = next(r for r in results if r.artifact_id == SHADOW_BASELINE)
        results += list(make_shadow_artifacts(out_dir, baseline).values())
    if two_tower:
        results += make_two_tower_artifacts(out_dir)
    for result in results:
        emit(result.as_json())


@cli.command()
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("public_key", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--kind",
    type=click.Choice(KEY_KINDS),
    default="ec-p256",
    show_default=True,
    help="ec-p256: OpenSSF model signatures, which the ecosystem's tools check; ed25519: the "
    "project's own signature over manifest.json.",
)
def keygen(private_key: Path, public_key: Path, kind: KeyKind) -> None:
    """Write a key pair for signing artifacts (PEM; the private key with mode 0600)."""
    from app.signing import generate_keypair

    for path in (private_key, public_key):
        if path.exists() or path.is_symlink():  # a dangling symlink "exists" as a link
            raise click.BadParameter(f"{path} exists; refusing to overwrite a key")
    generate_keypair(private_key, public_key, kind)
    emit({"private_key": str(private_key), "public_key": str(public_key), "kind": kind})


# ---------------------------------------------------------------------- rollouts


def _cluster_options(func: Any) -> Any:
    """Options of every command that talks to the running cluster's controller."""
    options = [
        click.option(
            "--address",
            envvar="RAY_ADDRESS",
            default=None,
            help="Ray cluster address (env RAY_ADDRESS; default: the local cluster).",
        ),
        click.option(
            "--db",
            "db_url",
            envvar="ROLLOUT_DB",
            default=None,
            help="Registry URL (env ROLLOUT_DB; default: the embedded SQLite of the demo).",
        ),
        click.option(
            "--dashboard",
            envvar="RAY_DASHBOARD_URL",
            default=None,
            help="Ray dashboard URL (default: the connected cluster's).",
        ),
        click.option(
            "--timeout",
            "timeout_s",
            type=Seconds(min=0.1, max=MAX_TIMEOUT_S),
            default=DEFAULT_TIMEOUT_S,
            show_default=True,
            help="Seconds to wait for the cluster and for each answer of the controller "
            "(exit 7 past it).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _running_controller(address: str | None, timeout_s: float) -> Any:
    """The cluster's controller, which must already run: never created here (exit 5)."""
    from rollout.cluster import connect, running_controller

    connect(address, timeout_s)
    return running_controller(timeout_s=timeout_s)


def _controller(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float
) -> Any:
    """Attach to the cluster and return its controller, creating it if absent (only
    `rollout controller start` and `rollout start` do)."""
    from app.registry import default_registry_url
    from rollout.actor import absolute_registry_url, ensure_controller
    from rollout.cluster import connect, find_controller

    cluster_dashboard = connect(address, timeout_s)
    existing = find_controller(timeout_s=timeout_s)
    if existing is not None:
        return existing
    dashboard = dashboard or cluster_dashboard
    if not dashboard:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    settings = ControllerSettings(
        registry_url=absolute_registry_url(db_url or default_registry_url()),
        dashboard_url=dashboard,
    )
    return ensure_controller(settings, timeout_s=timeout_s)


def _call(handle_method: Any, *args: Any, timeout_s: float) -> Any:
    from rollout.cluster import call

    return call(handle_method, *args, timeout_s=timeout_s)


def _show(payload: dict[str, Any], as_json: bool, view: type[RolloutSummary]) -> None:
    """A controller's answer: as it came (``--json``), or rendered from its ``view`` model."""
    if as_json:
        emit(payload)
    else:
        from rollout.status_view import render_status

        click.echo(render_status(view.model_validate(payload)))


@cli.group()
def controller() -> None:
    """The detached rollout controller actor of the running cluster."""


def _show_ping(answer: dict[str, Any]) -> None:
    """The controller's settings, with the credentials of its URLs masked."""
    ping = ControllerPing.model_validate(answer)
    shown = dict(answer)
    shown["registry_url"] = redact_uri(ping.registry_url)
    shown["dashboard_url"] = redact_uri(ping.dashboard_url)
    if ping.prometheus_url:
        shown["prometheus_url"] = redact_uri(ping.prometheus_url)
    emit(shown)


@controller.command("start")
@_cluster_options
def controller_start(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Create the controller if absent (it resumes any active rollout and repairs drift)."""
    handle = _controller(address, db_url, dashboard, timeout_s)
    _show_ping(_call(handle.ping, timeout_s=timeout_s))


@controller.command("keep")
@click.option(
    "--every",
    "every_s",
    type=Seconds(min=1, max=3600),
    default=15.0,
    show_default=True,
    help="Seconds between checks that the controller runs.",
)
@_cluster_options
def controller_keep(
    every_s: float, address: str | None, db_url: str | None, dashboard: str | None,
    timeout_s: float, as_json: bool,
) -> None:  # fmt: skip
    """Keep a controller running: create it whenever it is absent, checking every --every
    seconds, until stopped (SIGTERM or SIGINT: exit 0). A line whenever the controller it finds
    is not the one it saw last. For a process beside the head (the RayService's
    rollout-controller container): a new head without GCS fault tolerance starts with no
    controller, and one created here resumes the active rollout from the registry. Losing the
    cluster ends it with that error (its supervisor starts it again)."""
    import signal
    import threading

    from app.registry import default_registry_url
    from rollout.actor import absolute_registry_url, ensure_controller
    from rollout.cluster import connect, find_controller

    stop = threading.Event()

    def stopping(_signum: int, _frame: Any) -> None:
        stop.set()

    cluster_dashboard = connect(address, timeout_s)
    # After attaching: Ray's driver puts in handlers of its own that exit with the signal.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping)
    dashboard = dashboard or cluster_dashboard
    if not dashboard:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    settings = ControllerSettings(
        registry_url=absolute_registry_url(db_url or default_registry_url()),
        dashboard_url=dashboard,
    )
    seen: int | None = None
    while not stop.is_set():
        handle = find_controller(timeout_s=timeout_s)
        created = handle is None
        if handle is None:
            handle = ensure_controller(settings, timeout_s=timeout_s)
        ping = ControllerPing.model_validate(_call(handle.ping, timeout_s=timeout_s))
        if created or ping.pid != seen:
            emit(
                {
                    "controller": "created" if created else "found",
                    "pid": ping.pid,
                    "node_id": ping.node_id,
                    "ticks": ping.ticks,
                }
            )
            seen = ping.pid
        stop.wait(every_s)


@controller.command("status")
@_cluster_options
def controller_status(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Is the controller running, and with which settings (exit 5 if not running)."""
    _show_ping(_call(_running_controller(address, timeout_s).ping, timeout_s=timeout_s))


@controller.command("stop")
@_cluster_options
def controller_stop(
    address: str | None, db_url: str | None, dashboard: str | None, timeout_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Stop the controller; an active rollout holds where it is until one starts again."""
    import ray

    ray.kill(_running_controller(address, timeout_s), no_restart=True)
    emit({"stopped": True})


@cli.command("start")
@click.argument("model")
@click.argument("artifact_id")
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Rollout plan YAML (default: configs/rollout.yaml's defaults).",
)
@actor_option
@_cluster_options
def start_command(
    model: str,
    artifact_id: str,
    plan_file: Path | None,
    actor: str,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Roll ARTIFACT_ID of MODEL out: canary, weighted steps, analysis, promotion (creates the
    controller if the cluster has none)."""
    from rollout.plan import RolloutPlan, load_plan

    plan = load_plan(plan_file) if plan_file else RolloutPlan()
    handle = _controller(address, db_url, dashboard, timeout_s)
    settings = ControllerPing.model_validate(_call(handle.ping, timeout_s=timeout_s))
    if settings.model != model:
        raise ConfigError(f"MODEL: this cluster's controller manages {settings.model!r}")
    summary = _call(
        handle.start_rollout, artifact_id, plan.model_dump(mode="json"), actor,
        timeout_s=timeout_s,
    )  # fmt: skip
    _show(summary, as_json, RolloutSummary)


@cli.command("status")
@click.option(
    "--watch",
    is_flag=True,
    help="Refresh until the rollout finishes (Ctrl-C stops); exits "
    f"{EXIT_ROLLOUT_FAILED} failed, {EXIT_ROLLOUT_ROLLED_BACK} rolled back, "
    f"{EXIT_ROLLOUT_ABORTED} aborted.",
)
@click.option(
    "--interval",
    type=Seconds(min=0.2, max=3600),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes of --watch.",
)
@_cluster_options
def status_command(
    watch: bool,
    interval: float,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Phase, step, weights, per-cohort traffic, verdicts, replicas, events."""
    from rollout.status_view import render_status

    handle = _running_controller(address, timeout_s)
    # Clearing the screen is for a person at a terminal; a log or a pipe gets each view in
    # turn, separated by a blank line.
    on_terminal = click.get_text_stream("stdout").isatty()
    first = True
    while True:
        answer = _call(handle.status, timeout_s=timeout_s)
        view = ControllerStatus.model_validate(answer)
        if as_json:
            emit(answer)
        else:
            if watch and on_terminal:
                click.echo("\x1b[2J\x1b[H", nl=False)
            elif watch and not first:
                click.echo("")
            click.echo(render_status(view, now=time.time()))
        first = False
        if not watch or not view.rollout or view.finished:
            break
        time.sleep(interval)
    if watch:
        # CI gates on the outcome of the rollout it watched.
        raise click.exceptions.Exit(exit_code_for_phase(view.phase))


def _operator_command(name: OperatorCommandName, doc: str) -> None:
    @cli.command(name, help=doc)
    @reason_option(help_text="Why (recorded in the rollout's events).")
    @actor_option
    @_cluster_options
    def command(
        reason: str | None,
        actor: str,
        address: str | None,
        db_url: str | None,
        dashboard: str | None,
        timeout_s: float,
        as_json: bool,
    ) -> None:
        handle = _running_controller(address, timeout_s)
        answer = _call(handle.command, name, reason or "", actor, timeout_s=timeout_s)
        _show(answer, as_json, CommandAccepted)


_operator_command("pause", "Hold the rollout at its current weights.")
_operator_command("resume", "Go on from a gate or a pause.")
_operator_command("promote", "Skip the remaining steps (and gates) and promote now.")
_operator_command("abort", "Stop the rollout: stable 100% first, then clean up.")


@cli.command("rollback")
@click.option(
    "--to",
    "to_artifact",
    default=None,
    help="With no rollout in progress: the artifact stable goes back to "
    "(default: the one before the current).",
)
@reason_option()
@actor_option
@_cluster_options
def rollback_command(
    to_artifact: str | None,
    reason: str | None,
    actor: str,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Fast path: weights to stable first, no analysis. With no rollout in progress, point
    stable back at an earlier artifact at a higher revision."""
    handle = _running_controller(address, timeout_s)
    view = ControllerStatus.model_validate(_call(handle.status, timeout_s=timeout_s))
    if view.rollout and not view.finished:
        if to_artifact is not None and to_artifact != view.baseline:
            raise ConfigError(
                f"--to: a rollout is in progress; its rollback returns to {view.baseline}"
            )
        answer = _call(handle.command, "rollback", reason or "", actor, timeout_s=timeout_s)
        _show(answer, as_json, CommandAccepted)
        return
    answer = _call(
        handle.rollback_stable, to_artifact, actor, reason or "rollback", timeout_s=timeout_s
    )
    target = PublishedTarget.model_validate(answer)
    emit({"stable": target.artifact_id, "revision": target.revision})


def _status_url(details: dict[str, Any], app_name: str, dashboard: str) -> str:
    """The app's ``/v1/status`` on Serve's HTTP ingress, from Serve's own details: the proxy's
    host (the dashboard's host when it listens on every address) and port, the app's route
    prefix."""
    from urllib.parse import urlsplit

    http = details.get("http_options") or {}
    host = str(http.get("host") or "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = urlsplit(dashboard).hostname or "127.0.0.1"
    port = int(http.get("port") or 8000)
    app = (details.get("applications") or {}).get(app_name) or {}
    prefix = str(app.get("route_prefix") or "/").rstrip("/")
    return f"http://{host}:{port}{prefix}/v1/status"


def _standby_view(url: str, app_name: str, timeout_s: float) -> StandbyView:
    """The router's standby view, asked as a client asks it: over Serve's HTTP ingress (no
    Serve handle in this short-lived process: its background polling outlives the command)."""
    import httpx

    from app.errors import ClusterUnreachable

    try:
        answer = httpx.get(url, timeout=max(0.1, timeout_s))
        answer.raise_for_status()
        standby = answer.json().get("standby")
    except (httpx.HTTPError, ValueError) as exc:
        raise ClusterUnreachable(
            f"the router of application {app_name!r} did not answer at {url}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if standby is None:
        raise NotFound(f"--app {app_name}: the application has no fallback deployment")
    return StandbyView.model_validate(standby)


def _set_standby_policy(
    dashboard: str, app_name: str, router: str, policy: str, timeout_s: float
) -> None:
    """Through the app's controller when one runs (its write goes between the engine's, so
    it cannot undo a weight the engine just set); else straight to Serve's config."""
    from rollout.actor import with_standby_policy
    from rollout.cluster import find_controller
    from rollout.serve_control import ServeControl

    controller = find_controller(timeout_s=timeout_s)
    if controller is not None:
        settings = ControllerPing.model_validate(_call(controller.ping, timeout_s=timeout_s))
        if settings.app_name == app_name:
            _call(controller.set_standby_policy, policy, router, timeout_s=timeout_s)
            return
    control = ServeControl(dashboard)
    try:
        control.update_user_configs(
            app_name, {router: lambda cfg: with_standby_policy(cfg, policy)}
        )
    finally:
        control.close()


@cli.command("standby")
@click.option("--app", "app_name", default="ranker", show_default=True,
              help="The Serve application.")  # fmt: skip
@click.option("--router", default="router", show_default=True,
              help="The application's router deployment.")  # fmt: skip
@click.option(
    "--policy",
    type=click.Choice(["auto", "always", "never"]),
    default=None,
    help="Set the router's standby policy: auto (the accuracy guard decides), always or never "
    "(the operator overrides it). A live change of the router's user_config.",
)
@_cluster_options
def standby_command(
    app_name: str,
    router: str,
    policy: str | None,
    address: str | None,
    db_url: str | None,
    dashboard: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """The router's hot standby: where traffic goes, each breaker, the accuracy guard."""
    from app.errors import ClusterUnreachable
    from rollout.cluster import connect
    from rollout.serve_control import ServeControl

    deadline = time.monotonic() + timeout_s
    # Attached for the dashboard URL and the controller; the router is asked over HTTP.
    cluster_dashboard = connect(address, timeout_s)
    url = dashboard or cluster_dashboard
    if not url:
        raise ConfigError("--dashboard: the cluster's dashboard URL is unknown; give it")
    control = ServeControl(url)
    try:
        details = control.details()
    finally:
        control.close()
    if app_name not in (details.get("applications") or {}):
        raise NotFound(f"--app {app_name}: no such Serve application")
    status_url = _status_url(details, app_name, url)
    # Before any write: an app without a fallback is refused, its config left alone.
    view = _standby_view(status_url, app_name, deadline - time.monotonic())
    if policy is not None and view.policy != policy:
        _set_standby_policy(url, app_name, router, policy, timeout_s)
        while (view := _standby_view(status_url, app_name, deadline - time.monotonic())).policy != (
            policy
        ):
            if time.monotonic() > deadline:
                raise ClusterUnreachable(
                    f"the router still has policy {view.policy!r} after {timeout_s:g} s (its "
                    "config_error in /v1/status says why if it refused the change)"
                )
            time.sleep(0.2)
    if as_json:
        emit(view.model_dump(mode="json"))
    else:
        from rollout.status_view import standby_lines

        click.echo("\n".join(terminal_safe(line) for line in standby_lines(view)))


@cli.command("history")
@click.option("--db", "db_url", envvar="ROLLOUT_DB", default=None)
@click.option("--model", default="ranker", show_default=True)
@click.option("--env", "env", default="default", show_default=True)
@click.option("--limit", type=LIST_LIMIT, default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def history_command(db_url: str | None, model: str, env: str, limit: int, as_json: bool) -> None:
    """Past and current rollouts, newest first, from the registry."""
    from app.registry import default_registry_url, open_registry

    with open_registry(db_url or default_registry_url(), access="read") as registry:
        records = registry.list_rollouts(model, env, limit=limit)
    if as_json:
        for record in records:
            emit(record.to_dict())
        return
    if not records:
        click.echo("no rollouts")
    for r in records:
        events = (r.state or {}).get("events") or []
        click.echo(
            terminal_safe(
                f"{r.created_at:%Y-%m-%d %H:%M:%S} {r.id}: {r.candidate_artifact_id} over "
                f"{r.baseline_artifact_id}: {r.phase}" + (f" ({r.reason})" if r.reason else "")
            )
        )
        for event in events[-3:]:
            at = datetime.fromtimestamp(float(event.get("at") or 0), UTC)
            click.echo(terminal_safe(f"    {at:%H:%M:%S} {event['event']}: {event['message']}"))


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
