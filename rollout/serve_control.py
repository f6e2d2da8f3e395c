"""Changing live Serve settings through the declarative config, over the dashboard REST API.

Serve applies a config whose only changes are ``user_config`` or ``num_replicas`` in place:
``reconfigure()`` on the same replicas, or replicas added/removed; nothing restarts. The PUT
replaces the whole declarative config, so every change is a read-modify-write of what is
deployed now, and a change that alters nothing is not sent. The rollout controller goes
through ``rollout.serve_port``, which reads and writes the cohorts in as few requests as that
allows; this module is the HTTP client under it (and the tests' and benchmarks' tool).

Ray 2.60 turns on token auth: the dashboard answers 401 without ``Authorization: Bearer``.
The token comes from ``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or
``~/.ray/auth_token``, in that order (Ray's own order).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import httpx

from app.errors import ServeControlError, ServeUnreachable, WaitTimeout
from app.polling import wait_until

APPLICATIONS_PATH: Final = "/api/serve/applications/"
# The parts of the running HTTP options that a declarative config may carry back.
_HTTP_OPTION_KEYS: Final = (
    "host",
    "port",
    "root_path",
    "request_timeout_s",
    "keep_alive_timeout_s",
)


def resolve_auth_token() -> str | None:
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token.strip()
    for candidate in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).read_text().strip() or None
    return None


class ServeControl:
    def __init__(
        self,
        dashboard_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        token = token if token is not None else resolve_auth_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.dashboard_url = dashboard_url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.dashboard_url, headers=headers, timeout=timeout_s, transport=transport
        )

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------ reading

    def details(self) -> dict[str, Any]:
        """Serve's instance details: applications, deployments, replicas, statuses."""
        try:
            response = self._client.get(APPLICATIONS_PATH)
        except httpx.HTTPError as exc:
            raise ServeUnreachable(f"dashboard {self.dashboard_url} unreachable: {exc}") from exc
        self._raise_for_status(response, "read the Serve config")
        return response.json()

    def declarative_config(self, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What is deployed now, as a config that a PUT would accept unchanged."""
        details = details if details is not None else self.details()
        applications = []
        for name, app in (details.get("applications") or {}).items():
            deployed = app.get("deployed_app_config")
            if deployed is None and app.get("status") == "DELETING":
                continue  # on its way out: a config without it is what Serve is doing anyway
            if deployed is None:
                raise ServeControlError(
                    f"application {name!r} was deployed imperatively (serve.run): its config "
                    "cannot be managed; deploy it with `serve deploy` or the REST API"
                )
            applications.append(copy.deepcopy(deployed))
        http_options = details.get("http_options") or {}
        config: dict[str, Any] = {
            "applications": applications,
            "http_options": {k: http_options[k] for k in _HTTP_OPTION_KEYS if k in http_options},
        }
        if details.get("proxy_location"):
            config["proxy_location"] = details["proxy_location"]
        if details.get("target_capacity") is not None:
            config["target_capacity"] = details["target_capacity"]
        return config

    def deployment_status(self, app: str, deployment: str) -> dict[str, Any]:
        apps = self.details().get("applications") or {}
        try:
            return apps[app]["deployments"][deployment]
        except KeyError:
            raise ServeControlError(
                f"no deployment {deployment!r} in application {app!r}"
            ) from None

    # ------------------------------------------------------------------ writing

    def apply(self, config: Mapping[str, Any]) -> None:
        try:
            response = self._client.put(APPLICATIONS_PATH, json=config)
        except httpx.HTTPError as exc:
            raise ServeUnreachable(f"dashboard {self.dashboard_url} unreachable: {exc}") from exc
        self._raise_for_status(response, "apply the Serve config")

    def update(self, mutate: Callable[[dict[str, Any]], None]) -> bool:
        """Read-modify-write of the declarative config; False when nothing changed."""
        current = self.declarative_config()
        wanted = copy.deepcopy(current)
        mutate(wanted)
        if wanted == current:
            return False
        self.apply(wanted)
        return True

    def update_deployment(
        self,
        app: str,
        deployment: str,
        *,
        user_config: Mapping[str, Any] | None = None,
        num_replicas: int | None = None,
    ) -> bool:
        """Set one deployment's ``user_config`` (replaced whole) and/or ``num_replicas``."""

        def mutate(config: dict[str, Any]) -> None:
            entry = deployment_entry(config, app, deployment)
            if user_config is not None:
                entry["user_config"] = copy.deepcopy(dict(user_config))
            if num_replicas is not None:
                entry["num_replicas"] = num_replicas

        return self.update(mutate)

    def current_user_config(self, app: str, deployment: str) -> dict[str, Any] | None:
        """The deployment's user_config as last asked for: the declarative override if the
        config has one, else what the application's builder gave it (live in Serve).

        Writing back a *whole* user_config matters: an override replaces the builder's
        user_config entirely, so a partial one would drop fields the replicas need."""
        details = self.details()
        config = self.declarative_config(details)
        entry = deployment_entry(config, app, deployment, create=False)
        return effective_user_config(details, entry, app, deployment)

    def update_user_configs(
        self, app: str, changes: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]]
    ) -> bool:
        """Several deployments' user_configs in one PUT: ``changes[deployment](current)``
        returns the new whole user_config. False when nothing changed."""
        details = self.details()
        current = self.declarative_config(details)
        wanted = copy.deepcopy(current)
        for deployment, change in changes.items():
            entry = deployment_entry(wanted, app, deployment)
            assert entry is not None
            base = effective_user_config(details, entry, app, deployment) or {}
            entry["user_config"] = change(base)
        if wanted == current:
            return False
        self.apply(wanted)
        return True

    def app_status(self, app: str) -> str | None:
        found = (self.details().get("applications") or {}).get(app)
        return found["status"] if found else None

    def replicas(self, app: str, deployment: str) -> list[dict[str, Any]]:
        return list(self.deployment_status(app, deployment).get("replicas") or [])

    def wait_applied(
        self,
        app: str,
        deployment: str,
        *,
        user_config: Mapping[str, Any] | None = None,
        num_replicas: int | None = None,
        timeout_s: float = 60.0,
        poll_s: float = 0.2,
    ) -> dict[str, Any]:
        """Wait until the deployment is HEALTHY with the given settings on every replica;
        ServeControlError naming what is still pending after ``timeout_s``."""
        last = ["no answer yet"]

        def applied() -> dict[str, Any] | None:
            try:
                status = self.deployment_status(app, deployment)
            except ServeControlError as exc:
                last[0] = str(exc)
                return None
            cfg = status.get("deployment_config") or {}
            running = [r for r in status.get("replicas") or [] if r.get("state") == "RUNNING"]
            target = status.get("target_num_replicas")
            checks = {
                "healthy": status.get("status") == "HEALTHY",
                "user_config": user_config is None or cfg.get("user_config") == user_config,
                "replicas": num_replicas is None
                or (target == num_replicas and len(running) == num_replicas),
            }
            if all(checks.values()):
                return status
            pending = [name for name, ok in checks.items() if not ok]
            last[0] = f"status={status.get('status')} pending={pending}"
            return None

        try:
            return wait_until(applied, timeout_s, f"{app}/{deployment} applied", every=poll_s)
        except WaitTimeout:
            raise ServeControlError(
                f"{app}/{deployment} not applied within {timeout_s:.0f}s: {last[0]}"
            ) from None

    @staticmethod
    def _raise_for_status(response: httpx.Response, doing: str) -> None:
        if response.status_code == 401:
            raise ServeControlError(
                f"dashboard refused to {doing} (401): Ray token auth is on; set RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH, or run where ~/.ray/auth_token is the cluster's token"
            )
        if response.status_code >= 500:
            raise ServeUnreachable(
                f"dashboard could not {doing} ({response.status_code}): {response.text[:500]}"
            )
        if response.status_code >= 400:
            raise ServeControlError(
                f"dashboard refused to {doing} ({response.status_code}): {response.text[:500]}"
            )


def effective_user_config(
    details: Mapping[str, Any], entry: Mapping[str, Any] | None, app: str, deployment: str
) -> dict[str, Any] | None:
    """The deployment's user_config as last asked for: the declarative ``entry``'s override if
    it has one, else what Serve reports the deployment runs with (the builder's)."""
    if entry is not None and entry.get("user_config") is not None:
        return copy.deepcopy(entry["user_config"])
    live = (((details.get("applications") or {}).get(app) or {}).get("deployments") or {}).get(
        deployment
    ) or {}
    user_config = (live.get("deployment_config") or {}).get("user_config")
    return copy.deepcopy(user_config) if user_config is not None else None


def deployment_entry(
    config: dict[str, Any], app: str, deployment: str, *, create: bool = True
) -> dict[str, Any] | None:
    """The deployment's entry in a declarative ``config`` (added when absent if ``create``,
    else None); ServeControlError when the config has no such application."""
    for application in config.get("applications", []):
        if application.get("name") == app:
            deployments = application.setdefault("deployments", [])
            for entry in deployments:
                if entry.get("name") == deployment:
                    return entry
            if not create:
                return None
            entry = {"name": deployment}
            deployments.append(entry)
            return entry
    raise ServeControlError(f"no application {app!r} in the deployed Serve config")
