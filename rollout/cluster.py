"""Attaching to the running Ray cluster and finding its controller, bounded in time.

A command that talks to the cluster must end, with one clear line, when the cluster is not
there: ``ray.init`` at an address where nothing answers retries for minutes, and a named-actor
lookup or a call can block as long. Every step here takes the command's ``--timeout``:

- an explicit ``host:port`` is probed with one TCP connect first (nothing listening fails at
  once, before Ray starts logging its own retries);
- ``ray.init`` and the actor lookup are watched by a daemon thread that, at the deadline,
  prints the one error line (``error[cluster.unavailable]``) and ends the process with exit 7:
  a hung attach cannot be unwound;
- looking the controller up never creates it: :class:`ControllerNotRunning` (exit 5) says
  how to start one.

Ray is imported lazily: the CLI imports this module to start, and starts without Ray. The
errors raised here live in ``app.errors`` (re-exported here for old imports).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

from app.errors import ClusterUnreachable, ConfigError, ControllerNotRunning, error_line
from app.safe_text import redact_in, redact_uri, terminal_safe

# Every Ray head node holds one unit of this resource (and only the head): asking for a sliver
# of it places an actor on the head, and on a head that replaced a lost one (KubeRay with GCS
# fault tolerance) as well, since it names no node ID. A soft NodeAffinity to the head's ID
# was tried first: measured on a three-node cluster, Ray 2.60 placed the actor on a worker in
# most tries although the head could take it (it asks for no CPU).
HEAD_NODE_RESOURCE: Final = "node:__internal_head__"

CONTROLLER_NAME: Final = "rollout-controller"
CONTROLLER_NAMESPACE: Final = "rollout"
DEFAULT_TIMEOUT_S: Final = 30.0
MAX_TIMEOUT_S: Final = 3600.0

# The watchdog ends a hung process as the CLI's main() ends one for ClusterUnreachable:
# EXIT_UNAVAILABLE of rollout/cli/exit_codes.py, which a unit test holds equal to this. Not
# imported from there: this module is below the CLI and must not load it.
EXIT_ON_TIMEOUT: Final = 7

T = TypeVar("T")


CONTROLLER_MISSING: Final = (
    "no rollout controller in this cluster; start one with `rollout controller start`"
)


def shown_address(address: str | None) -> str:
    return terminal_safe(redact_uri(address)) if address else "auto"


def within(timeout_s: float, what: str, call: Callable[[], T]) -> T:
    """``call()`` on this thread, bounded: past ``timeout_s`` a watchdog prints the one
    error line and ends the process with exit 7.

    A blocked Ray call cannot be cancelled, nor Ray shut down around it, so ending the process
    is the only clean way out; running Ray on the main thread (not the watchdog) keeps its
    signal handlers and warnings as they are."""
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(timeout_s):
            return
        line = error_line(ClusterUnreachable.category, f"{what}: no answer within {timeout_s:g}s")
        sys.stderr.write(terminal_safe(line) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_ON_TIMEOUT)

    thread = threading.Thread(target=watchdog, name=f"timeout of {what}", daemon=True)
    thread.start()
    try:
        return call()
    finally:
        done.set()


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``host:port`` GCS address; None for ``auto``, ``local``,
    ``ray://`` client addresses and anything else Ray resolves itself."""
    if "://" in address or address in ("auto", "local"):
        return None
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def probe(address: str | None, timeout_s: float) -> None:
    """Fail at once when nothing listens at an explicit ``host:port``."""
    target = _host_port(address) if address else None
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as exc:
        reason = terminal_safe(exc.strerror or type(exc).__name__)
        raise ClusterUnreachable(
            f"no Ray cluster at {shown_address(address)}: {reason}; start one or fix --address"
        ) from None


def connect(address: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """Attach to the running cluster (``address``, else ``RAY_ADDRESS`` or ``auto``) in the
    controller's namespace; the cluster's dashboard URL when Ray tells it."""
    import ray

    if ray.is_initialized():
        return None
    probe(address, timeout_s)

    def attach() -> Any:
        return ray.init(
            address=address or "auto",
            namespace=CONTROLLER_NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )

    try:
        context = within(timeout_s, f"attaching to the Ray cluster at {shown_address(address)}",
                         attach)  # fmt: skip
    except ValueError as exc:  # Ray's "Invalid Ray address"
        raise ConfigError(
            f"--address {shown_address(address)}: not an address of a Ray cluster "
            f"({terminal_safe(redact_in(' '.join(str(exc).split()), address or ''))[:300]})",
            field="--address",
        ) from None
    except ConnectionError as exc:
        raise ClusterUnreachable(
            f"no Ray cluster to attach to at {shown_address(address)} "
            f"({terminal_safe(' '.join(str(exc).split()))[:300]}); start one or set --address"
            " (a cluster with token auth needs RAY_AUTH_MODE=token here too)"
        ) from None
    url = getattr(context, "dashboard_url", None)
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


def find_controller(
    name: str = CONTROLLER_NAME, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any | None:
    """The cluster's controller handle, or None; never creates one."""
    import ray

    def lookup() -> Any | None:
        try:
            return ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
        except ValueError:
            return None

    return within(timeout_s, "looking up the rollout controller", lookup)


def running_controller(name: str = CONTROLLER_NAME, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """The cluster's controller; ControllerNotRunning when there is none."""
    handle = find_controller(name, timeout_s)
    if handle is None:
        raise ControllerNotRunning(CONTROLLER_MISSING)
    return handle


def call(method: Any, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """One call of a controller method, answered within ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(method.remote(*args), timeout=timeout_s)
    except GetTimeoutError:
        raise ClusterUnreachable(
            f"the rollout controller did not answer within {timeout_s:g}s"
        ) from None
