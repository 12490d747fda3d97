"""Per-request timestamps, as Triton's trace at level TIMESTAMPS: where one call's time went on a live
server, which the metrics' histograms only show summed over calls.

Every `rate`-th inference call (OIP REST or gRPC, TF Serving's predict) is traced: it is stamped when
its handler starts, when it reaches the batcher, when the run that computes it starts and ends (its
batch's run, shared by the batch's requests) and when its handler ends, and is written then as one
JSON line. Stamps are time.monotonic_ns(): one clock for the server's whole life, so lines compare.
The trace in hand is this call's context variable, so the batcher finds it without its callers
passing it along.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextvars import ContextVar
from pathlib import Path

REQUEST_START = "REQUEST_START"  # the call's handler starts (its request line and headers are in)
QUEUE_START = "QUEUE_START"  # its feeds, decoded and checked, reach the model's batcher
COMPUTE_START = "COMPUTE_START"  # the run that computes it starts (inline, or handed to a run thread)
COMPUTE_END = "COMPUTE_END"  # that run has ended
REQUEST_END = "REQUEST_END"  # the handler has its answer (or its error)

_CURRENT: ContextVar["RequestTrace | None"] = ContextVar("kubetrt_request_trace", default=None)


class RequestTrace:
    """One traced call's stamps, in the order they were taken."""

    __slots__ = ("id", "model", "version", "stamps")

    def __init__(self, trace_id: int, model: str, version: str) -> None:
        self.id, self.model, self.version = trace_id, model, version
        self.stamps: list[tuple[str, int]] = [(REQUEST_START, time.monotonic_ns())]

    def stamp(self, name: str, ns: int | None = None) -> None:
        """Appended from whichever thread reaches the point (a run thread for COMPUTE_END)."""
        self.stamps.append((name, time.monotonic_ns() if ns is None else ns))


def current() -> RequestTrace | None:
    """The trace of the call this code runs for, or None (not traced, or no call)."""
    return _CURRENT.get()


class RequestTraces:
    """The traced calls of one server: one call in `rate`, each a JSON line appended to `path` when
    it ends (line-buffered: a line is in the file once its call has answered)."""

    def __init__(self, path: str | os.PathLike[str], rate: int) -> None:
        if rate < 1:
            raise ValueError(f"trace rate {rate}: expected >= 1 (trace one call in every `rate`)")
        self.path, self.rate = Path(path), rate
        try:
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        except OSError as e:
            raise ValueError(f"trace file {self.path}: cannot be opened for appending: {e.strerror}") from None
        self._lock = threading.Lock()  # calls of several event loops (tests' servers) may share one
        self._calls = 0
        self._traced = 0

    def start(self, model: str, version: str) -> RequestTrace | None:
        """A trace for this call where it is one to trace, made this call's current one."""
        with self._lock:
            self._calls += 1
            if self._calls % self.rate:
                return None
            self._traced += 1
            trace = RequestTrace(self._traced, model, version)
        _CURRENT.set(trace)
        return trace

    def finish(self, trace: RequestTrace, outcome: str) -> None:
        """Stamp the call's end and write its line."""
        trace.stamp(REQUEST_END)
        _CURRENT.set(None)
        line = json.dumps({"id": trace.id, "model": trace.model, "version": trace.version, "outcome": outcome,
                           "timestamps": [{"name": name, "ns": ns} for name, ns in trace.stamps]})
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
