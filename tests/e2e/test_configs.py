"""The shipped configs pass Ray's own schema validation and our AppArgs (no cluster needed)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from app.contracts import AppArgs, Target
from deployments.app import PROJECT_ROOT, build_app
from rollout.serve_config import render_serve_config

CONFIGS = ["configs/local.yaml", "configs/serve.yaml"]
# What the registry would give the production templates (rollout registry serve-config).
STABLE = Target(
    revision=3,
    artifact_id="ranker-v41",
    manifest_uri="s3://ml-artifacts/ranker/ranker-v41/manifest.json",
    manifest_sha256="ab" * 32,
)
FALLBACK_TARGET = Target(
    revision=1,
    artifact_id="ranker-lite-v1",
    manifest_uri="s3://ml-artifacts/ranker/ranker-lite-v1/manifest.json",
    manifest_sha256="cd" * 32,
)


def serve_config(name: str) -> dict[str, Any]:
    """A config as it is deployed: the production template rendered, the local one as is."""
    doc = yaml.safe_load((PROJECT_ROOT / name).read_text())
    if name == "configs/serve.yaml":
        return render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=FALLBACK_TARGET)
    return doc


@pytest.mark.parametrize("name", CONFIGS)
def test_serve_config_validates(name: str) -> None:
    doc = serve_config(name)
    schema = ServeDeploySchema.model_validate(doc)
    assert [a.name for a in schema.applications] == ["ranker"]
    app = doc["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    AppArgs.model_validate(app["args"])


def test_the_rayservice_runs_serve_yaml_on_the_same_layout() -> None:
    """configs/kuberay/rayservice.yaml: serve.yaml's application verbatim; KubeRay's
    rayStartParams are strings (map[string]string); a CPU-less head; one GPU per worker pod,
    as each model replica asks; token auth; cluster.yaml's metrics interval; the trust anchor
    and the cache mounted where serve.yaml looks for them."""
    manifest = yaml.safe_load((PROJECT_ROOT / "configs/kuberay/rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    spec = manifest["spec"]
    inner = yaml.safe_load(spec["serveConfigV2"])
    assert inner == yaml.safe_load((PROJECT_ROOT / "configs/serve.yaml").read_text())
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ranker-ray-token"}
    head = cluster["headGroupSpec"]
    groups = [head, *cluster["workerGroupSpecs"]]
    for group in groups:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group
    assert head["rayStartParams"]["num-cpus"] == "0"
    # KubeRay runs `ray start` with each parameter pasted in as --key=value, unquoted, by a
    # shell: what the shell makes of it must be the JSON cluster.yaml's head gives Ray.
    shown = subprocess.run(
        ["bash", "-c", f"printf %s --system-config={head['rayStartParams']['system-config']}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    kuberay_config = json.loads(shown.removeprefix("--system-config="))
    launcher = yaml.safe_load((PROJECT_ROOT / "cluster.yaml").read_text())
    head_start = " ".join(launcher["head_start_ray_commands"][1].split())
    launcher_config = shlex.split(head_start.split("--system-config=")[1])[0]
    assert kuberay_config == json.loads(launcher_config) == {"metrics_report_interval_ms": 2000}
    args = AppArgs.model_validate(serve_config("configs/serve.yaml")["applications"][0]["args"])
    (gpu,) = cluster["workerGroupSpecs"]
    container = gpu["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == args.stable.num_gpus == 1
    assert gpu["maxReplicas"] >= gpu["minReplicas"] >= 1
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(args.trust_key or "").parent) in mounts and args.cache_dir in mounts
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert inner["http_options"]["port"] in head_ports
    # The container beside the head that keeps the rollout controller running reaches the
    # head's GCS and dashboard with the cluster's token, and the registry from its secret.
    ray_head, keeper = head["template"]["spec"]["containers"]
    assert keeper["command"][:3] == ["rollout", "controller", "keep"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in keeper["env"]}
    ports = {p["name"]: p["containerPort"] for p in ray_head["ports"]}
    assert env["RAY_ADDRESS"] == f"127.0.0.1:{ports['gcs-server']}"
    assert env["RAY_DASHBOARD_URL"] == f"http://127.0.0.1:{ports['dashboard']}"
    assert env["RAY_AUTH_MODE"] == "token"
    token = env["RAY_AUTH_TOKEN"]["secretKeyRef"]
    assert token == {"name": cluster["authOptions"]["secretName"], "key": "auth_token"}
    # Only there: the head's workers, tasks and job drivers inherit ray-head's environment
    # (tests/unit/test_secret_placement.py).
    assert env["ROLLOUT_DB"] == {"secretKeyRef": {"name": "ranker-registry", "key": "url"}}
    assert "ROLLOUT_DB" not in {e["name"] for e in ray_head.get("env", [])}


def test_serve_yaml_is_sized_for_gpus_and_long_loads() -> None:
    doc = serve_config("configs/serve.yaml")
    args = AppArgs.model_validate(doc["applications"][0]["args"])
    for cohort in (args.stable, args.canary):
        assert cohort.num_gpus == 1
        assert cohort.graceful_shutdown_timeout_s >= 90
    # Autoscaled by Serve, in the config's deployments list (where the controller moves the
    # canary's floor in place): stable never below several replicas, the idle canary pool down
    # to none, both able to scale up under the router's coalescing (calls in flight per
    # replica are at most coalesce_calls_per_replica x router replicas).
    overrides = {e["name"]: e for e in doc["applications"][0]["deployments"]}
    stable = AutoscalingConfig(**overrides["stable"]["autoscaling_config"])
    canary = AutoscalingConfig(**overrides["canary"]["autoscaling_config"])
    assert stable.min_replicas > 1 and stable.max_replicas > stable.min_replicas
    assert canary.min_replicas == 0 and canary.max_replicas >= 1
    ceiling = args.router.coalesce_calls_per_replica * args.router_replicas
    assert stable.target_ongoing_requests < ceiling and canary.target_ongoing_requests < ceiling
    assert "policy" not in overrides["canary"]["autoscaling_config"]
    assert args.router.probe_idle_canary is False  # a probe would start an idle canary
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
