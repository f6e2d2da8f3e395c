"""The ``rollout`` commands that make and check artifacts on this machine: ``pack``,
``verify`` (with ``--load``: build, strictly load and dry-run), ``replay``, ``keygen`` and
``make-demo-artifacts``. None of them talks to a cluster.

Each prints one JSON line on stdout (``--json`` also keeps the terminal quiet: no progress
bar on stderr). Torch, the cache and rich are imported by the commands that use them: the
CLI starts without them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import click

from app.contracts import EXPECTED_DIVERGENCE_KEY
from app.errors import ArtifactRejected, ConfigError, FetchFailed, RolloutSystemError
from app.manifest import Architecture, is_sha256_hex
from app.safe_text import redact_in, terminal_safe
from app.signing import KEY_KINDS, KeyKind
from rollout.cli.options import check_signature_file, trust_from_options, trust_options
from rollout.cli.render import emit
from rollout.cli.verified_load import (
    candidate_load,
    fetch_and_load_strictly,
    fetch_servable,
    servable_check,
    verified_model,
)

if TYPE_CHECKING:  # imported where used: the CLI starts without torch, the cache or rich
    from app.contracts import ExpectedDivergence
    from app.loading.pipeline import FetchedModel

DEFAULT_CACHE_DIR: Final = "var/cache"

# `pack` and `verify` print one JSON line either way; --json also keeps the terminal quiet.
_json_mode_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Machine mode: the JSON line only, never a progress bar (one is drawn on stderr "
    "when it is a terminal).",
)


def _sha256_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not is_sha256_hex(value.lower()):
        raise click.BadParameter("must be 64 hex characters")
    return value.lower()


@click.command()
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
    from rollout.cli.progress import progress_bars, wanted

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


@click.command()
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
    from rollout.cli.progress import progress_bars, wanted

    trust = trust_from_options(trust_args)
    started = time.monotonic()
    with _redacting(manifest_uri), progress_bars(wanted(as_json)) as bars:
        cache = ArtifactCache(cache_dir, trust=TrustPolicy.of(trust, cli=True))
        servable = servable_check(model)
        if load:
            # A cold fetch feeds the weights into the model as it hashes them.
            prepared = candidate_load(memory_budget, servable, cache, manifest_uri)
            fetched = fetch_and_load_strictly(cache, manifest_uri, manifest_sha256, prepared, bars)
            artifact = fetched.artifact
            payload_loaded = _loaded(fetched)
        else:
            artifact = fetch_servable(cache, manifest_uri, manifest_sha256, servable, bars)
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


def _loaded(fetched: FetchedModel) -> dict[str, Any]:
    """What ``verify --load`` says of the model it loaded; the model closed, its lease gone."""
    model = fetched.model
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
        fetched.lease.release()


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


@click.command()
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
    from rollout.cli.progress import progress_bars, wanted

    trust = trust_from_options(trust_args)
    path, count, seed = _requests_option_check(requests_path, generated, seed)
    with progress_bars(wanted(as_json)) as bars:
        cache = ArtifactCache(cache_dir, trust=TrustPolicy.of(trust, cli=True))
        baseline = verified_model(cache, baseline_dir, baseline_sha256, model, bars)
        try:
            # The requests are the baseline's schema (its family's); a bad requests file is
            # refused before the candidate is fetched.
            schema = baseline.family.schema
            requests = (
                requests_file(path, schema)
                if path is not None
                else generated_requests(count, seed=seed, schema=schema)
            )
            candidate = verified_model(cache, candidate_dir, candidate_sha256, model, bars)
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


@click.command("make-demo-artifacts")
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


@click.command()
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


# What main.py adds to the ``rollout`` group.
COMMANDS: Final[tuple[click.Command, ...]] = (
    pack,
    verify,
    replay,
    keygen,
    make_demo_artifacts_command,
)
