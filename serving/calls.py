"""What every transport (REST, gRPC) does around one inference call: find the model, and count the
call in its metrics, so both report the same requests the same way."""
from __future__ import annotations

import time
from typing import Awaitable, Callable, TypeVar

from . import faults, idle_polling
from .errors import NotFound, Overloaded, ServingError
from .metrics import UNKNOWN_MODEL
from .registry import ModelRegistry, ServedModel

T = TypeVar("T")
OUTCOME_BY_STATUS = {400: "bad_request", 404: "not_found", 413: "too_large", 503: "unavailable", 504: "timeout"}
FAULTS = faults.from_env()  # None unless KUBETRT_FAULT_ERROR_RATE is set (fault injection, off by default)


def lookup(registry: ModelRegistry, name: str, version: str | None) -> ServedModel:
    try:
        return registry.get(name, version)
    except NotFound:
        registry.metrics.requests.labels(UNKNOWN_MODEL, "not_found").inc()
        raise


async def tracked(served: ServedModel, handle: Callable[[], Awaitable[T]]) -> T:
    """Run one inference call with in-flight, duration and outcome metrics for its model, traced
    where it is one the server traces (request_trace); the loop polls for the next call a while
    after the last one in flight (idle_polling)."""
    m = served.metrics
    polling = idle_polling.of_running_loop()
    polling.enter()
    m.inflight.inc()
    traces = served.traces
    trace = traces.start(served.name, served.version) if traces is not None else None
    outcome = "error"
    t0 = time.perf_counter()
    try:
        if FAULTS is not None:
            FAULTS.check()
        result = await handle()
        outcome = "success"
    except ServingError as e:
        outcome = "overloaded" if isinstance(e, Overloaded) else OUTCOME_BY_STATUS.get(e.status, "error")
        raise
    finally:
        m.inflight.dec()
        m.on_request(outcome, time.perf_counter() - t0)
        if traces is not None and trace is not None:
            traces.finish(trace, outcome)
        polling.leave(served.config.idle_poll_us / 1e6)
    return result
