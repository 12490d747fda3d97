"""Fault injection, for proving rollouts roll back: a share of inference calls fail on purpose.

Off unless the serving process's environment sets KUBETRT_FAULT_ERROR_RATE (a fraction, 0..1);
never set by the operator. Failures are spread evenly and deterministically (rate 0.5: every
second call), and counted as the `error` outcome like any server fault.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Mapping

from .errors import ServingError

ENV_ERROR_RATE = "KUBETRT_FAULT_ERROR_RATE"


class InjectedFault(ServingError):
    """A call failed by KUBETRT_FAULT_ERROR_RATE (HTTP 500, gRPC INTERNAL)."""


class FaultInjector:
    """Fails ``rate`` of the calls it is asked about, evenly spread."""

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0 or math.isnan(rate):
            raise ValueError(f"{ENV_ERROR_RATE}={rate}: expected a fraction from 0 to 1")
        self.rate = rate
        self._calls = 0
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise InjectedFault when this call is one of the failing share."""
        with self._lock:
            self._calls += 1
            n = self._calls
        if math.floor(n * self.rate) > math.floor((n - 1) * self.rate):
            raise InjectedFault(f"injected fault ({ENV_ERROR_RATE}={self.rate:g})")


def from_env(env: Mapping[str, str] | None = None) -> FaultInjector | None:
    """The injector the environment asks for, or None (the default: no faults)."""
    raw = (os.environ if env is None else env).get(ENV_ERROR_RATE, "").strip()
    if not raw:
        return None
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_ERROR_RATE}={raw!r}: expected a fraction from 0 to 1") from None
    injector = FaultInjector(rate)
    return injector if rate > 0 else None
