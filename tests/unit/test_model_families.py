"""The model plug-in interface (app.model_family): every shipped family passes the same
loader, dry-run and replica contract, and the service core has no family of its own.

Each contract test runs once per family on a real packed artifact, a real cache and real
torch; a family-specific test shows each family's own dry-run invariant catching a model
that breaks it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.compatibility import check_compatibility
from app.contracts import DEFAULT_FEATURE_SCHEMA, AppArgs, ReplicaConfig
from app.errors import ArtifactRejected, ConfigError, RequestInvalid
from app.loading.candidate import load_verified
from app.manifest import Architecture
from app.model_family import (
    DEFAULT_FAMILIES,
    SHIPPED_FAMILIES,
    Families,
    ModelFamily,
    families_for,
    import_family,
)
from app.models.ranker_mlp import RANKER_MLP
from app.models.ranker_mlp.features import SCHEMA as RANKER_SCHEMA
from app.models.two_tower import TWO_TOWER
from app.packing import PackResult
from app.polling import wait_until
from app.replica import RankerReplica
from app.request_bodies import rank_bodies
from tests.artifacts import family_tiny_weights, fetch_verified, open_verified, pack_family

FAMILIES = (RANKER_MLP, TWO_TOWER)
SHIPPED = families_for(SHIPPED_FAMILIES)


def family_of(name: str) -> ModelFamily:
    return next(f for f in SHIPPED.families if f.name == name)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackResult]:
    root = tmp_path_factory.mktemp("families")
    return {name: pack_family(root, name, seed=3) for name in FAMILIES}


def bodies(family: str, count: int = 6, **shape: int) -> list[bytes]:
    schema = family_of(family).schema
    return [
        json.dumps(b).encode()
        for b in rank_bodies(
            count, seed=11, schema=schema, **{"candidates": 9, "top_n": 4, **shape}
        )
    ]


# --------------------------------------------------------------------------- registration


def test_the_default_schema_is_the_default_familys() -> None:
    assert import_family(DEFAULT_FAMILIES[0]).schema.name == DEFAULT_FEATURE_SCHEMA
    assert RANKER_SCHEMA.name == DEFAULT_FEATURE_SCHEMA
    assert AppArgs().models == list(DEFAULT_FAMILIES)


def test_families_are_found_by_import_path_and_selected_by_architecture() -> None:
    assert [f.name for f in SHIPPED.families] == [RANKER_MLP, TWO_TOWER]
    for name in FAMILIES:
        family, spec = SHIPPED.resolve(Architecture(name=name, version=1, params={}))
        assert (family.name, spec.name) == (name, name)
    with pytest.raises(ArtifactRejected, match="unknown architecture 'gpt'") as info:
        SHIPPED.resolve(Architecture(name="gpt", version=1, params={}))
    assert info.value.category == "runtime"
    # An app that registers only the ranker cannot build a two-tower artifact.
    only_ranker = families_for(DEFAULT_FAMILIES)
    with pytest.raises(ArtifactRejected, match="two-tower"):
        only_ranker.resolve(Architecture(name=TWO_TOWER, version=1, params={}))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("app.models.no_such_family", "cannot import model family"),
        ("app.api", "has no FAMILY"),
    ],
)
def test_a_module_that_is_no_family_is_a_config_error_naming_its_place(
    path: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        Families.from_paths(["app.models.ranker_mlp", path], where="args.models")
    assert info.value.ids["field"] == "args.models[1]"


def test_two_families_declaring_one_architecture_are_refused() -> None:
    ranker = family_of(RANKER_MLP)
    with pytest.raises(ConfigError, match="declared by both"):
        Families([ranker, ranker])


def test_an_unknown_feature_schema_is_named() -> None:
    with pytest.raises(ConfigError, match="'ranker-features-v9' is no registered") as info:
        SHIPPED.schema("ranker-features-v9")
    assert info.value.ids["field"] == "feature_schema"


def test_the_router_side_of_a_family_does_not_import_torch() -> None:
    """The router parses requests with the family's schema and never loads a model."""
    code = (
        "import sys\n"
        "from app.model_family import SHIPPED_FAMILIES, families_for\n"
        "fams = families_for(SHIPPED_FAMILIES)\n"
        "[f.schema for f in fams.families]\n"
        "import deployments.router\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False", done.stderr


# --------------------------------------------------------------------------- request schema


@pytest.mark.parametrize("family", FAMILIES)
def test_a_schema_parses_its_own_bodies_and_names_the_field_of_the_others(family: str) -> None:
    schema = family_of(family).schema
    other = next(f for f in FAMILIES if f != family)
    for raw in bodies(family):
        parsed = schema.parse(raw)
        assert len(parsed.wire.candidate_ids) == 9 and parsed.wire.top_n == 4
        assert parsed.wire.features.dtype == np.float32
    with pytest.raises(RequestInvalid) as info:
        schema.parse(bodies(other)[0])
    assert info.value.status == 422 and info.value.field


@pytest.mark.parametrize("family", FAMILIES)
def test_synthetic_bodies_are_a_function_of_the_seed_and_prefix_stable(family: str) -> None:
    schema = family_of(family).schema
    long = list(schema.synthetic_bodies(5, seed=4, candidates=3, top_n=2))
    short = list(schema.synthetic_bodies(2, seed=4, candidates=3, top_n=2))
    assert long[:2] == short
    assert list(schema.synthetic_bodies(2, seed=5, candidates=3, top_n=2)) != short


# --------------------------------------------------------------------------- network


@pytest.mark.parametrize("family", FAMILIES)
def test_the_network_builds_on_meta_and_its_memory_estimate_counts_its_parameters(
    family: str, packed: dict[str, PackResult]
) -> None:
    fam = family_of(family)
    manifest = open_verified(packed[family]).manifest
    _, spec = SHIPPED.resolve(manifest.architecture)
    params = spec.validate(manifest.architecture)
    with torch.device("meta"):
        module = fam.network.build(params)
    tensors = list(module.state_dict().values())
    assert all(t.device.type == "meta" for t in tensors)
    estimate = fam.network.memory(params)
    assert estimate.param_count == sum(t.numel() for t in tensors)
    assert estimate.largest_tensor >= max(t.numel() for t in tensors)
    assert estimate.workspace_per_row > 0


# --------------------------------------------------------------------------- loader contract


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loader_loads_dry_runs_and_ranks_any_family(
    family: str, packed: dict[str, PackResult], tmp_path: Path
) -> None:
    artifact = fetch_verified(packed[family], tmp_path / "cache")
    assert check_compatibility(artifact.manifest).name == family
    model = load_verified(artifact)
    try:
        assert model.family.name == family
        state = model._model.state_dict()  # type: ignore[union-attr]
        expected = family_tiny_weights(family, seed=3)
        assert set(state) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name  # bit-identical to what was packed
        schema = model.family.schema
        wires = [schema.parse(raw).wire for raw in bodies(family)]
        together = model.rank_batch(wires)
        for wire, answer in zip(wires, together, strict=True):
            assert len(answer) == min(wire.top_n, len(wire.candidate_ids))
            assert [c.score for c in answer] == sorted((c.score for c in answer), reverse=True)
            (alone,) = model.rank_batch([wire])
            assert [c.id for c in alone] == [c.id for c in answer]
            np.testing.assert_allclose(
                [c.score for c in alone], [c.score for c in answer], atol=1e-6
            )
        assert model.loaded_bytes > 0 and model.timings["dry_run"] > 0
    finally:
        model.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_strict_loading_refuses_named_tensors_that_do_not_match(
    family: str, change: str, tmp_path: Path
) -> None:
    weights = family_tiny_weights(family)
    name = sorted(weights)[-1]
    if change == "missing":
        del weights[name]
    elif change == "unexpected":
        weights["extra.weight"] = torch.zeros(2, 2)
    else:
        weights[name] = torch.zeros(*weights[name].shape, 2)
    bad = pack_family(tmp_path, family, weights=weights)
    with pytest.raises(ArtifactRejected) as info:
        load_verified(open_verified(bad))
    assert info.value.category == "load", info.value
    assert (name if change != "unexpected" else "extra.weight") in info.value.detail


@pytest.mark.parametrize("family", FAMILIES)
def test_non_finite_weights_fail_the_dry_run(family: str, tmp_path: Path) -> None:
    weights = family_tiny_weights(family)
    head = next(k for k in sorted(weights) if k.startswith("head") and k.endswith("weight"))
    weights[head] = torch.full_like(weights[head], float("nan"))
    with pytest.raises(ArtifactRejected) as info:
        load_verified(open_verified(pack_family(tmp_path, family, weights=weights)))
    assert info.value.category == "dry_run" and "not finite" in info.value.detail


def test_the_two_tower_dry_run_refuses_a_model_that_mixes_items(
    packed: dict[str, PackResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own invariant: an item's score depends on the user and that item alone. A model
    that normalises over the request's items passes every generic check (shapes, finite,
    sorted, batch-invariant) and fails this one."""
    from app.models.two_tower import network

    honest = network.TwoTower.forward

    def mixes(self: Any, query: Any, context: Any, features: Any, request_index: Any) -> Any:
        logits = honest(self, query, context, features, request_index)
        # Each item's logit shifted by its position among its request's items: the same
        # in any batch (batch-invariant), not in another order.
        rows = torch.arange(logits.shape[0], dtype=logits.dtype)
        starts = torch.zeros(int(request_index.max()) + 1, dtype=logits.dtype).index_reduce_(
            0, request_index, rows, "amin", include_self=False
        )
        return logits + 0.3 * (rows - starts[request_index])

    monkeypatch.setattr(network.TwoTower, "forward", mixes)
    with pytest.raises(ArtifactRejected, match="with the items' order") as info:
        load_verified(open_verified(packed[TWO_TOWER]))
    assert info.value.category == "dry_run"


def test_an_artifact_for_another_schema_than_its_family_is_refused(tmp_path: Path) -> None:
    from app.demo_artifacts import write_two_tower_source
    from app.packing import pack_artifact

    src = tmp_path / "src"
    write_two_tower_source(src, seed=1, params={"hidden_dim": 8, "embed_dim": 4})
    mislabeled = pack_artifact(
        src,
        tmp_path / "out",
        model="ranker",
        artifact_id="tt",
        feature_schema=DEFAULT_FEATURE_SCHEMA,
    )
    with pytest.raises(ArtifactRejected, match="feature schema") as info:
        load_verified(open_verified(mislabeled))
    assert info.value.category == "schema"


# --------------------------------------------------------------------------- replica contract


@pytest.fixture
def replica() -> Iterator[RankerReplica]:
    r = RankerReplica("r-families", loader_nice=0)
    yield r
    r.close()


def replica_config(tmp: Path, family: str, **changes: Any) -> dict[str, Any]:
    schema = family_of(family).schema.name
    model = "ranker" if family == RANKER_MLP else "recs-two-tower"
    return {
        "cohort": "canary",
        "cache_dir": str(tmp / "cache"),
        "retry": {"initial_s": 0.01, "cap_s": 0.02, "max_attempts": 2},
        "models": list(SHIPPED_FAMILIES),
        "feature_schema": schema,
        "loading": {"model": model},
        **changes,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_a_replica_serves_any_registered_family_and_refuses_another_schemas_target(
    family: str, packed: dict[str, PackResult], replica: RankerReplica, tmp_path: Path
) -> None:
    target = packed[family].target(3)
    assert target.feature_schema == family_of(family).schema.name
    assert replica.reconfigure(
        replica_config(tmp_path, family, target=target.model_dump(mode="json"))
    )
    wire = replica.schema.parse(bodies(family)[0]).wire
    answer = replica.rank([wire])
    assert answer.model.artifact_id == packed[family].artifact_id
    assert len(answer.rankings[0]) == 4
    # A new target of the other family's schema: refused before anything is fetched (a
    # failed load, reported), the serving model untouched.
    other = next(f for f in FAMILIES if f != family)
    foreign = packed[other].target(4)
    assert replica.reconfigure(
        replica_config(tmp_path, family, target=foreign.model_dump(mode="json"))
    )
    wait_until(lambda: replica.report().last_error is not None, 30.0, "the refusal")
    err = replica.report().last_error
    assert err is not None and err.category == "schema" and foreign.feature_schema in err.message
    assert replica.rank([wire]).model.artifact_id == packed[family].artifact_id


def test_a_replica_refuses_a_config_whose_family_cannot_be_imported(
    packed: dict[str, PackResult], replica: RankerReplica, tmp_path: Path
) -> None:
    good = replica_config(tmp_path, TWO_TOWER, target=packed[TWO_TOWER].target(1).model_dump())
    with pytest.raises(ConfigError, match=r"user_config\.models\[1\]"):
        replica.reconfigure({**good, "models": ["app.models.ranker_mlp", "acme.missing"]})
    assert replica.reconfigure(good)
    bad = {**good, "feature_schema": "acme-v1"}
    assert replica.reconfigure(bad) is False  # refused, never raised, once serving
    err = replica.report().config_error
    assert err is not None and err.field == "user_config.feature_schema"
    assert replica.config.feature_schema == family_of(TWO_TOWER).schema.name


def test_replica_config_defaults_to_the_default_family() -> None:
    cfg = ReplicaConfig(cohort="stable")
    assert cfg.models == list(DEFAULT_FAMILIES) and cfg.feature_schema == DEFAULT_FEATURE_SCHEMA


def test_a_config_that_changes_the_served_schema_under_a_loaded_target_is_refused(
    packed: dict[str, PackResult], replica: RankerReplica, tmp_path: Path
) -> None:
    """The target's schema is checked with the config, not only when a target loads: the
    same target under another served schema would leave the loaded model serving requests
    it cannot read."""
    good = replica_config(tmp_path, TWO_TOWER, target=packed[TWO_TOWER].target(1).model_dump())
    assert replica.reconfigure(good)
    switched = {**good, "feature_schema": DEFAULT_FEATURE_SCHEMA}
    assert replica.reconfigure(switched) is False
    err = replica.report().config_error
    assert err is not None and err.field == "user_config.feature_schema", err
    assert replica.schema.name == family_of(TWO_TOWER).schema.name
    wire = replica.schema.parse(bodies(TWO_TOWER)[0]).wire
    assert replica.rank([wire]).model.artifact_id == packed[TWO_TOWER].artifact_id
