"""Test-only fault injection in a replica's rank calls.

A ranker's user_config may carry ``faults`` (``app.contracts.FaultInjection``): extra latency on
every rank call, and a fraction of calls that fail. Tests use them to watch the router and the
rollout controller react to a slow or failing canary.

A user_config is data that anyone who can deploy may change, so it alone must not be able to
break real traffic: faults take effect only in a process whose environment has
``ROLLOUT_FAULT_INJECTION=allow`` (set where tests start Ray), and are ignored, and reported,
everywhere else.

Pure: no Ray, no torch.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Final

from app.contracts import FaultInjection
from app.errors import InjectedFault as InjectedFault  # old import path

FAULT_INJECTION_ENV: Final = "ROLLOUT_FAULT_INJECTION"
FAULT_INJECTION_ALLOWED: Final = "allow"


def fault_injection_allowed() -> bool:
    """Does this process's environment allow fault injection?"""
    return os.environ.get(FAULT_INJECTION_ENV) == FAULT_INJECTION_ALLOWED


@dataclass(frozen=True)
class FaultPlan:
    """What fault injection does to one rank call: wait ``delay_s``, then fail or not."""

    delay_s: float = 0.0
    fail: bool = False


NO_FAULT: Final = FaultPlan()


class FaultInjector:
    """The faults in effect in one replica, and the plan for each rank call.

    Whether faults are allowed here is the caller's decision (it reports faults it ignores);
    this only carries out what it is given."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._faults: FaultInjection | None = None
        self._rng = rng or random.Random()

    @property
    def active(self) -> FaultInjection | None:
        return self._faults

    def set(self, faults: FaultInjection | None) -> bool:
        """Put ``faults`` in effect (None: none); True when that changed them."""
        changed = faults != self._faults
        self._faults = faults
        return changed

    def plan(self) -> FaultPlan:
        """One rank call's fault: NO_FAULT unless faults are in effect."""
        faults = self._faults  # one read: reconfigure may replace it meanwhile
        if faults is None:
            return NO_FAULT
        fail = faults.error_rate > 0 and self._rng.random() < faults.error_rate
        return FaultPlan(delay_s=faults.extra_latency_ms / 1000.0, fail=fail)
