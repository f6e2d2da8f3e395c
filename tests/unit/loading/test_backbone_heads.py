"""Backbone and head artifacts: a head loads on the resident backbone and shares its tensors.

Real packed artifacts, a real verified cache, real torch, the real replica (in process): a
head's model reads the backbone's storage (same data pointers), a head for another backbone
is refused without touching what serves, and a backbone is freed only once no generation
uses it.
"""

from __future__ import annotations

import gc
import json
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cache import ArtifactCache
from app.demo_artifacts import SplitArtifacts, family_weights, pack_split_artifacts
from app.errors import ArtifactRejected
from app.loading.backbones import ResidentBackbone
from app.loading.candidate import load_backbone, load_verified
from app.loading.memory import MemoryBudget
from app.loading.model import LoadedModel
from app.manifest import (
    Architecture,
    BackboneRef,
    backbone_manifest_uri,
    parse_manifest,
)
from app.model_family import SHIPPED_FAMILIES, families_for
from app.models.ranker_mlp import RANKER_MLP
from app.models.two_tower import TWO_TOWER
from app.packing import PackResult
from app.polling import wait_until
from app.replica import RankerReplica
from app.request_bodies import rank_bodies
from tests.artifacts import pack_family

ARCHS = {
    RANKER_MLP: Architecture(
        name=RANKER_MLP,
        version=1,
        # The top block belongs to the head as well as the output layer.
        params={"hidden_dim": 32, "num_layers": 2, "context_dim": 4, "head_layers": 1},
    ),
    TWO_TOWER: Architecture(
        name=TWO_TOWER,
        version=1,
        params={"hidden_dim": 16, "embed_dim": 8, "context_dim": 4},
    ),
}
MODELS = {RANKER_MLP: "ranker", TWO_TOWER: "recs-two-tower"}
FAMILIES = families_for(SHIPPED_FAMILIES)
pytestmark = pytest.mark.backbone


def split(root: Path, family: str) -> tuple[SplitArtifacts, SplitArtifacts]:
    """Backbone b1 with heads h1 (b1's own seed: the whole model of seed 1) and h2; backbone
    b2 with head h3."""
    arch, model = ARCHS[family], MODELS[family]
    one = pack_split_artifacts(
        root, arch, backbone_id="b1", backbone_seed=1, heads=[("h1", 1), ("h2", 2)], model=model
    )
    two = pack_split_artifacts(
        root, arch, backbone_id="b2", backbone_seed=5, heads=[("h3", 5)], model=model
    )
    return one, two


@pytest.fixture(scope="module", params=[RANKER_MLP, TWO_TOWER])
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def packed(family: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackResult]:
    root = tmp_path_factory.mktemp(f"split-{family}")
    one, two = split(root, family)
    return {
        "b1": one.backbone,
        "h1": one.heads[0],
        "h2": one.heads[1],
        "b2": two.backbone,
        "h3": two.heads[0],
    }


def wires(family: str, count: int = 4) -> list[Any]:
    schema = FAMILIES.schema(FAMILIES.families[0 if family == RANKER_MLP else 1].schema.name)
    return [
        schema.parse(json.dumps(b).encode()).wire
        for b in rank_bodies(count, seed=3, schema=schema, candidates=7, top_n=3)
    ]


class Shelf:
    """A minimal backbone source for loader tests: load each pinned backbone from beside the
    head, once, through a real cache."""

    def __init__(self, cache: ArtifactCache, head_uri: str) -> None:
        self.cache, self.head_uri = cache, head_uri
        self.loaded: dict[str, ResidentBackbone] = {}

    def __call__(self, head: Any) -> ResidentBackbone:
        ref: BackboneRef = head.backbone
        if ref.artifact_id not in self.loaded:
            uri = backbone_manifest_uri(self.head_uri, ref)
            artifact = self.cache.fetch_verified(uri, ref.manifest_sha256)
            self.loaded[ref.artifact_id] = load_backbone(artifact)
        return self.loaded[ref.artifact_id].acquire()


def fetch(cache: ArtifactCache, p: PackResult) -> Any:
    return cache.fetch_verified(p.manifest_uri, p.manifest_sha256)


# --------------------------------------------------------------------------- manifests


def test_a_head_manifest_pins_its_backbone_and_a_whole_models_bytes_are_unchanged(
    packed: dict[str, PackResult], tmp_path: Path, family: str
) -> None:
    head = parse_manifest((packed["h1"].out_dir / "manifest.json").read_bytes())
    assert head.kind == "head" and head.backbone is not None
    assert head.backbone.artifact_id == "b1"
    assert head.backbone.manifest_sha256 == packed["b1"].manifest_sha256
    backbone = parse_manifest((packed["b1"].out_dir / "manifest.json").read_bytes())
    assert backbone.kind == "backbone" and backbone.backbone is None
    # Only the weights: the preprocessing and score bands are the heads'.
    assert [f.path for f in backbone.files] == ["weights.safetensors"]
    whole = pack_family(tmp_path, family, seed=1)
    raw = (whole.out_dir / "manifest.json").read_text()
    assert '"kind"' not in raw and '"backbone"' not in raw
    assert parse_manifest(raw.encode()).kind == "model"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kind": "head"}, "names its backbone"),
        ({"backbone": {"artifact_id": "b1", "manifest_sha256": "0" * 64}}, "has no backbone"),
        ({"kind": "sidecar"}, "kind"),
    ],
)
def test_kind_and_backbone_are_validated(
    packed: dict[str, PackResult], change: dict[str, Any], message: str
) -> None:
    doc = json.loads((packed["b1"].out_dir / "manifest.json").read_bytes())
    doc.pop("kind")
    doc.update(change)
    with pytest.raises(ArtifactRejected, match=message) as info:
        parse_manifest(json.dumps(doc).encode())
    assert info.value.category == "schema"


def test_the_backbone_lies_beside_its_head_in_any_store() -> None:
    ref = BackboneRef(artifact_id="rb-1", manifest_sha256="a" * 64)
    assert (
        backbone_manifest_uri("s3://bucket/models/head-7/manifest.json", ref)
        == "s3://bucket/models/rb-1/manifest.json"
    )
    assert (
        backbone_manifest_uri("file:///srv/a/head-7/manifest.json", ref)
        == "file:///srv/a/rb-1/manifest.json"
    )
    assert (
        backbone_manifest_uri("https://h.example/m/head-7/manifest.json?X-Sig=abc", ref)
        == "https://h.example/m/rb-1/manifest.json"
    )
    assert backbone_manifest_uri("s3://bucket/head-7/manifest.json", ref) == (
        "s3://bucket/rb-1/manifest.json"
    )
    # A head at the top of its bucket has no "beside": never another bucket.
    with pytest.raises(ArtifactRejected, match="not in a directory of its own") as info:
        backbone_manifest_uri("s3://bucket/manifest.json", ref)
    assert info.value.category == "backbone"


# --------------------------------------------------------------------------- loading


def test_a_head_on_its_backbone_is_the_whole_model_and_shares_the_backbones_storage(
    packed: dict[str, PackResult], tmp_path: Path, family: str
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    shelf = Shelf(cache, packed["h1"].manifest_uri)
    h1 = load_verified(fetch(cache, packed["h1"]), backbones=shelf)
    h2 = load_verified(fetch(cache, packed["h2"]), backbones=shelf)
    backbone = shelf.loaded["b1"]
    assert backbone.uses == 2 and h1.backbone is backbone and h2.backbone is backbone
    params1 = dict(h1._model.named_parameters())  # type: ignore[union-attr]
    params2 = dict(h2._model.named_parameters())  # type: ignore[union-attr]
    family_decl = FAMILIES.resolve(ARCHS[family])[0]
    for key, tensor in backbone.tensors.items():
        assert params1[key].data_ptr() == tensor.data_ptr() == params2[key].data_ptr(), key
    validated = FAMILIES.resolve(ARCHS[family])[1].validate(ARCHS[family])
    heads = [k for k in params1 if family_decl.is_head_key(k, validated)]
    assert heads and all(params1[k].data_ptr() != params2[k].data_ptr() for k in heads)
    # Each model counts the backbone once; what a head adds is its own tensors.
    head_bytes = sum(params1[k].numel() * params1[k].element_size() for k in heads)
    assert h1.own_bytes == head_bytes and h1.param_bytes == head_bytes + backbone.nbytes
    # h1's head is b1's own seed: with its backbone it is exactly the whole model of seed 1.
    whole_weights = family_weights(ARCHS[family], seed=1)
    for key, tensor in params1.items():
        assert torch.equal(tensor.detach(), whole_weights[key]), key
    requests = wires(family)
    scores1 = [[c.score for c in r] for r in h1.rank_batch(requests)]
    assert scores1 != [[c.score for c in r] for r in h2.rank_batch(requests)]
    # Closing one head keeps the backbone for the other; the last user frees it.
    h1.close()
    assert not backbone.freed and backbone.uses == 1
    assert h2.rank_batch(requests)
    tensor_ref = weakref.ref(next(iter(backbone.tensors.values())))
    h2.close()
    del params1, params2
    gc.collect()
    assert backbone.freed and backbone.uses == 0
    assert tensor_ref() is None  # the memory is gone, not merely forgotten


def test_a_second_heads_dry_run_computes_only_the_heads_half(
    packed: dict[str, PackResult], tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    network = FAMILIES.resolve(ARCHS[family])[0].network
    original = type(network).backbone_forward
    calls: list[int] = []

    def counted(self: Any, model: Any, batch: Any) -> Any:
        calls.append(1)
        return original(self, model, batch)

    monkeypatch.setattr(type(network), "backbone_forward", counted)
    cache = ArtifactCache(tmp_path / "cache")
    shelf = Shelf(cache, packed["h1"].manifest_uri)
    h1 = load_verified(fetch(cache, packed["h1"]), backbones=shelf)
    assert calls, "the first head's dry run runs the backbone"
    first = len(calls)
    h2 = load_verified(fetch(cache, packed["h2"]), backbones=shelf)
    assert len(calls) == first, "the second head reused the backbone's dry-run outputs"
    assert shelf.loaded["b1"].feature_bytes > 0
    # What the head's half gives over the kept outputs is the full forward's answer.
    batch = wires(family)
    cached, _ = h2._dry_run_logits(batch)
    full, _ = h2._logits(batch)
    assert torch.equal(cached, full)
    h1.close()
    h2.close()


def test_a_dry_run_that_writes_the_shared_backbone_is_refused(
    packed: dict[str, PackResult], tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    shelf = Shelf(cache, packed["h1"].manifest_uri)
    h1 = load_verified(fetch(cache, packed["h1"]), backbones=shelf)
    backbone = shelf.loaded["b1"]
    network = FAMILIES.resolve(ARCHS[family])[0].network
    original = type(network).head_forward
    key = next(iter(backbone.tensors))

    def writing(self: Any, model: Any, features: Any) -> Any:
        dict(model.named_parameters())[key].mul_(1.0)  # same values, but a write
        return original(self, model, features)

    monkeypatch.setattr(type(network), "head_forward", writing)
    with pytest.raises(ArtifactRejected, match=r"wrote .* of the shared backbone b1") as info:
        load_verified(fetch(cache, packed["h2"]), backbones=shelf)
    assert info.value.category == "dry_run"
    assert backbone.uses == 1  # the refused head gave its use back; h1 still holds one
    h1.close()


def test_a_family_whose_halves_disagree_with_its_forward_is_refused(
    packed: dict[str, PackResult], tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    network = FAMILIES.resolve(ARCHS[family])[0].network
    original = type(network).head_forward

    def shifted(self: Any, model: Any, features: Any) -> Any:
        return original(self, model, features) + 1.0  # what requests get is forward's

    monkeypatch.setattr(type(network), "head_forward", shifted)
    cache = ArtifactCache(tmp_path / "cache")
    shelf = Shelf(cache, packed["h1"].manifest_uri)
    with pytest.raises(ArtifactRejected, match=r"halves score .* apart") as info:
        load_verified(fetch(cache, packed["h1"]), backbones=shelf)
    assert info.value.category == "dry_run"


def test_a_head_without_a_backbone_source_or_on_another_backbone_is_refused(
    packed: dict[str, PackResult], tmp_path: Path
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    with pytest.raises(ArtifactRejected, match="needs backbone b1") as info:
        load_verified(fetch(cache, packed["h1"]))
    assert info.value.category == "backbone" and info.value.artifact_id == "h1"
    b2 = load_backbone(fetch(cache, packed["b2"]))
    with pytest.raises(ArtifactRejected, match="pins backbone b1") as info:
        load_verified(fetch(cache, packed["h1"]), backbones=lambda _m: b2.acquire())
    assert info.value.category == "backbone"
    assert b2.uses == 0 and b2.freed  # the refused head gave its use back


def test_a_backbone_is_never_served_alone_and_a_model_is_no_backbone(
    packed: dict[str, PackResult], tmp_path: Path, family: str
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    with pytest.raises(ArtifactRejected, match="never served alone") as info:
        load_verified(fetch(cache, packed["b1"]))
    assert info.value.category == "backbone"
    whole = pack_family(tmp_path / "whole", family, seed=1)
    with pytest.raises(ArtifactRejected, match="a backbone was expected"):
        load_backbone(fetch(cache, whole))


def test_a_head_load_budgets_the_head_alone_beside_a_resident_backbone(
    packed: dict[str, PackResult], tmp_path: Path
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    shelf = Shelf(cache, packed["h1"].manifest_uri)
    serving = load_verified(fetch(cache, packed["h1"]), backbones=shelf)
    budget = MemoryBudget(capacity_bytes=1 << 40, margin_bytes=0, margin_fraction=0.0)
    h2 = load_verified(
        fetch(cache, packed["h2"]),
        backbones=shelf,
        budget=budget,
        resident_bytes=serving.param_bytes,
    )
    assert h2.memory is not None
    assert h2.memory.candidate_weight_bytes == h2.own_bytes
    assert h2.memory.resident_bytes == serving.param_bytes  # the shared part, once
    h2.close()
    serving.close()


# --------------------------------------------------------------------------- the replica


@pytest.fixture
def replica() -> Iterator[RankerReplica]:
    r = RankerReplica("r-backbone", loader_nice=0)
    yield r
    r.close()


def config(tmp: Path, family: str, target: PackResult, revision: int) -> dict[str, Any]:
    return {
        "cohort": "canary",
        "cache_dir": str(tmp / "cache"),
        "retry": {"initial_s": 0.01, "cap_s": 0.02, "max_attempts": 2},
        "models": list(SHIPPED_FAMILIES),
        "feature_schema": target.feature_schema,
        "loading": {"model": MODELS[family]},
        "target": target.target(revision).model_dump(mode="json"),
    }


def test_a_replica_swaps_heads_on_one_backbone_and_frees_it_only_when_unused(
    packed: dict[str, PackResult], replica: RankerReplica, tmp_path: Path, family: str
) -> None:
    requests = wires(family, 2)
    assert replica.reconfigure(config(tmp_path, family, packed["h1"], 1))
    assert replica.rank(requests).model.artifact_id == "h1"
    first = replica.report()
    assert first.actual_backbone == "b1"
    b1_bytes = (packed["b1"].out_dir / "weights.safetensors").stat().st_size
    assert first.timings.backbone_loaded_bytes == b1_bytes
    shelf = replica._loader.backbones
    (backbone,) = shelf.resident
    # An in-flight request borrows h1's generation while h2 is installed.
    borrowed = threading.Event()
    release = threading.Event()
    in_flight: list[tuple[str, int]] = []

    def hold() -> None:
        with replica._holder.borrow() as gen:
            borrowed.set()
            release.wait(30)
            # Still answers on the old head, after the new one was installed.
            in_flight.append((gen.artifact_id, len(gen.model.rank_batch(requests))))

    holder = threading.Thread(target=hold)
    holder.start()
    assert borrowed.wait(10)
    assert replica.reconfigure(config(tmp_path, family, packed["h2"], 2))
    wait_until(lambda: replica.report().actual_artifact == "h2", 30.0, "h2 installed")
    report = replica.report()
    assert report.timings.backbone_loaded_bytes == 0  # the head alone was loaded
    assert report.actual_backbone == "b1"
    assert shelf.resident == [backbone] and backbone.uses == 2  # h1 in flight, h2 serving
    new = replica._holder.current
    assert new is not None
    old_params = dict(new.model._model.named_parameters())
    for key, tensor in backbone.tensors.items():
        assert old_params[key].data_ptr() == tensor.data_ptr()
    release.set()
    holder.join(10)
    assert in_flight == [("h1", len(requests))]
    assert replica._holder.wait_idle(10)
    assert backbone.uses == 1 and not backbone.freed  # h1 cleaned up, b1 stays for h2
    # A head for another backbone: loaded beside (the budget allows it), h2 keeps serving
    # until it is installed, then b1 is freed with its last user.
    assert replica.reconfigure(config(tmp_path, family, packed["h3"], 3))
    wait_until(lambda: replica.report().actual_artifact == "h3", 30.0, "h3 installed")
    assert replica._holder.wait_idle(10)
    assert backbone.freed and [b.artifact_id for b in shelf.resident] == ["b2"]
    assert replica.report().actual_backbone == "b2"


def test_a_replica_refuses_a_head_whose_backbone_cannot_be_had_and_keeps_serving(
    packed: dict[str, PackResult], replica: RankerReplica, tmp_path: Path, family: str
) -> None:
    requests = wires(family, 2)
    assert replica.reconfigure(config(tmp_path, family, packed["h1"], 1))
    serving = replica._holder.current
    assert serving is not None
    # A head whose pinned backbone is not in the store (its directory is gone).
    orphan_root = tmp_path / "orphans"
    arch, model = ARCHS[family], MODELS[family]
    orphan = pack_split_artifacts(
        orphan_root, arch, backbone_id="b9", backbone_seed=9, heads=[("h9", 9)], model=model
    )
    shutil.rmtree(orphan.backbone.out_dir)
    assert replica.reconfigure(config(tmp_path, family, orphan.heads[0], 2))
    wait_until(
        lambda: replica.report().phase.value == "failed", 30.0, "the refusal, after its retry"
    )
    err = replica.report().last_error
    # Missing is retryable (it may yet be published there): retried, then reported as such,
    # naming the backbone and where it was looked for.
    assert err is not None and err.category == "missing", err
    assert "backbone b9" in err.message and "cannot be loaded from" in err.message
    assert replica._holder.current is serving
    assert replica.rank(requests).model.artifact_id == "h1"
    (backbone,) = replica._loader.backbones.resident
    assert backbone.artifact_id == "b1" and backbone.uses == 1
    assert isinstance(serving.model, LoadedModel)
