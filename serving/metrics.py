"""Prometheus metrics, on a per-app CollectorRegistry so several apps (tests) never collide.

Label children are bound once per model (`for_model`), keeping `.labels()` lookups off the hot
path; the batcher reports queue/compute/batch-size through `ModelMetrics.on_batch`, a call's end
comes through `ModelMetrics.on_request`.

Those two are held, not observed, where they happen: a histogram's observation takes its locks and
walks its buckets, and just after a run, with the run's data in the caches, that cost the answer's
path tens of microseconds a call. Once FOLD_AT are held, a call's end has them folded into the
metrics after the event loop's current step, when that call's answer has been written; a scrape
(`render`) folds all that is held first, so it counts every call answered before it.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTCOMES = ("success", "bad_request", "not_found", "too_large", "unavailable", "overloaded", "timeout", "error")
UNKNOWN_MODEL = "_unknown"  # one label value for every unknown name: clients can't blow up cardinality
CONTENT_TYPE = CONTENT_TYPE_LATEST
FOLD_AT = 16  # held observations a call's end has folded in, after its answer (a few, so no fold holds the loop long)
HOLD_LIMIT = 4096  # past this many held, the thread reporting folds them at once (no call's end came to)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kubetrt_inference_requests", "Inference requests by outcome", ["model", "outcome"], registry=r
        )
        self.request_duration = Histogram(
            "kubetrt_request_duration_seconds", "End-to-end inference request time in the server",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_duration = Histogram(
            "kubetrt_queue_duration_seconds", "Time a request waited in the batcher queue",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.compute_duration = Histogram(
            "kubetrt_compute_duration_seconds", "Runtime compute time per batch",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "kubetrt_batch_size", "Rows per runtime call", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "kubetrt_batch_requests", "Requests merged per runtime call", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.inflight = Gauge("kubetrt_inflight_requests", "Inference requests in progress", ["model"], registry=r)
        self.queue_depth = Gauge("kubetrt_queue_depth", "Requests waiting in the model's batcher queue", ["model"], registry=r)
        self.ready = Gauge("kubetrt_model_ready", "1 when the model passed its golden warm-up", ["model"], registry=r)
        self._models: list[ModelMetrics] = []

    def for_model(self, model: str) -> "ModelMetrics":
        bound = ModelMetrics(self, model)
        self._models.append(bound)
        return bound

    def render(self) -> bytes:
        for bound in self._models:
            bound.fold()
        return generate_latest(self.registry)


class ModelMetrics:
    """Metric children bound to one model label."""

    def __init__(self, m: ServingMetrics, model: str) -> None:
        self.model = model
        self.outcome = {o: m.requests.labels(model, o) for o in OUTCOMES}
        self.request_duration = m.request_duration.labels(model)
        self.queue_duration = m.queue_duration.labels(model)
        self.compute_duration = m.compute_duration.labels(model)
        self.batch_size = m.batch_size.labels(model)
        self.batch_requests = m.batch_requests.labels(model)
        self.inflight = m.inflight.labels(model)
        self.queue_depth = m.queue_depth.labels(model)
        self.ready = m.ready.labels(model)
        # (observe, its arguments) not yet folded in; appended and taken from any thread (deque's own atomicity)
        self._held: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._fold_due = False  # a fold is scheduled on the event loop

    def on_batch(self, rows: int, requests: int, queue_seconds: Sequence[float], compute_seconds: float) -> None:
        self._hold(self._observe_batch, (rows, requests, queue_seconds, compute_seconds))

    def on_request(self, outcome: str, seconds: float) -> None:
        """An inference call's end (on the event loop that answers it): its outcome (one of OUTCOMES)
        and its time in the server."""
        self._hold(self._observe_request, (outcome, seconds))
        if len(self._held) >= FOLD_AT and not self._fold_due:
            try:
                asyncio.get_running_loop().call_soon(self.fold)
            except RuntimeError:  # no event loop here: now, then
                self.fold()
                return
            self._fold_due = True

    def fold(self) -> None:
        """Observe what is held."""
        self._fold_due = False
        held = self._held
        while True:
            try:
                observe, args = held.popleft()
            except IndexError:
                return
            observe(*args)

    def _hold(self, observe: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._held.append((observe, args))
        if len(self._held) >= HOLD_LIMIT:
            self.fold()

    def _observe_request(self, outcome: str, seconds: float) -> None:
        self.outcome[outcome].inc()
        self.request_duration.observe(seconds)

    def _observe_batch(self, rows: int, requests: int, queue_seconds: Sequence[float], compute_seconds: float) -> None:
        self.batch_size.observe(rows)
        self.batch_requests.observe(requests)
        self.compute_duration.observe(compute_seconds)
        for q in queue_seconds:
            self.queue_duration.observe(q)
