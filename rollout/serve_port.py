"""The rollout controller's one port to Ray Serve: the cohorts' state in, their settings out.

``read`` is one GET of Serve's instance details, and gives everything a tick observes of the
three deployments of the application (stable, canary, router): their statuses, their RUNNING
replicas and ``target_num_replicas``, the user_config each runs with (the router's gives the
weights it applies) and the user_config each was last asked for.

``write`` sets targets, the router's canary weight and the canary pool's size in one
read-modify-write of the declarative config: one GET, and one PUT only when something would
change. The pool's size is ``num_replicas``, or for a deployment Serve autoscales its floor
(``autoscaling_config.min_replicas`` in the config's deployments list, with ``max_replicas``
raised to it where it is lower): the autoscaler may add replicas above it for load, and the
capacity the controller counts is the replicas that report ready, never the configured ones.

Replica and router user_configs are read into ``app.contracts`` models and written back
whole (``ReplicaConfig.with_target``, ``router_user_config``): an override replaces the
builder's user_config entirely, so a partial one would drop fields the replicas need. They are
written back with the fields they were given and the one changed, not every default spelled
out: the declarative config keeps reading as its author wrote it.

``HttpServePort`` is the port over the dashboard's REST API (``rollout.serve_control``); tests
use an in-memory port with the same two methods.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from app.contracts import (
    CANARY,
    STABLE,
    Cohort,
    ControllerSettings,
    ReplicaConfig,
    RouterConfig,
    ShadowRouting,
    Target,
)
from app.errors import ConfigError
from rollout.serve_control import (
    ServeControl,
    ServeControlError,
    ServeUnreachable,
    deployment_entry,
    effective_user_config,
)
from rollout.state import Weights

Role = Literal["stable", "canary", "router"]
ROUTER: Final = "router"

# What a write changed (``ServePort.write`` returns the set of these).
STABLE_TARGET: Final = "stable.target"
CANARY_TARGET: Final = "canary.target"
ROUTER_WEIGHT: Final = "router.canary_bp"
ROUTER_SHADOW: Final = "router.shadow"
CANARY_REPLICAS: Final = "canary.num_replicas"
_TARGET_CHANGE: Final[dict[Cohort, str]] = {STABLE: STABLE_TARGET, CANARY: CANARY_TARGET}

# From a deployment's current user_config, its new one (None: no change).
_Rewrite = Callable[[Mapping[str, Any] | None], dict[str, Any] | None]


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class DeploymentState:
    """One deployment as Serve reports it."""

    status: str | None = None
    replicas: Mapping[str, str] = field(default_factory=dict)  # replica id -> Serve's state
    target_num_replicas: int | None = None
    applied_user_config: Mapping[str, Any] | None = None  # what its replicas were given
    user_config: Mapping[str, Any] | None = None  # what was last asked for (the effective one)
    # Serve's autoscaling_config when it autoscales the deployment (None: a fixed count).
    autoscaling: Mapping[str, Any] | None = None
    # The pool's size as last asked for: the autoscaler's floor, or the fixed replica count
    # (None: unknown). What the controller sets; the replicas Serve runs may differ for a
    # while (starting, stopping) and, when autoscaled, for load.
    pool_size: int | None = None

    @property
    def running(self) -> frozenset[str]:
        return frozenset(rid for rid, state in self.replicas.items() if state == "RUNNING")

    @property
    def expected_replicas(self) -> int:
        """The replica count Serve is configured for (the RUNNING ones when it does not say)."""
        return self.target_num_replicas or len(self.running)

    @property
    def settled(self) -> bool:
        """HEALTHY, every replica RUNNING: each one has been reconfigured (those being
        reconfigured are UPDATING), so ``applied_user_config`` is what they all run."""
        return self.status == "HEALTHY" and all(s == "RUNNING" for s in self.replicas.values())


@dataclass(frozen=True)
class ServeState:
    """The application's three deployments (None: Serve does not run that one)."""

    stable: DeploymentState | None = None
    canary: DeploymentState | None = None
    router: DeploymentState | None = None

    def cohort(self, cohort: Cohort) -> DeploymentState | None:
        return self.stable if cohort == STABLE else self.canary

    def _router_config(self) -> RouterConfig | None:
        """The router's user_config once every replica has it (None: unknown)."""
        router = self.router
        if router is None or not router.settled:
            return None
        try:
            return RouterConfig.from_user_config(router.applied_user_config or {})
        except ConfigError:
            return None  # not a config the router would run: what it applies is unknown

    @property
    def router_weights(self) -> Weights | None:
        """The weights the router applies: its user_config once every replica has it."""
        config = self._router_config()
        return None if config is None else Weights.with_canary(config.canary_bp)

    @property
    def router_shadow_bp(self) -> int | None:
        """The share of stable's requests the router mirrors to the canary (bp)."""
        config = self._router_config()
        return None if config is None else config.shadow.fraction_bp


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class ServeChange:
    """What one write sets; what is absent is left as it is. A target of None clears the
    cohort's target (an idle pool)."""

    targets: Mapping[Cohort, Target | None] = field(default_factory=dict)
    canary_bp: int | None = None
    canary_replicas: int | None = None
    shadow: ShadowRouting | None = None

    def __bool__(self) -> bool:
        return (
            bool(self.targets)
            or self.canary_bp is not None
            or self.canary_replicas is not None
            or self.shadow is not None
        )

    def then(self, later: ServeChange) -> ServeChange:
        """This change followed by ``later``: where both set something, ``later`` wins."""
        return ServeChange(
            targets={**self.targets, **later.targets},
            canary_bp=self.canary_bp if later.canary_bp is None else later.canary_bp,
            canary_replicas=(
                self.canary_replicas if later.canary_replicas is None else later.canary_replicas
            ),
            shadow=self.shadow if later.shadow is None else later.shadow,
        )


def replica_user_config(
    current: Mapping[str, Any], cohort: Cohort, target: Target | None
) -> dict[str, Any] | None:
    """The whole user_config of a cohort's replicas with ``target``; None when ``current``
    already says that.

    The target is the controller's to write: where the one in ``current`` is one no replica
    accepts (a revision 0 put by hand, a field an older tool wrote), the rest is kept and the
    target replaced, so a repair is never refused for the very value it repairs. An invalid
    field elsewhere still refuses, naming the field."""
    try:
        config = ReplicaConfig.from_user_config(current)
    except ConfigError:
        rest = ReplicaConfig.from_user_config({k: v for k, v in current.items() if k != "target"})
        return rest.with_target(target).model_dump(mode="json", exclude_unset=True)
    wanted = config.with_target(target)
    return None if wanted == config else wanted.model_dump(mode="json", exclude_unset=True)


def _router_parts(
    current: Mapping[str, Any], canary_bp: int | None, shadow: ShadowRouting | None
) -> tuple[RouterConfig | None, RouterConfig]:
    """The router's user_config ``current`` parsed (None when invalid), and the part of it the
    controller keeps: all of it, or, where only the fields it is about to write (``canary_bp``,
    ``shadow``: those given) make it invalid, the rest, so that a repair replaces them rather
    than stopping at them. Any other invalid field: ConfigError naming it."""
    try:
        config = RouterConfig.from_user_config(current)
        return config, config
    except ConfigError:
        given = {"canary_bp": canary_bp, "shadow": shadow}
        owned = {name for name, value in given.items() if value is not None}
        if not owned:
            raise
        rest = {k: v for k, v in current.items() if k not in owned}
        return None, RouterConfig.from_user_config(rest)


def router_user_config(
    current: Mapping[str, Any],
    canary_bp: int | None,
    shadow: ShadowRouting | None = None,
) -> dict[str, Any] | None:
    """The router's whole user_config with ``canary_bp`` and ``shadow`` (None: as they are),
    checked as a whole; None when ``current`` already says that."""
    config, kept = _router_parts(current, canary_bp, shadow)
    data = kept.model_dump(mode="json", exclude_unset=True)
    if canary_bp is not None:
        data["canary_bp"] = canary_bp
    if shadow is not None:
        data.pop("shadow", None)  # off: the config reads as its author wrote it
        if shadow != ShadowRouting():
            data["shadow"] = shadow.model_dump(mode="json")
    wanted = RouterConfig.parse(data, where="user_config")
    return None if wanted == config else wanted.model_dump(mode="json", exclude_unset=True)


def drift(state: ServeState, wanted: ServeChange) -> frozenset[str]:
    """What ``wanted`` would change in the config Serve was last asked for, as ``state`` read
    it (``STABLE_TARGET`` ...): the drift a repair undoes. Only what ``wanted`` sets is
    compared, and nothing of a deployment Serve does not run or shows no user_config of."""
    found: set[str] = set()
    for cohort, target in wanted.targets.items():
        deployment = state.cohort(cohort)
        # No user_config shown: Serve is (re)building the app; compared on a later tick.
        if deployment is None or deployment.user_config is None:
            continue
        if replica_user_config(deployment.user_config, cohort, target) is not None:
            found.add(_TARGET_CHANGE[cohort])
    router = state.router
    if (
        router is not None
        and router.user_config is not None
        and (wanted.canary_bp is not None or wanted.shadow is not None)
    ):
        asked, _ = _router_parts(router.user_config, wanted.canary_bp, wanted.shadow)
        if wanted.canary_bp is not None and (asked is None or asked.canary_bp != wanted.canary_bp):
            found.add(ROUTER_WEIGHT)
        if wanted.shadow is not None and (asked is None or asked.shadow != wanted.shadow):
            found.add(ROUTER_SHADOW)
    canary = state.canary
    if (
        wanted.canary_replicas is not None
        and canary is not None
        and canary.pool_size is not None
        and canary.pool_size != wanted.canary_replicas
    ):
        found.add(CANARY_REPLICAS)
    return frozenset(found)


def asked_pool_size(entry: Mapping[str, Any] | None, live: Mapping[str, Any]) -> int | None:
    """The pool size a deployment was last asked for: its declarative entry's autoscaling
    floor or ``num_replicas``, else the live config's (the code's options)."""
    for source in (entry or {}, live):
        scaling = source.get("autoscaling_config")
        if isinstance(scaling, Mapping) and scaling.get("min_replicas") is not None:
            return int(scaling["min_replicas"])
        if isinstance(source.get("num_replicas"), int):
            return int(source["num_replicas"])
    return None


def autoscaling_with_floor(asked: Mapping[str, Any], floor: int) -> dict[str, Any] | None:
    """The declarative config's ``autoscaling_config`` ``asked`` with ``min_replicas``
    ``floor`` (``max_replicas`` raised to it where lower); None when it already says that.
    Nothing else is added or changed: Serve hashes the autoscaling policy into the
    application's code version, so a key that appears or changes there would make it restart
    every replica of the app, where a new floor is applied in place."""
    if asked.get("min_replicas") == floor and (asked.get("max_replicas") or 1) >= floor:
        return None
    scaling = copy.deepcopy(dict(asked))
    scaling["min_replicas"] = floor
    scaling["max_replicas"] = max(int(scaling.get("max_replicas") or 1), floor)
    initial = scaling.get("initial_replicas")
    if initial is not None and not floor <= initial <= scaling["max_replicas"]:
        scaling["initial_replicas"] = floor
    return scaling


class ServePort(Protocol):
    def read(self) -> ServeState:
        """The three deployments now; ServeUnreachable when Serve does not answer."""
        ...

    def write(self, change: ServeChange) -> frozenset[str]:
        """Carry ``change`` out; what it changed (``STABLE_TARGET`` ...), empty when nothing
        needed to change and so nothing was sent."""
        ...

    def close(self) -> None: ...


class HttpServePort:
    """The port over Serve's REST API: ``read`` is one GET, ``write`` one GET and at most one
    PUT."""

    def __init__(
        self,
        control: ServeControl,
        *,
        app: str,
        stable: str = "stable",
        canary: str = "canary",
        router: str = "router",
    ) -> None:
        self.control = control
        self.app = app
        self.names: dict[Role, str] = {STABLE: stable, CANARY: canary, ROUTER: router}

    @classmethod
    def for_settings(cls, settings: ControllerSettings) -> HttpServePort:
        return cls(
            ServeControl(settings.dashboard_url),
            app=settings.app_name,
            stable=settings.stable_deployment,
            canary=settings.canary_deployment,
            router=settings.router_deployment,
        )

    def close(self) -> None:
        self.control.close()

    def read(self) -> ServeState:
        details = self.control.details()
        app = (details.get("applications") or {}).get(self.app) or {}
        deployed = app.get("deployed_app_config") or {}
        entries = {e.get("name"): e for e in deployed.get("deployments") or []}

        def state(role: Role) -> DeploymentState | None:
            name = self.names[role]
            live = (app.get("deployments") or {}).get(name)
            if not live:
                return None
            return DeploymentState(
                status=live.get("status"),
                replicas={
                    str(r.get("replica_id")): str(r.get("state"))
                    for r in live.get("replicas") or []
                },
                target_num_replicas=live.get("target_num_replicas"),
                applied_user_config=(live.get("deployment_config") or {}).get("user_config"),
                user_config=effective_user_config(details, entries.get(name), self.app, name),
                autoscaling=(live.get("deployment_config") or {}).get("autoscaling_config"),
                pool_size=asked_pool_size(entries.get(name), live.get("deployment_config") or {}),
            )

        return ServeState(stable=state(STABLE), canary=state(CANARY), router=state(ROUTER))

    def write(self, change: ServeChange) -> frozenset[str]:
        if not change:
            return frozenset()
        details = self.control.details()
        current = self.control.declarative_config(details)
        wanted = copy.deepcopy(current)
        changed = self._apply(wanted, details, change)
        if changed:
            self.control.apply(wanted)
        return changed

    def _apply(
        self, config: dict[str, Any], details: Mapping[str, Any], change: ServeChange
    ) -> frozenset[str]:
        """Make ``change`` in the declarative ``config``; what it changed. An entry is only
        added or altered where a value differs, so a change of nothing leaves ``config`` as
        it was."""
        changed: set[str] = set()

        def set_user_config(role: Role, make: _Rewrite) -> bool:
            name = self.names[role]
            entry = deployment_entry(config, self.app, name, create=False)
            current = effective_user_config(details, entry, self.app, name)
            if current is None:
                # Serve shows none while it (re)builds the app: a config made from nothing
                # would drop every field but the one written (the controller to report
                # to, the cache, ...). Not an outage: the tick holds and tries again.
                raise ServeUnreachable(
                    f"the {name!r} deployment of {self.app!r} shows no user_config (Serve is "
                    "deploying it); not written, tried again on the next tick"
                )
            new = make(current)
            if new is None:
                return False
            entry = entry if entry is not None else deployment_entry(config, self.app, name)
            assert entry is not None
            entry["user_config"] = new
            return True

        for cohort, target in change.targets.items():
            if set_user_config(
                cohort, lambda cur, c=cohort, t=target: replica_user_config(cur, c, t)
            ):
                changed.add(_TARGET_CHANGE[cohort])
        if change.canary_bp is not None or change.shadow is not None:
            bp, shadow = change.canary_bp, change.shadow
            before = effective_user_config(
                details,
                deployment_entry(config, self.app, self.names[ROUTER], create=False),
                self.app,
                self.names[ROUTER],
            )
            if set_user_config(ROUTER, lambda cur: router_user_config(cur, bp, shadow)):
                old, _ = _router_parts(before or {}, bp, shadow)
                if bp is not None and (old is None or old.canary_bp != bp):
                    changed.add(ROUTER_WEIGHT)
                if shadow is not None and (old is None or old.shadow != shadow):
                    changed.add(ROUTER_SHADOW)
        if change.canary_replicas is not None and self._scale(
            config, details, self.names[CANARY], change.canary_replicas
        ):
            changed.add(CANARY_REPLICAS)
        return frozenset(changed)

    def _scale(
        self, config: dict[str, Any], details: Mapping[str, Any], name: str, replicas: int
    ) -> bool:
        entry = deployment_entry(config, self.app, name, create=False)
        app = (details.get("applications") or {}).get(self.app) or {}
        live_config = (((app.get("deployments") or {}).get(name) or {}).get("deployment_config")
                       or {})  # fmt: skip
        asked = (entry or {}).get("autoscaling_config")
        if asked is not None:
            scaling = autoscaling_with_floor(asked, replicas)
            if scaling is None:
                return False
            assert entry is not None
            entry["autoscaling_config"] = scaling
            return True
        if live_config.get("autoscaling_config") is not None:
            # Autoscaled by the code's options: an autoscaling_config added to the config's
            # deployments list changes the application's code version (Serve hashes the
            # autoscaling policies in it), and Serve would restart every replica of the app.
            raise ServeControlError(
                f"deployment {name!r} of {self.app!r} is autoscaled by its code's options; give "
                "its autoscaling_config in the Serve config's deployments list instead, where "
                "the controller can move its floor in place"
            )
        if entry is not None and "num_replicas" in entry:
            current = entry["num_replicas"]
        else:  # not set in the declarative config: what the deployment is configured with
            app = (details.get("applications") or {}).get(self.app) or {}
            live = (app.get("deployments") or {}).get(name) or {}
            current = (live.get("deployment_config") or {}).get("num_replicas")
            if current is None:
                current = live.get("target_num_replicas")
        if current == replicas:
            return False
        entry = entry if entry is not None else deployment_entry(config, self.app, name)
        assert entry is not None
        entry["num_replicas"] = replicas
        return True
