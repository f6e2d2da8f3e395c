"""The shipped configs pass Ray's own schema validation and our AppArgs (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from app.contracts import AppArgs
from deployments.app import PROJECT_ROOT, build_app

CONFIGS = ["configs/local.yaml", "configs/serve.yaml"]


@pytest.mark.parametrize("name", CONFIGS)
def test_serve_config_validates(name: str) -> None:
    doc = yaml.safe_load((PROJECT_ROOT / name).read_text())
    schema = ServeDeploySchema.model_validate(doc)
    assert [a.name for a in schema.applications] == ["ranker"]
    app = doc["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    AppArgs.model_validate(app["args"])


def test_serve_yaml_is_sized_for_gpus_and_long_loads() -> None:
    doc = yaml.safe_load((PROJECT_ROOT / "configs/serve.yaml").read_text())
    args = AppArgs.model_validate(doc["applications"][0]["args"])
    for cohort in (args.stable, args.canary):
        assert cohort.num_gpus == 1
        assert cohort.graceful_shutdown_timeout_s >= 90
    assert args.stable.num_replicas > 1 and args.canary.num_replicas >= 1
    assert not args.router.allow_cohort_header
    # The hot standby on cheaper capacity: CPU, with a target of its own.
    assert args.fallback is not None and args.fallback.num_gpus == 0
    assert args.fallback.target is not None and args.router.standby.policy == "auto"


def test_local_config_builds_with_its_demo_artifacts(tmp_path: Path) -> None:
    doc = yaml.safe_load((PROJECT_ROOT / "configs/local.yaml").read_text())
    args = dict(doc["applications"][0]["args"])
    args["demo_artifacts_dir"] = str(tmp_path / "demo")  # not the developer's ./var
    app = build_app(AppArgs.model_validate(args))
    assert app is not None
    assert (tmp_path / "demo" / "ranker-v41" / "manifest.json").is_file()
    assert (tmp_path / "demo" / "ranker-lite-v1" / "manifest.json").is_file()  # the fallback


def test_cluster_yaml_has_a_cpu_head_and_gpu_workers() -> None:
    doc = yaml.safe_load((PROJECT_ROOT / "cluster.yaml").read_text())
    types = doc["available_node_types"]
    assert types[doc["head_node_type"]]["resources"] == {"CPU": 0}
    workers = [t for name, t in types.items() if name != doc["head_node_type"]]
    assert workers and all(t["max_workers"] >= t["min_workers"] >= 1 for t in workers)
