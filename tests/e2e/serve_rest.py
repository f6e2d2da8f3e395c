"""The dashboard's Serve REST API, as an operator (or the rollout controller) uses it.

``PUT /api/serve/applications/`` replaces the whole declarative config (apps left out are
deleted), so every change is a read-modify-write of ``GET``'s ``deployed_app_config``. A
deployment's effective ``user_config`` (set by the app builder or by an earlier override) is
read from the deployment details and written back as an override with the change applied;
a change of ``user_config`` alone reaches the replicas through ``reconfigure`` (no restart).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

API = "/api/serve/applications/"


def ray_auth_token() -> str | None:
    """The token the local cluster was started with (RAY_FACTS.md: token auth is on)."""
    import os

    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    return path.read_text().strip() if path.is_file() else None


class ServeRest:
    def __init__(self, dashboard_url: str, token: str | None, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=dashboard_url, headers=headers, timeout=timeout_s)

    def details(self) -> dict[str, Any]:
        response = self._http.get(API)
        response.raise_for_status()
        return response.json()

    def put(self, config: dict[str, Any]) -> None:
        response = self._http.put(API, json=config)
        if response.status_code >= 300:
            raise RuntimeError(f"PUT {API}: HTTP {response.status_code}: {response.text}")

    def app_status(self, app: str) -> str | None:
        found = self.details().get("applications", {}).get(app)
        return found["status"] if found else None

    def replicas(self, app: str, deployment: str) -> list[dict[str, Any]]:
        deployments = self.details()["applications"][app]["deployments"]
        return list(deployments[deployment]["replicas"])

    def user_config(self, app: str, deployment: str) -> dict[str, Any]:
        deployments = self.details()["applications"][app]["deployments"]
        return copy.deepcopy(deployments[deployment]["deployment_config"]["user_config"])

    def update_user_configs(
        self, app: str, changes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]
    ) -> None:
        """Read-modify-write: apply ``changes[deployment](user_config)`` and PUT it all back."""
        details = self.details()
        config: dict[str, Any] = {
            "applications": [
                copy.deepcopy(a["deployed_app_config"])
                for a in details["applications"].values()
                if a.get("deployed_app_config")
            ]
        }
        for key in ("http_options", "proxy_location"):
            if details.get(key) is not None:
                config[key] = details[key]
        target = next(a for a in config["applications"] if a["name"] == app)
        overrides = target.setdefault("deployments", [])
        live = details["applications"][app]["deployments"]
        for deployment, change in changes.items():
            entry = next((d for d in overrides if d["name"] == deployment), None)
            if entry is None:
                entry = {"name": deployment}
                overrides.append(entry)
            current = entry.get("user_config")
            if current is None:
                current = live[deployment]["deployment_config"]["user_config"]
            entry["user_config"] = change(copy.deepcopy(current))
        self.put(config)

    def close(self) -> None:
        self._http.close()
