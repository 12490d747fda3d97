"""Dynamic batcher: an asyncio front that queues requests, and the runtime's futures that complete
them; no thread of its own.

A request that finds the engine idle (a free slot, nothing queued) starts its run at once, from the
event loop's thread: `compute(feeds)` returns a concurrent.futures.Future (the runtime Model's
`predict_async`), so starting costs a hand-off, not the run. A request alone in the server (after
one turn of the loop, no other request has reached the batcher) on a model whose one-request runs
take under INLINE_MAX_SECONDS runs on the loop's thread itself (`run_now`, the Model's `predict_alone`):
the two hand-offs between threads would cost more than the run. Requests that arrive while every slot
is busy queue up; when a run completes, its callback resolves its requests, then forms the next
batch from what queued meanwhile (requests whose inputs agree on all but the batch dimension,
np.concatenate on dim 0) and starts it, in the thread that completed the run. So batches form
from what queued while the engine was busy, and nothing waits for company: at one client a
request pays no delay, under load batches grow with the queue. Policy for the next batch:

- take queued requests in order, merging compatible ones, up to `max_batch_size` rows; a full
  batch is cut to its largest preferred prefix, as Triton forms preferred sizes first;
- a batch runs padded up to a planned size (plan_sizes); where it would be padded, cut_at may cut
  it to the prefix that fits the planned size below, by the run times measured per planned size,
  and the rest wait for the next run. A CPU engine's run grows with its rows, so 9 rows of
  MobileNetV2 run as 8 and 1 rather than padded to 16; an engine whose run barely grows with the
  batch (a GPU's), or a model of microseconds a row, keeps padding;
- `max_queue_delay_us` (0 by default) lets a batch formed after a busy run wait up to that long
  after its oldest request was queued for more requests, until it is full.

Back-pressure: the queue holds at most `max_queue_size` requests, and takes none whose deadline
comes before the queued work is likely done (rows queued times the measured seconds per row);
past either, `submit` raises `QueueFull` at once instead of letting the request time out. A
request past its deadline fails with `DeadlineExceeded` and is never computed if it had not
started. A compute error (raised when the run starts, or carried by its Future) fails only the
requests of that batch; batching carries on.
"""
from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from .request_trace import COMPUTE_END, COMPUTE_START, QUEUE_START, RequestTrace, current

Feeds = Mapping[str, np.ndarray]
# A request alone in the server on a model whose one-request runs take at most this long runs on the
# event loop's thread (the loop has nothing else to do): two hand-offs between threads cost more.
INLINE_MAX_SECONDS = 0.001
# A run's time counts toward that measure at most this many times INLINE_MAX_SECONDS: one stall (the
# machine's host or a neighbour taking the core for milliseconds) must not move a fast model's lone
# requests onto the run threads for the next several runs; a model whose runs all take longer than
# INLINE_MAX_SECONDS still measures past it.
SOLO_SAMPLE_CAP = 2.0
# A batch is cut short only where the shorter run costs this much less per real row: timings move
# by a few percent between runs, and a cut makes its rest wait for the next run.
CUT_GAIN = 0.1
# ...and only where it saves at least this much engine time for the batch's rows: each run costs
# the event loop a dispatch, a resolution and a hand-off each way, which on a model of a few
# microseconds a row outweigh the padding (measured: a small CNN at 64 clients served fewer requests).
MIN_CUT_SAVING_S = 0.001
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
    max_queue_delay_us: int = 0
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


def plan_sizes(config: BatcherConfig) -> tuple[int, ...]:
    """The batch sizes merged batches are padded up to: powers of two, the preferred sizes and
    max_batch_size. The runtime plans (and times) each input shape on its first call, hundreds of
    milliseconds for a CNN, so a batch of a size never seen would stall its requests; the model
    runs these sizes once at load (ServedModel.load) and batches only ever take them."""
    sizes = {config.max_batch_size, *config.preferred_batch_sizes}
    n = 1
    while n < config.max_batch_size:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes))


def _padded_to(rows: int, sizes: Sequence[int]) -> int:
    return next((s for s in sizes if s >= rows), rows)


def cut_at(rows: Sequence[int], seconds: Mapping[int, float], sizes: Sequence[int]) -> int:
    """How many of a batch's requests (their rows, in order) run now. All of them, unless the batch
    would run padded and its longest prefix that fits the planned size below costs over CUT_GAIN
    less per real row and saves MIN_CUT_SAVING_S, by the run `seconds` measured per planned size;
    all while either size is untimed."""
    total = sum(rows)
    if len(rows) < 2 or total in sizes:
        return len(rows)
    padded = _padded_to(total, sizes)
    below = max((s for s in sizes if s < padded), default=0)
    n, kept = 0, 0
    while n < len(rows) and kept + rows[n] <= below:
        kept += rows[n]
        n += 1
    whole, part = seconds.get(padded), seconds.get(_padded_to(kept, sizes)) if n else None
    if whole is None or part is None:
        return len(rows)
    if part / kept >= (1.0 - CUT_GAIN) * whole / total or whole - part * total / kept < MIN_CUT_SAVING_S:
        return len(rows)
    return n


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
    trace: RequestTrace | None = field(default=None, repr=False)  # where the call is traced


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
        run_now: Callable[[Feeds], Outputs] | None = None,
    ) -> None:
        self._compute = compute
        self._run_now = run_now
        self.config = config
        self.batchable = batchable and config.max_batch_size > 1
        self._observer = observer
        self.name = name
        self._queue: collections.deque[_Request] = collections.deque()
        self._queued_rows = 0
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._in_flight = 0  # batches started and not yet resolved; at most config.workers
        self._timer_armed = False
        # moving averages over runs (nan until measured): how long the queued work will take, and
        # how long one request's run takes (short ones may run inline)
        self._seconds_per_row = math.nan
        self._solo_seconds = math.nan
        self._size_seconds: dict[int, float] = {}  # a run's seconds by its (padded) planned size
        self._waiting = 0  # requests submitted and not yet resolved
        self.compute_calls = 0
        self._preferred = sorted(set(config.preferred_batch_sizes), reverse=True)
        self.plan_sizes = plan_sizes(config) if self.batchable else ()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Batcher":
        return self

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests and wait until every queued request and batch in flight has been
        resolved (queued ones run as slots free)."""
        with self._cond:
            self._closed = True
            batches = self._take_batches(force=True)
        self._dispatch_all(batches)
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0 and not self._queue, timeout)

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
        with self._cond:
            self._waiting += 1
        try:
            if self._short_runs:
                # One turn of the loop first: requests it has already received reach the batcher,
                # and then this one is not alone and will not run inline.
                await asyncio.sleep(0)
            return await self._submit(feeds, rows, key, deadline, loop)
        finally:
            with self._cond:
                self._waiting -= 1

    async def _submit(self, feeds: Feeds, rows: int, key: Any, deadline: float | None,
                      loop: asyncio.AbstractEventLoop) -> Outputs:
        now = time.monotonic()
        req = _Request(feeds, rows, key, loop.create_future(), loop, now, deadline, trace=current())
        _stamp([req], QUEUE_START)
        inline = False
        with self._cond:
            if self._closed:
                raise BatcherClosed(f"model {self.name} is shutting down")
            if self._in_flight < self.config.workers and not self._queue:
                self._in_flight += 1  # idle: this request runs now, alone
                inline = self._short_runs and self._waiting == 1
                batches = [] if inline else [[req]]
            else:
                self._admit(req, now)
                self._queue.append(req)
                self._queued_rows += rows
                batches = self._take_batches() if self._in_flight < self.config.workers else []
        if inline:
            return self._run_inline(req)
        self._dispatch_all(batches)
        if deadline is not None:
            req.timer = loop.call_at(loop.time() + (deadline - time.monotonic()), _expire, req)
        try:
            return await req.future
        finally:
            if req.timer is not None:
                req.timer.cancel()

    @property
    def _short_runs(self) -> bool:
        """Whether a request alone may run on the caller's thread (a `run_now`, measured fast)."""
        return self._run_now is not None and self._solo_seconds <= INLINE_MAX_SECONDS

    def _run_inline(self, req: _Request) -> Outputs:
        """The one request in the server, on a model that answers faster than two hand-offs between
        threads take: run it on the caller's (the event loop's) thread."""
        assert self._run_now is not None
        start = time.monotonic()
        _stamp([req], COMPUTE_START)
        try:
            out = self._run_now(req.feeds)
        except BaseException as e:  # noqa: BLE001 - fails this request only, as a batch's compute error would
            self._finish([req], start, None, e, resolve=False)
            raise self._compute_error(1, e) from e
        self._finish([req], start, [out], None, resolve=False, size=req.rows)
        return dict(out)

    def _admit(self, req: _Request, now: float) -> None:
        """Refuse (QueueFull) a request the queue has no room or no time for; lock held."""
        if len(self._queue) >= self.config.max_queue_size:
            raise QueueFull(f"model {self.name}: queue is full ({self.config.max_queue_size} requests waiting)")
        if req.deadline is not None and self._seconds_per_row > 0:  # False while nan: not measured
            wait = (self._queued_rows + req.rows) * self._seconds_per_row
            if now + wait > req.deadline:
                raise QueueFull(
                    f"model {self.name}: {len(self._queue)} requests ({self._queued_rows} rows) are queued, "
                    f"about {wait:.3g} s of work, more than this request's deadline allows"
                )

    # -- forming batches ---------------------------------------------------------------------------
    def _take_batches(self, force: bool = False) -> list[list[_Request]]:
        """Batches for every free slot from what is queued; lock held. A batch short of full waits
        (a timer comes back) while max_queue_delay_us allows, unless `force`."""
        batches = []
        while self._in_flight < self.config.workers and self._queue:
            batch = self._take_batch(force or self._closed)
            if batch is None:
                break
            self._in_flight += 1
            batches.append(batch)
        return batches

    def _take_batch(self, force: bool) -> list[_Request] | None:
        head = self._pop_live()
        if head is None:
            return None
        batch = [head]
        if head.key is None or head.rows >= self.config.max_batch_size:
            self._queued_rows -= head.rows
            return batch
        rows = self._gather(batch, head.rows)
        delay = self.config.max_queue_delay_us * 1e-6
        if not force and delay > 0 and rows < self.config.max_batch_size:
            left = head.enqueued + delay - time.monotonic()
            if left > 0:  # put it back as it was and come back when the delay is up
                self._queue.extendleft(reversed(batch))
                self._arm_timer(head.loop, left)
                return None
        n = self._preferred_prefix(batch, rows)
        if n == len(batch):
            n = cut_at([r.rows for r in batch], self._size_seconds, self.plan_sizes)
        if n < len(batch):  # the rest go back to the queue's head, in order
            self._queue.extendleft(reversed(batch[n:]))
            batch = batch[:n]
        self._queued_rows -= sum(r.rows for r in batch)
        return batch

    def _arm_timer(self, loop: asyncio.AbstractEventLoop, after: float) -> None:
        if self._timer_armed:
            return
        self._timer_armed = True
        try:
            loop.call_soon_threadsafe(loop.call_later, after, self._timer_fired)
        except RuntimeError:  # the loop is closed: nobody is waiting
            self._timer_armed = False

    def _timer_fired(self) -> None:
        with self._cond:
            self._timer_armed = False
            batches = self._take_batches()
        self._dispatch_all(batches)

    def _pop_live(self) -> _Request | None:
        q = self._queue
        while q:
            req = q.popleft()
            if not req.future.done():  # skip cancelled / expired ones
                return req
            self._queued_rows -= req.rows
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
                self._queued_rows -= req.rows
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

    def _preferred_prefix(self, batch: list[_Request], rows: int) -> int:
        """How many of the batch's requests make its longest prefix whose rows are a preferred size
        (all where none is, or where the whole batch is one)."""
        if not self._preferred or rows in self._preferred:
            return len(batch)
        total, prefix = 0, {}
        for i, req in enumerate(batch):
            total += req.rows
            prefix[total] = i + 1
        return next((prefix[size] for size in self._preferred if size in prefix), len(batch))

    # -- running batches -------------------------------------------------------------------------
    def _dispatch_all(self, batches: list[list[_Request]]) -> None:
        for batch in batches:
            self._dispatch(batch)

    def _dispatch(self, batch: list[_Request]) -> None:
        """Start the batch's run, padded to a planned size; its completion callback resolves the
        requests."""
        start = time.monotonic()
        _stamp(batch, COMPUTE_START)
        rows = sum(r.rows for r in batch)
        try:
            if len(batch) == 1:
                feeds = batch[0].feeds
            else:
                feeds = {n: np.concatenate([r.feeds[n] for r in batch], axis=0) for n in batch[0].feeds}
            size = _padded_to(rows, self.plan_sizes) if batch[0].key is not None else rows
            feeds = _pad(feeds, rows, size)
            running = self._compute(feeds)
        except BaseException as e:  # noqa: BLE001 - a run that cannot start fails this batch only
            self._finish(batch, start, None, e)
            return
        running.add_done_callback(partial(self._completed, batch, start, rows, size))

    def _completed(self, batch: list[_Request], start: float, rows: int, size: int, running: Future[Outputs]) -> None:
        try:
            out = running.result()
            if any(v.ndim > 0 and v.shape[0] > rows for v in out.values()):  # the padding's rows go
                out = {k: v[:rows] for k, v in out.items()}
            results = [dict(out)] if len(batch) == 1 else _split(out, [r.rows for r in batch], self.name)
        except BaseException as e:  # noqa: BLE001 - any compute failure fails this batch only
            self._finish(batch, start, None, e)
            return
        self._finish(batch, start, results, None, size=size)

    def _finish(self, batch: list[_Request], start: float, results: list[Outputs] | None,
                error: BaseException | None, resolve: bool = True, size: int | None = None) -> None:
        """Count the run and free its slot, then observe it, resolve the batch's requests and start
        the next batch from what queued meanwhile. The slot is free before any answer leaves: a
        client that sends its next request on this answer finds the engine idle and this run
        measured, as it would a moment later (so a fast model's lone request runs inline)."""
        seconds = time.monotonic() - start
        _stamp(batch, COMPUTE_END)
        rows = sum(r.rows for r in batch)
        with self._cond:
            self.compute_calls += 1
            if error is None:
                if rows == 1:
                    self._solo_seconds = _moving_average(self._solo_seconds,
                                                         min(seconds, SOLO_SAMPLE_CAP * INLINE_MAX_SECONDS))
                self._seconds_per_row = _moving_average(self._seconds_per_row, seconds / max(rows, 1))
                if size is not None and size in self.plan_sizes:
                    self._size_seconds[size] = _moving_average(self._size_seconds.get(size, math.nan), seconds)
            self._in_flight -= 1
            batches = self._take_batches()
            self._cond.notify_all()
        try:
            self._observe(batch, rows, start, seconds)
            if resolve and error is not None:
                wrapped = self._compute_error(len(batch), error)
                wrapped.__cause__ = error
                _resolve(batch, None, wrapped)
            elif resolve:
                _resolve(batch, results, None)
        finally:
            self._dispatch_all(batches)

    def _compute_error(self, requests: int, error: BaseException) -> BatchComputeError:
        return BatchComputeError(
            f"model {self.name} failed on a batch of {requests} request(s): {type(error).__name__}: {error}"
        )

    def _observe(self, batch: list[_Request], rows: int, start: float, compute_seconds: float) -> None:
        if self._observer is None:
            return
        try:
            self._observer.on_batch(rows, len(batch), [start - r.enqueued for r in batch], compute_seconds)
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            pass


def _stamp(batch: list[_Request], name: str) -> None:
    """Stamp the traced requests of a batch with one time: its run's start and end are each of theirs."""
    ns = None
    for req in batch:
        if req.trace is not None:
            ns = time.monotonic_ns() if ns is None else ns
            req.trace.stamp(name, ns)


def _moving_average(average: float, sample: float) -> float:
    return sample if math.isnan(average) else 0.8 * average + 0.2 * sample


def _pad(feeds: Feeds, rows: int, size: int) -> Feeds:
    """Feeds of `size` rows: the last row repeated after the real ones (valid input, thrown away)."""
    if size <= rows:
        return feeds
    return {n: np.concatenate([a, np.repeat(a[-1:], size - rows, axis=0)], axis=0) for n, a in feeds.items()}


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
