"""rollout.serve_config: a template's targets filled in from the registry's, nothing else
changed, and every way a template can be unusable named."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from app.contracts import Target
from app.errors import ConfigError
from rollout.serve_config import render_document, render_serve_config

STABLE = Target(revision=7, artifact_id="ranker-v42", manifest_uri="file:///a/m.json",
                manifest_sha256="ab" * 32)  # fmt: skip
LITE = Target(revision=1, artifact_id="ranker-lite-v2", manifest_uri="file:///b/m.json",
              manifest_sha256="cd" * 32)  # fmt: skip


def template(fallback: bool = True) -> dict[str, Any]:
    args: dict[str, Any] = {
        "stable": {"num_replicas": 2, "target": {"artifact_id": "ranker-v41"}},
        "canary": {"num_replicas": 1, "target": {"revision": 9, "artifact_id": "old",
                   "manifest_uri": "file:///c", "manifest_sha256": "ef" * 32}},
        "router": {"salt": "s"},
    }  # fmt: skip
    if fallback:
        args["fallback"] = {
            "num_replicas": 1,
            "target": {"revision": 4, "artifact_id": "ranker-lite-v2"},
        }
    return {"applications": [{"name": "ranker", "import_path": "x:y", "args": args}]}


def test_targets_come_from_the_registry_and_the_rest_stays() -> None:
    doc = template()
    out = render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
    args = out["applications"][0]["args"]
    assert args["stable"] == {"num_replicas": 2, "target": STABLE.model_dump(mode="json")}
    assert args["canary"] == {"num_replicas": 1}  # a rollout sets it
    # The registry keeps no fallback revision: the template's stays.
    assert args["fallback"]["target"] == {**LITE.model_dump(mode="json"), "revision": 4}
    assert args["router"] == {"salt": "s"}
    assert doc == template()  # the input is not changed


def test_a_fallback_other_than_the_templates_is_refused() -> None:
    """Replicas serving ranker-lite-v2 at revision 4 would refuse another artifact at 4: a
    new standby is the template's edit (artifact and revision), not a swap at render time."""
    doc = template()
    doc["applications"][0]["args"]["fallback"]["target"]["artifact_id"] = "ranker-lite-v1"
    with pytest.raises(ConfigError, match=r"serves ranker-lite-v1 \(revision 4\)"):
        render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
    del doc["applications"][0]["args"]["fallback"]["target"]
    out = render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
    assert out["applications"][0]["args"]["fallback"]["target"]["revision"] == LITE.revision


@pytest.mark.parametrize(
    ("doc", "kwargs", "names"),
    [
        (template(), {"fallback": None}, "--fallback"),
        (template(fallback=False), {"fallback": LITE}, "no fallback deployment"),
        ({"applications": []}, {}, "no application 'ranker'"),
        ({"kind": "Other"}, {}, "no 'applications' list"),
        ({"applications": [{"name": "ranker", "args": {"stable": 3}}]}, {}, "stable is not a"),
    ],
)
def test_an_unusable_template_is_named(
    doc: dict[str, Any], kwargs: dict[str, Any], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        render_serve_config(doc, app_name="ranker", stable=STABLE, **kwargs)


def test_args_the_replicas_would_refuse_are_refused_here() -> None:
    doc = template()
    doc["applications"][0]["args"]["router"]["max_in_flight"] = -1
    with pytest.raises(ConfigError, match=r"router\.max_in_flight"):
        render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)


def test_a_rayservice_is_rendered_inside_serve_config_v2_only() -> None:
    inner = yaml.safe_dump(template(fallback=False))
    cluster = {"rayVersion": "2.60.0"}
    manifest = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "spec": {"serveConfigV2": inner, "rayClusterConfig": cluster},
    }
    out = yaml.safe_load(
        render_document(yaml.safe_dump(manifest), app_name="ranker", stable=STABLE)
    )
    assert out["spec"]["rayClusterConfig"] == {"rayVersion": "2.60.0"}
    rendered = yaml.safe_load(out["spec"]["serveConfigV2"])
    assert rendered["applications"][0]["args"]["stable"]["target"]["revision"] == 7
    with pytest.raises(ConfigError, match="serveConfigV2"):
        render_document("kind: RayService\nspec: {}\n", app_name="ranker", stable=STABLE)
    with pytest.raises(ConfigError, match="not YAML"):
        render_document("a: [", app_name="ranker", stable=STABLE)


@pytest.mark.parametrize("deployment", ["stable", "fallback"])
def test_stable_and_the_standby_may_not_be_autoscaled_to_zero(deployment: str) -> None:
    doc = template()
    doc["applications"][0]["args"]["router"]["probe_idle_canary"] = False
    doc["applications"][0]["deployments"] = [
        {"name": "canary", "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
        {"name": deployment, "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
    ]
    field = f"applications[ranker].deployments[{deployment}].autoscaling_config.min_replicas"
    with pytest.raises(ConfigError, match=re.escape(field)):
        render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
    doc["applications"][0]["deployments"][1]["autoscaling_config"]["min_replicas"] = 1
    out = render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
    assert out["applications"][0]["deployments"] == doc["applications"][0]["deployments"]


def test_a_canary_autoscaled_to_zero_needs_a_router_that_leaves_it_idle() -> None:
    doc = template()
    doc["applications"][0]["deployments"] = [
        {"name": "canary", "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
    ]
    with pytest.raises(ConfigError, match=r"args\.router\.probe_idle_canary"):
        render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
    doc["applications"][0]["args"]["router"]["probe_idle_canary"] = False
    render_serve_config(doc, app_name="ranker", stable=STABLE, fallback=LITE)
