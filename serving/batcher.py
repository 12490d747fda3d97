"""Dynamic batcher: an asyncio front that queues requests, one thread that merges them, and the
runtime's futures that complete them.

Why a thread behind an asyncio front: the serving event loop must never block, and forming a
batch waits on a bounded queue with timed waits. That thread merges queued requests whose inputs
agree on all but the batch dimension (np.concatenate on dim 0) and starts one run:
`compute(feeds)` returns a concurrent.futures.Future (the runtime Model's `predict_async`). The
run's completion callback splits the outputs back and resolves the requests' asyncio futures, so
no thread waits on a result. At most `workers` batches are in flight: the next batch is formed
only once a slot is free, so under load requests keep accumulating into larger batches. Policy,
in order:

- nothing else waiting: dispatch at once (no added latency at concurrency 1);
- the batch reached `max_batch_size` or a preferred size: dispatch (a full batch is cut to its
  largest preferred prefix, as Triton forms preferred sizes first);
- otherwise, while other requests are arriving, wait for more up to `max_queue_delay_us` after
  the oldest request was queued, then dispatch the largest preferred prefix (or everything).

Back-pressure: the queue holds at most `max_queue_size` requests; beyond that `submit` raises
`QueueFull` at once instead of buffering without bound. A request past its deadline fails with
`DeadlineExceeded` and is never computed if it had not started. A compute error (raised when the
run starts, or carried by its Future) fails only the requests of that batch; batching carries on.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]
Compute = Callable[[Feeds], Future[Outputs]]  # starts a run; the Future holds its outputs


class BatcherError(RuntimeError):
    """Base of the batcher's own failures (as opposed to errors raised by compute)."""


class QueueFull(BatcherError):
    """The bounded queue is full: the caller should shed load (HTTP 503 + Retry-After)."""


class BatcherClosed(BatcherError):
    """The batcher is shutting down and takes no new requests."""


class DeadlineExceeded(BatcherError, TimeoutError):
    """The request's deadline passed before its result was ready."""


class BatchComputeError(BatcherError):
    """Compute failed for the batch this request was part of; `__cause__` is the original error."""


class BatchObserver(Protocol):
    """Hook for metrics; called from the thread that completed a run, so implementations must be
    thread-safe."""

    def on_batch(self, rows: int, requests: int, queue_seconds: Sequence[float], compute_seconds: float) -> None: ...


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 32
    max_queue_delay_us: int = 500
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    workers: int = 1  # batches in flight at once

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size {self.max_batch_size}: expected >= 1")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us {self.max_queue_delay_us}: expected >= 0")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size {self.max_queue_size}: expected >= 1")
        if self.workers < 1:
            raise ValueError(f"workers {self.workers}: expected >= 1")
        bad = [p for p in self.preferred_batch_sizes if not 1 <= p <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred batch sizes {bad}: expected each in 1..max_batch_size ({self.max_batch_size})")


@dataclass(eq=False)
class _Request:
    feeds: Feeds
    rows: int
    key: Any  # requests with equal keys can be concatenated; None = never merged
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float
    deadline: float | None  # time.monotonic() based
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


def batch_key(feeds: Feeds) -> tuple[int, Any] | None:
    """(rows, merge key) of a request: inputs must share dim 0; the key is names, dtypes, dims 1..

    A request whose inputs are scalars or disagree on dim 0 cannot be merged (key None).
    """
    rows = -1
    parts = []
    for name in sorted(feeds):
        a = feeds[name]
        if a.ndim == 0:
            return None
        if rows == -1:
            rows = a.shape[0]
        elif a.shape[0] != rows:
            return None
        parts.append((name, a.dtype.str, a.shape[1:]))
    if rows < 1:
        return None
    return rows, tuple(parts)


class Batcher:
    """Per-model dynamic batcher. `await submit(feeds)` returns that request's outputs."""

    def __init__(
        self,
        compute: Compute,
        config: BatcherConfig = BatcherConfig(),
        *,
        batchable: bool = True,
        observer: BatchObserver | None = None,
        name: str = "model",
    ) -> None:
        self._compute = compute
        self.config = config
        self.batchable = batchable and config.max_batch_size > 1
        self._observer = observer
        self.name = name
        self._queue: collections.deque[_Request] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._in_flight = 0  # batches started and not yet resolved; at most config.workers
        self._former: threading.Thread | None = None
        self.compute_calls = 0
        self._preferred = sorted(set(config.preferred_batch_sizes), reverse=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Batcher":
        with self._cond:
            if self._former is None:
                self._former = threading.Thread(target=self._form_batches, name=f"batcher-{self.name}", daemon=True)
                self._former.start()
        return self

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, dispatch what is queued, and wait until every batch in flight
        has resolved its requests."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._former is not None:
            self._former.join(timeout)
        with self._cond:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._cond.wait_for(lambda: self._in_flight == 0, left)

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- async front -----------------------------------------------------------------------------
    async def submit(self, feeds: Feeds, *, deadline: float | None = None) -> Outputs:
        """Queue one validated request; `deadline` is absolute, on the time.monotonic() clock.

        Raises QueueFull / BatcherClosed at once, DeadlineExceeded when the deadline passes,
        BatchComputeError when the batch's compute failed.
        """
        loop = asyncio.get_running_loop()
        rk = batch_key(feeds)
        rows, key = rk if rk is not None else (1, None)
        if not self.batchable:
            key = None
        req = _Request(feeds, rows, key, loop.create_future(), loop, time.monotonic(), deadline)
        with self._cond:
            if self._closed:
                raise BatcherClosed(f"model {self.name} is shutting down")
            if len(self._queue) >= self.config.max_queue_size:
                raise QueueFull(
                    f"model {self.name}: queue is full ({self.config.max_queue_size} requests waiting)"
                )
            self._queue.append(req)
            self._cond.notify()
        if deadline is not None:
            req.timer = loop.call_at(loop.time() + (deadline - time.monotonic()), _expire, req)
        try:
            return await req.future
        finally:
            if req.timer is not None:
                req.timer.cancel()

    # -- forming batches ---------------------------------------------------------------------------
    def _form_batches(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._dispatch(batch)

    def _next_batch(self) -> list[_Request] | None:
        """Wait for a free slot, then for a batch; None once closed and drained."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight < self.config.workers)
            batch = self._take_batch()
            if batch is not None:
                self._in_flight += 1
            return batch

    def _take_batch(self) -> list[_Request] | None:
        """The batching policy; called with the lock held."""
        cfg = self.config
        while True:
            head = self._pop_live()
            if head is not None:
                break
            if self._closed:
                return None
            self._cond.wait()
        batch = [head]
        if head.key is None or head.rows >= cfg.max_batch_size:
            return batch
        rows = head.rows
        wait_until = head.enqueued + cfg.max_queue_delay_us * 1e-6
        while True:
            rows = self._gather(batch, rows)
            if rows >= cfg.max_batch_size or rows in self._preferred:
                return self._trim_to_preferred(batch, rows)  # a full batch too: preferred sizes first
            # Wait only when traffic is concurrent (someone besides the head showed up).
            remaining = wait_until - time.monotonic()
            if len(batch) == 1 or remaining <= 0 or self._closed:
                break
            before = len(self._queue)
            self._cond.wait(remaining)
            if len(self._queue) == before and time.monotonic() >= wait_until:
                break
        return self._trim_to_preferred(batch, rows)

    def _pop_live(self) -> _Request | None:
        q = self._queue
        while q:
            req = q.popleft()
            if not req.future.done():  # skip cancelled / expired ones
                return req
        return None

    def _gather(self, batch: list[_Request], rows: int) -> int:
        """Move compatible queued requests into `batch` (FIFO among them) up to max_batch_size."""
        q = self._queue
        if not q:
            return rows
        key, limit = batch[0].key, self.config.max_batch_size
        keep: collections.deque[_Request] = collections.deque()
        while q:
            req = q.popleft()
            if req.future.done():
                continue
            if req.key == key and rows + req.rows <= limit:
                batch.append(req)
                rows += req.rows
            else:
                keep.append(req)
                if rows >= limit:
                    break
        keep.extend(q)
        self._queue = keep
        return rows

    def _trim_to_preferred(self, batch: list[_Request], rows: int) -> list[_Request]:
        """Cut the batch to its longest prefix whose rows are a preferred size; requeue the rest."""
        if not self._preferred or rows in self._preferred:
            return batch
        total, prefix = 0, {}
        for i, req in enumerate(batch):
            total += req.rows
            prefix[total] = i + 1
        for size in self._preferred:
            if size in prefix:
                n = prefix[size]
                self._queue.extendleft(reversed(batch[n:]))
                if len(batch) > n:
                    self._cond.notify()
                return batch[:n]
        return batch

    # -- running batches -------------------------------------------------------------------------
    def _dispatch(self, batch: list[_Request]) -> None:
        """Start the batch's run; its completion callback resolves the requests."""
        start = time.monotonic()
        try:
            if len(batch) == 1:
                feeds = batch[0].feeds
            else:
                feeds = {n: np.concatenate([r.feeds[n] for r in batch], axis=0) for n in batch[0].feeds}
            running = self._compute(feeds)
        except BaseException as e:  # noqa: BLE001 - a run that cannot start fails this batch only
            self._finish(batch, start, None, e)
            return
        running.add_done_callback(partial(self._completed, batch, start))

    def _completed(self, batch: list[_Request], start: float, running: Future[Outputs]) -> None:
        try:
            out = running.result()
            results = [dict(out)] if len(batch) == 1 else _split(out, [r.rows for r in batch], self.name)
        except BaseException as e:  # noqa: BLE001 - any compute failure fails this batch only
            self._finish(batch, start, None, e)
            return
        self._finish(batch, start, results, None)

    def _finish(self, batch: list[_Request], start: float, results: list[Outputs] | None,
                error: BaseException | None) -> None:
        """Count and observe the run, resolve the batch's requests, then free its slot."""
        with self._cond:
            self.compute_calls += 1
        try:
            self._observe(batch, start, time.monotonic() - start)
            if error is not None:
                wrapped = BatchComputeError(
                    f"model {self.name} failed on a batch of {len(batch)} request(s): {type(error).__name__}: {error}"
                )
                wrapped.__cause__ = error
                _resolve(batch, None, wrapped)
            else:
                _resolve(batch, results, None)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _observe(self, batch: list[_Request], start: float, compute_seconds: float) -> None:
        if self._observer is None:
            return
        try:
            self._observer.on_batch(
                sum(r.rows for r in batch), len(batch), [start - r.enqueued for r in batch], compute_seconds
            )
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            pass


def _split(out: Mapping[str, np.ndarray], rows: list[int], name: str) -> list[Outputs]:
    total = sum(rows)
    for k, v in out.items():
        if v.ndim == 0 or v.shape[0] != total:
            raise BatcherError(
                f"model {name}: output {k!r} has shape {tuple(v.shape)}, expected batch dim {total}; "
                "cannot split a merged batch"
            )
    results: list[Outputs] = []
    offset = 0
    for n in rows:
        results.append({k: v[offset : offset + n] for k, v in out.items()})
        offset += n
    return results


def _expire(req: _Request) -> None:
    if not req.future.done():
        req.future.set_exception(DeadlineExceeded("request deadline exceeded before the result was ready"))


def _resolve(batch: list[_Request], results: list[Outputs] | None, error: BaseException | None) -> None:
    """Hand results to the event loop(s) with one wake-up per loop, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, Any]]] = {}
    for i, req in enumerate(batch):
        by_loop.setdefault(req.loop, []).append((req, results[i] if results is not None else None))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, items, error)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass


def _set_all(items: list[tuple[_Request, Any]], error: BaseException | None) -> None:
    for req, result in items:
        if req.future.done():
            continue
        if error is not None:
            req.future.set_exception(error)
        else:
            req.future.set_result(result)
