"""Secrets only where they are needed (audit N5): the registry URL only in the RayService's
rollout-controller sidecar, never in the Ray containers whose workers, tasks and job drivers
inherit the environment; every container without privilege escalation (and non-root where the
image allows); the controller's ``ping`` never shows a URL's credentials to a cluster caller;
private keys kept out of the checkout, which git and ``cluster.yaml``'s sync both ignore."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from app.contracts import ControllerPing, ControllerSettings

ROOT = Path(__file__).resolve().parents[2]
RAYSERVICE = ROOT / "configs" / "kuberay" / "rayservice.yaml"
REGISTRY_SECRET = "ranker-registry"
# rayproject/ray images run as user `ray`, uid 1000 in group `users` (gid 100); the image of
# this manifest is built on one of them (and the artifact cache is chowned to 1000:100).
RAY_IMAGE_UID = 1000


def manifest() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE.read_text())


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


def all_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        container
        for spec in pod_specs(doc)
        for container in [*spec.get("initContainers", []), *spec["containers"]]
    ]


def head_containers(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def secret_refs(container: dict[str, Any]) -> set[str]:
    """The Secrets a container's environment reads (env valueFrom and envFrom)."""
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    refs |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    return refs


# -- the manifest ---------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; the Kubernetes API refuses or warns."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = [loader.construct_object(key) for key, _value in node.value]
    repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
    assert not repeated, f"repeated keys {repeated} at line {node.start_mark.line + 1}"
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def test_no_key_of_the_manifest_is_given_twice() -> None:
    # A second securityContext (or env) in one container would silently replace the first.
    assert yaml.load(RAYSERVICE.read_text(), Loader=_UniqueKeyLoader) == manifest()


def test_the_registry_url_is_in_the_controller_sidecar_only() -> None:
    doc = manifest()
    head = head_containers(doc)
    sidecar_env = {e["name"]: e.get("valueFrom") for e in head["rollout-controller"]["env"]}
    assert sidecar_env["ROLLOUT_DB"] == {"secretKeyRef": {"name": REGISTRY_SECRET, "key": "url"}}
    # Every Ray container (head and workers): its environment goes to every worker process,
    # task and job driver on that node.
    for container in all_containers(doc):
        if container["name"] == "rollout-controller":
            continue
        names = {e["name"] for e in container.get("env", [])}
        assert "ROLLOUT_DB" not in names, container["name"]
        assert REGISTRY_SECRET not in secret_refs(container), container["name"]


def test_every_container_runs_without_privilege_escalation() -> None:
    containers = all_containers(manifest())
    assert {"ray-head", "rollout-controller", "ray-worker", "artifact-cache-owner"} <= {
        c["name"] for c in containers
    }
    for container in containers:
        context = container.get("securityContext") or {}
        assert context.get("allowPrivilegeEscalation") is False, container["name"]
        assert context.get("privileged") in (None, False), container["name"]
        assert "ALL" in (context.get("capabilities") or {}).get("drop", []), container["name"]


def test_the_containers_of_the_ray_image_run_as_its_non_root_user() -> None:
    doc = manifest()
    image = head_containers(doc)["ray-head"]["image"]
    ray_image = [c for c in all_containers(doc) if c["image"] == image]
    assert {c["name"] for c in ray_image} == {"ray-head", "rollout-controller", "ray-worker"}
    for container in ray_image:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True, container["name"]
        assert context["runAsUser"] == RAY_IMAGE_UID, container["name"]
        assert not (context.get("capabilities") or {}).get("add"), container["name"]


def test_the_only_root_container_may_do_nothing_but_chown() -> None:
    (owner,) = [c for c in all_containers(manifest()) if c["name"] == "artifact-cache-owner"]
    context = owner["securityContext"]
    assert context["runAsUser"] == 0
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert f"chown {RAY_IMAGE_UID}:" in " ".join(owner["command"])


def test_what_gets_applied_keeps_all_of_it() -> None:
    # `rollout registry serve-config` re-dumps the whole manifest: the containers come out as
    # they went in, written out in full (no YAML anchors or aliases for kubectl to resolve).
    from app.contracts import Target
    from rollout.serve_config import render_document

    stable = Target(revision=2, artifact_id="ranker-v42", manifest_uri="s3://b/m.json",
                    manifest_sha256="ab" * 32)  # fmt: skip
    fallback = Target(revision=1, artifact_id="ranker-lite-v1", manifest_uri="s3://b/l.json",
                      manifest_sha256="cd" * 32)  # fmt: skip
    text = render_document(
        RAYSERVICE.read_text(), app_name="ranker", stable=stable, fallback=fallback
    )
    assert not re.search(r"(^|\s)[&*]id\d+", text)
    rendered = yaml.safe_load(text)
    assert all_containers(rendered) == all_containers(manifest())


# -- the controller's ping ------------------------------------------------------------------

SECRET_SETTINGS = ControllerSettings(
    registry_url="postgresql://rollout:hunter2-pw@db.internal:5432/rollout?sslmode=require",
    dashboard_url="https://ops:dash-t0ken@head:8265",
    prometheus_url="https://prom/api?token=prom-abc123",
    metrics_endpoints=("http://scrape:scrape-pw@node1:8080/metrics",),
)
SECRETS = ("hunter2-pw", "dash-t0ken", "prom-abc123", "scrape-pw")


def test_shown_settings_mask_every_urls_credentials() -> None:
    from rollout.actor import shown_settings

    shown = shown_settings(SECRET_SETTINGS)
    text = json.dumps(shown)
    assert not [s for s in SECRETS if s in text], text
    assert shown["registry_url"] == "postgresql://rollout:***@db.internal:5432/rollout?sslmode=***"
    assert shown["dashboard_url"] == "https://ops:***@head:8265"
    # Everything else as it was, and still valid settings.
    assert {k: v for k, v in shown.items() if not k.endswith(("_url", "_endpoints"))} == {
        k: v
        for k, v in SECRET_SETTINGS.model_dump().items()
        if not k.endswith(("_url", "_endpoints"))
    }
    ControllerSettings.model_validate(shown)


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("postgres://u:p%40ss-word@db/r", "p%40ss-word"),
        ("host=db user=rollout password=kv-secret dbname=r", "kv-secret"),
        ("postgresql://only-a-token-user@db/r", "only-a-token-user"),
    ],
)
def test_a_registry_url_in_any_libpq_form_is_masked(url: str, secret: str) -> None:
    from rollout.actor import shown_settings

    shown = shown_settings(SECRET_SETTINGS.model_copy(update={"registry_url": url}))
    assert secret not in shown["registry_url"]
    assert "***" in shown["registry_url"]


def test_an_sqlite_registry_path_is_shown_as_it_is() -> None:
    from rollout.actor import shown_settings

    url = "sqlite:////var/lib/rollout/registry.db"
    assert (
        shown_settings(SECRET_SETTINGS.model_copy(update={"registry_url": url}))["registry_url"]
        == url
    )


def test_a_masked_url_still_fits_the_pings_contract() -> None:
    # Masking lengthens an empty query value ("a=" -> "a=***"): a URL at the bound stays in it.
    from rollout.actor import shown_settings

    url = "postgresql://db/r?" + "&".join(["a="] * 1359)
    assert len(url) <= 4096
    shown = shown_settings(SECRET_SETTINGS.model_copy(update={"registry_url": url}))
    ControllerSettings.model_validate(shown)


def test_ping_answers_with_the_masked_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # The actor's method on a plain object (no Ray, no engine): what any caller on the
    # cluster gets back.
    import rollout.actor as actor

    monkeypatch.setattr(actor, "_this_node_id", lambda: None)
    controller = actor.RolloutController.__new__(actor.RolloutController)
    controller.settings = SECRET_SETTINGS
    controller.engine = SimpleNamespace(metrics_export_interval_s=2.0, window_delay_s=3.4)
    controller._ticks = 5
    controller.repaired = None
    answer = controller.ping()
    assert not [s for s in SECRETS if s in json.dumps(answer)], answer
    ping = ControllerPing.model_validate(answer)
    assert ping.registry_url.startswith("postgresql://rollout:***@db.internal:5432/")
    assert ping.ticks == 5 and ping.model == SECRET_SETTINGS.model


# -- private keys and the checkout ----------------------------------------------------------


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize(
    "path",
    ["release.pem", "artifact-signing.key", "configs/release.pem", "keys/x/sign.key"],
)
def test_private_key_files_are_ignored_by_git_and_so_by_the_cluster_sync(path: str) -> None:
    # cluster.yaml syncs the checkout with `rsync_filter: [.gitignore]`: what git ignores
    # stays on this machine.
    assert ".gitignore" in yaml.safe_load((ROOT / "cluster.yaml").read_text())["rsync_filter"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, f"{path} is not git-ignored"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_public_keys_are_still_synced() -> None:
    # The trust anchor goes to every node (cluster.yaml file_mounts): never ignored by name.
    for path in ("artifact-signing.pub", "release.pub"):
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False
        )
        assert ignored.returncode == 1, path


# The README and the pages of docs/ (mkdocs.yml builds them).
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_docs_keygen_examples_write_outside_the_checkout() -> None:
    names = ["README.md", "cluster.yaml", *(str(p.relative_to(ROOT)) for p in DOCS)]
    texts = {name: (ROOT / name).read_text() for name in names}
    examples = [
        (name, line)
        for name, text in texts.items()
        for line in text.splitlines()
        if re.search(r"\brollout keygen\s+[^A-Z\s`]", line)
    ]
    assert examples
    for name, line in examples:
        private = line.split("rollout keygen", 1)[1].split()[0]
        assert private.startswith(("~/", "/", '"$')), (name, line)


def test_the_docs_send_operators_to_the_controller_sidecar() -> None:
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *DOCS])
    assert "-c rollout-controller" in docs
    assert not re.search(r"kubectl exec[^\n]*-c ray-head[^\n]*rollout", docs)
