"""The Serve config to deploy, rendered from a template and the registry's targets.

``configs/serve.yaml`` (and the RayService manifest that embeds the same application) is a
template: its targets name the artifacts but carry no digest, which only the registry knows.
Deployed as it is, Ray Serve refuses the application (the digest field names the problem) and
whatever ran before keeps serving. ``render`` fills in the stable target from the registry
(the one its revisions count from), the fallback's from an artifact the registry holds, and
clears the canary's (a rollout sets it). Pure: the caller reads the registry.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

import yaml

from app.contracts import AppArgs, RouterConfig, Target
from app.errors import ConfigError

RAYSERVICE_KIND: Final = "RayService"


def _applications(doc: Mapping[str, Any]) -> list[Any]:
    apps = doc.get("applications")
    if not isinstance(apps, list):
        raise ConfigError("the template has no 'applications' list (not a Serve config)")
    return apps


def _app(doc: Mapping[str, Any], app_name: str) -> dict[str, Any]:
    apps = _applications(doc)
    for app in apps:
        if isinstance(app, dict) and app.get("name") == app_name:
            return app
    names = [a.get("name") for a in apps if isinstance(a, dict)]
    raise ConfigError(f"the template has no application {app_name!r} (it has {names})")


def _fallback_target(template: Any, fallback: Target) -> dict[str, Any]:
    target = fallback.model_dump(mode="json")
    if not isinstance(template, dict):
        return target
    named, revision = template.get("artifact_id"), template.get("revision")
    if named is not None and named != fallback.artifact_id:
        raise ConfigError(
            f"the template's fallback serves {named} (revision {revision}): to serve "
            f"{fallback.artifact_id}, name it there with a higher revision"
        )
    if isinstance(revision, int) and not isinstance(revision, bool):
        target["revision"] = revision
    return target


def render_serve_config(
    doc: Mapping[str, Any],
    *,
    app_name: str,
    stable: Target,
    fallback: Target | None = None,
) -> dict[str, Any]:
    """``doc`` (a Serve config) with ``app_name``'s stable target set to ``stable``, its
    fallback's to ``fallback`` (required when the app has a fallback deployment), and no
    canary target. The result's args are validated as the replicas will validate them.

    The registry keeps no fallback revision: the template's stays, and the template must name
    ``fallback``'s artifact. Running replicas refuse another artifact at the revision they
    serve, so changing the standby's artifact is an edit of the template (artifact and a
    higher revision), never a silent swap here."""
    out = copy.deepcopy(dict(doc))
    app = _app(out, app_name)
    args = app.setdefault("args", {})
    if not isinstance(args, dict):
        raise ConfigError(f"applications[{app_name}].args is not a mapping")
    for role in ("stable", "canary", "fallback"):
        if args.get(role) is not None and not isinstance(args[role], dict):
            raise ConfigError(f"applications[{app_name}].args.{role} is not a mapping")
    args.setdefault("stable", {})["target"] = stable.model_dump(mode="json")
    if args.get("canary") is not None:
        args["canary"].pop("target", None)
    if args.get("fallback") is not None:
        if fallback is None:
            raise ConfigError(
                f"application {app_name!r} has a fallback deployment: name its artifact "
                "(--fallback ARTIFACT_ID)"
            )
        args["fallback"]["target"] = _fallback_target(args["fallback"].get("target"), fallback)
    elif fallback is not None:
        raise ConfigError(f"application {app_name!r} has no fallback deployment to target")
    try:
        AppArgs.model_validate(args)
    except ValueError as exc:
        raise ConfigError(f"applications[{app_name}].args: {exc}") from None
    _check_autoscaling(app, app_name)
    return out


def _check_autoscaling(app: Mapping[str, Any], app_name: str) -> None:
    """Stable and the hot standby answer users at any time: Serve's autoscaler may not take
    them to zero replicas (a request would wait for one to start and load its model). The
    canary pool may go to zero between rollouts (the controller raises its floor first), and
    then the router must not probe it while it is idle: a probe would start a replica."""
    args = app.get("args") or {}
    router = args.get("router") if isinstance(args, Mapping) else None
    probes_idle = RouterConfig.model_fields["probe_idle_canary"].default
    if isinstance(router, Mapping):
        probes_idle = router.get("probe_idle_canary", probes_idle)
    for entry in app.get("deployments") or []:
        if not isinstance(entry, Mapping):
            continue
        scaling = entry.get("autoscaling_config")
        floor = scaling.get("min_replicas", 1) if isinstance(scaling, Mapping) else 1
        if entry.get("name") == "canary" and floor == 0 and probes_idle:
            field = f"applications[{app_name}].args.router.probe_idle_canary"
            raise ConfigError(
                f"{field}: the canary is autoscaled to min_replicas 0, and a router that "
                "probes it while idle keeps a replica up; set it to false",
                field=field,
            )
        if entry.get("name") in ("stable", "fallback") and (
            not isinstance(floor, int) or floor < 1
        ):
            field = (
                f"applications[{app_name}].deployments[{entry['name']}]"
                ".autoscaling_config.min_replicas"
            )
            raise ConfigError(
                f"{field}: {floor!r}; the {entry['name']} deployment must keep at least 1 "
                "replica (only the canary pool may go to 0)",
                field=field,
            )


def render_document(
    text: str,
    *,
    app_name: str,
    stable: Target,
    fallback: Target | None = None,
) -> str:
    """A template's YAML text rendered: a Serve config, or a KubeRay RayService whose
    ``spec.serveConfigV2`` holds one (rendered inside, the rest of the manifest as it was)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"the template is not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("the template is not a YAML mapping")
    if doc.get("kind") == RAYSERVICE_KIND:
        spec = doc.get("spec")
        inner = spec.get("serveConfigV2") if isinstance(spec, dict) else None
        if not isinstance(inner, str):
            raise ConfigError("the RayService has no spec.serveConfigV2 string")
        serve_doc = yaml.safe_load(inner)
        if not isinstance(serve_doc, dict):
            raise ConfigError("spec.serveConfigV2 is not a YAML mapping")
        rendered = render_serve_config(
            serve_doc,
            app_name=app_name,
            stable=stable,
            fallback=fallback,
        )
        assert isinstance(spec, dict)
        spec["serveConfigV2"] = yaml.safe_dump(rendered, sort_keys=False)
        return yaml.safe_dump(doc, sort_keys=False)
    rendered = render_serve_config(
        doc,
        app_name=app_name,
        stable=stable,
        fallback=fallback,
    )
    return yaml.safe_dump(rendered, sort_keys=False)
