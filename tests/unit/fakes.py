"""Stand-ins for Ray Serve, for the controller's tests.

- ``FakeServe``: the controller's Serve port in memory (``rollout.serve_port.ServePort``):
  stable, canary and router, each a user_config and a replica count applied at once, with
  that many RUNNING replicas. It counts GETs and PUTs as the HTTP port makes them: a read is
  one GET; a write one GET, and one PUT when it changes something.
- ``FakeDashboard``: the dashboard's REST API behind an ``httpx.MockTransport``, holding Serve's
  instance details and applying declarative configs PUT to it, for the HTTP port itself.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Mapping
from typing import Any

import httpx

from app.contracts import ReplicaConfig, RouterConfig, Target
from rollout.serve_control import APPLICATIONS_PATH
from rollout.serve_port import (
    CANARY_REPLICAS,
    CANARY_TARGET,
    ROUTER_SHADOW,
    ROUTER_WEIGHT,
    STABLE_TARGET,
    DeploymentState,
    ServeChange,
    ServeState,
    replica_user_config,
    router_user_config,
)


def replica_config(cohort: str, target: Target | None = None, **fields: Any) -> dict[str, Any]:
    """A ranker deployment's whole user_config, as the application builder writes it."""
    return ReplicaConfig.model_validate({"cohort": cohort, "target": target, **fields}).model_dump(
        mode="json"
    )


def router_config(canary_bp: int = 0) -> dict[str, Any]:
    return RouterConfig(canary_bp=canary_bp).model_dump(mode="json")


class FakeServe:
    def __init__(
        self,
        *,
        stable: Mapping[str, Any] | None = None,
        canary: Mapping[str, Any] | None = None,
        router: Mapping[str, Any] | None = None,
        replicas: Mapping[str, int] | None = None,
        autoscaling: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``autoscaling``: the roles Serve autoscales, with their autoscaling_config; the fake
        autoscaler keeps such a pool at its floor (``min_replicas``)."""
        self.user_configs: dict[str, dict[str, Any]] = {
            "stable": dict(stable or replica_config("stable")),
            "canary": dict(canary or replica_config("canary")),
            "router": dict(router or router_config()),
        }
        self._ids = itertools.count()
        self.autoscaling = {k: dict(v) for k, v in (autoscaling or {}).items()}
        floors = {role: int(a.get("min_replicas", 1)) for role, a in self.autoscaling.items()}
        self.replicas: dict[str, list[str]] = {}
        sizes = {"stable": 1, "canary": 1, "router": 1, **floors, **(replicas or {})}
        for role, n in sizes.items():
            self.replicas[role] = [self._new_id(role) for _ in range(n)]
        self.gets = 0
        self.puts = 0
        self.writes: list[ServeChange] = []  # every write asked for, in order
        # Raised, in order, by the next reads / writes instead of answering (an outage).
        self.read_errors: list[Exception] = []
        self.write_errors: list[Exception] = []

    def _new_id(self, role: str) -> str:
        return f"{role}-{next(self._ids)}"

    def running(self, role: str) -> list[str]:
        return list(self.replicas[role])

    def target(self, cohort: str) -> dict[str, Any] | None:
        return self.user_configs[cohort].get("target")

    @property
    def canary_bp(self) -> int:
        return int(self.user_configs["router"].get("canary_bp", 0))

    # ---- the port

    def read(self) -> ServeState:
        self.gets += 1
        if self.read_errors:
            raise self.read_errors.pop(0)

        def state(role: str) -> DeploymentState:
            return DeploymentState(
                status="HEALTHY",
                replicas={rid: "RUNNING" for rid in self.replicas[role]},
                target_num_replicas=len(self.replicas[role]),
                applied_user_config=copy.deepcopy(self.user_configs[role]),
                user_config=copy.deepcopy(self.user_configs[role]),
                autoscaling=copy.deepcopy(self.autoscaling.get(role)),
                pool_size=(
                    self.autoscaling[role]["min_replicas"]
                    if role in self.autoscaling
                    else len(self.replicas[role])
                ),
            )

        return ServeState(stable=state("stable"), canary=state("canary"), router=state("router"))

    def write(self, change: ServeChange) -> frozenset[str]:
        self.writes.append(change)
        if not change:
            return frozenset()
        self.gets += 1
        if self.write_errors:
            raise self.write_errors.pop(0)
        wanted = copy.deepcopy(self.user_configs)
        changed = set()
        for cohort, target in change.targets.items():
            new = replica_user_config(wanted[cohort], cohort, target)
            if new is not None:
                wanted[cohort] = new
                changed.add(STABLE_TARGET if cohort == "stable" else CANARY_TARGET)
        if change.canary_bp is not None or change.shadow is not None:
            before = RouterConfig.from_user_config(wanted["router"])
            new = router_user_config(wanted["router"], change.canary_bp, change.shadow)
            if new is not None:
                wanted["router"] = new
                after = RouterConfig.from_user_config(new)
                if after.canary_bp != before.canary_bp:
                    changed.add(ROUTER_WEIGHT)
                if after.shadow != before.shadow:
                    changed.add(ROUTER_SHADOW)
        n = change.canary_replicas
        scaling = self.autoscaling.get("canary")
        size = scaling.get("min_replicas") if scaling is not None else len(self.replicas["canary"])
        if n is not None and n != size:
            changed.add(CANARY_REPLICAS)
        if not changed:
            return frozenset()
        self.puts += 1
        self.user_configs = wanted
        if n is not None and scaling is not None:
            scaling["min_replicas"] = n
            scaling["max_replicas"] = max(int(scaling.get("max_replicas", 1)), n)
        if n is not None:
            canary = self.replicas["canary"]
            del canary[n:]
            canary.extend(self._new_id("canary") for _ in range(n - len(canary)))
        return frozenset(changed)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------- the REST API


def deployment_details(
    name: str,
    user_config: Mapping[str, Any] | None,
    replicas: int = 1,
    autoscaling: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A deployment as Serve's details show it: a fixed ``replicas``, or with
    ``autoscaling`` (its ``autoscaling_config``; ``replicas`` is the autoscaler's current
    target), as Serve reports one: every field of Serve's autoscaling config spelled out."""
    return {
        "name": name,
        "status": "HEALTHY",
        "deployment_config": {
            "name": name,
            "num_replicas": replicas,
            "user_config": copy.deepcopy(user_config),
            "autoscaling_config": (
                {**SERVE_AUTOSCALING_DEFAULTS, **autoscaling} if autoscaling is not None else None
            ),
        },
        "target_num_replicas": replicas,
        "replicas": [{"replica_id": f"{name}-{i}", "state": "RUNNING"} for i in range(replicas)],
    }


# How Serve 2.60's details spell out an autoscaling_config (AutoscalingConfig's fields).
SERVE_AUTOSCALING_DEFAULTS: dict[str, Any] = {
    "min_replicas": 1,
    "initial_replicas": None,
    "max_replicas": 1,
    "target_ongoing_requests": 2.0,
    "metrics_interval_s": 10.0,
    "look_back_period_s": 30.0,
    "smoothing_factor": 1.0,
    "upscale_smoothing_factor": None,
    "downscale_smoothing_factor": None,
    "upscaling_factor": None,
    "downscaling_factor": None,
    "downscale_delay_s": 600.0,
    "downscale_to_zero_delay_s": None,
    "upscale_delay_s": 30.0,
    "aggregation_function": "mean",
    "policy": {
        "policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy",
        "policy_kwargs": {},
    },
}


def app_details(
    name: str = "ranker", *, deployments: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """A declaratively deployed application whose builder gave each deployment its
    user_config (the declarative config has no per-deployment overrides)."""
    if deployments is None:
        deployments = {
            "stable": deployment_details("stable", replica_config("stable")),
            "canary": deployment_details("canary", replica_config("canary")),
            "router": deployment_details("router", router_config()),
        }
    return {
        "name": name,
        "status": "RUNNING",
        "route_prefix": "/",
        "deployed_app_config": {
            "name": name,
            "route_prefix": "/",
            "import_path": "deployments.app:build_app",
            "args": {"stable": {"num_replicas": 1}},
        },
        "deployments": copy.deepcopy(dict(deployments)),
    }


class FakeDashboard:
    """GET answers the instance details; PUT applies the declarative config to them (each
    deployment override's user_config and num_replicas, at once). ``answers`` queues status
    codes to answer the next requests with instead (an outage, a refusal); ``put_answers``
    the same for PUTs only."""

    def __init__(self, *applications: dict[str, Any]) -> None:
        self.details: dict[str, Any] = {
            "proxy_location": "EveryNode",
            "http_options": {"host": "127.0.0.1", "port": 8000, "root_path": "", "extra": 1},
            "applications": {a["name"]: a for a in (applications or (app_details(),))},
        }
        self.gets = 0
        self.puts: list[dict[str, Any]] = []  # every config PUT, in order
        self.answers: list[int] = []
        self.put_answers: list[int] = []
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == APPLICATIONS_PATH, request.url
        assert request.headers.get("authorization") == "Bearer t"
        if request.method == "GET":
            self.gets += 1
        else:
            assert request.method == "PUT"
            self.puts.append(json.loads(request.content))
            if self.put_answers:
                return httpx.Response(self.put_answers.pop(0), json={"detail": "stand-in"})
        if self.answers:
            return httpx.Response(self.answers.pop(0), json={"detail": "stand-in dashboard"})
        if request.method == "GET":
            return httpx.Response(200, json=self.details)
        self._apply(self.puts[-1])
        return httpx.Response(200, json={})

    def _apply(self, config: Mapping[str, Any]) -> None:
        for app_config in config["applications"]:
            app = self.details["applications"].setdefault(
                app_config["name"], app_details(app_config["name"], deployments={})
            )
            app["deployed_app_config"] = copy.deepcopy(app_config)
            for entry in app_config.get("deployments") or []:
                live = app["deployments"][entry["name"]]
                if "user_config" in entry:
                    live["deployment_config"]["user_config"] = copy.deepcopy(entry["user_config"])
                if "autoscaling_config" in entry:
                    # The autoscaler starts at the floor here (no load in these tests).
                    scaling = {**SERVE_AUTOSCALING_DEFAULTS, **entry["autoscaling_config"]}
                    live["deployment_config"]["autoscaling_config"] = scaling
                    entry = {**entry, "num_replicas": scaling["min_replicas"]}
                if "num_replicas" in entry:
                    n = entry["num_replicas"]
                    live["deployment_config"]["num_replicas"] = n
                    live["target_num_replicas"] = n
                    name = entry["name"]
                    live["replicas"] = [
                        {"replica_id": f"{name}-{i}", "state": "RUNNING"} for i in range(n)
                    ]

    def live(self, app: str, deployment: str) -> dict[str, Any]:
        return self.details["applications"][app]["deployments"][deployment]


# ------------------------------------------------------------------------- metrics


class FakeWindows:
    """Metrics windows on demand: ``stats(start, end)`` gives the window asked for (None: no
    window, as before the second snapshot)."""

    def __init__(self, stats: Any = None) -> None:
        self.stats = stats
        self.observed = 0
        self.asked: list[tuple[float, float]] = []

    def observe(self) -> None:
        self.observed += 1

    def window_between(self, start: float, end: float) -> Any:
        self.asked.append((start, end))
        return None if self.stats is None else self.stats(start, end)
