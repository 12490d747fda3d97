"""Dynamic batcher unit tests with plain NumPy compute functions (no server, no model), started
on a thread pool as the runtime starts a run, or completed by hand."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

import kubetrt.serving.batcher as batcher_module
from kubetrt.serving.batcher import (
    BatchComputeError,
    Batcher,
    BatcherClosed,
    BatcherConfig,
    DeadlineExceeded,
    QueueFull,
    batch_key,
    cut_at,
    plan_sizes,
)


POOL = ThreadPoolExecutor(8, thread_name_prefix="test-compute")


def started(run):
    """A synchronous compute function as a batcher compute: each call starts a run on POOL."""
    return lambda feeds: POOL.submit(run, feeds)


class ByHand:
    """A compute whose runs finish only when the test completes their Futures."""

    def __init__(self) -> None:
        self.runs: list[tuple[dict, Future]] = []
        self.started = threading.Semaphore(0)

    def __call__(self, feeds):
        run: Future = Future()
        self.runs.append((feeds, run))
        self.started.release()
        return run

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.acquire, True, 5), "no run started"

    def finish(self, i: int) -> None:
        feeds, run = self.runs[i]
        run.set_result({"y": feeds["x"] * 2})

    def abandon(self) -> None:
        """Fail the runs a failed test left pending, so closing the batcher cannot hang."""
        for _, run in self.runs:
            if not run.done():
                run.set_exception(RuntimeError("abandoned by the test"))


class Recorder:
    """compute = y = 2x (+ rows of `z` summed), recording the batch sizes it was called with; each
    call starts a run on POOL."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[int] = []
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, feeds):
        return POOL.submit(self.run, feeds)

    def run(self, feeds):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        x = feeds["x"]
        self.calls.append(x.shape[0])
        return {"y": x * 2, "s": x.reshape(x.shape[0], -1).sum(axis=1)}


def feeds(rows: int, value: float, cols: int = 3, dtype=np.float32):
    return {"x": np.full((rows, cols), value, dtype=dtype)}


async def test_single_request_dispatches_without_waiting_for_the_delay():
    rec = Recorder()
    # A 10 s delay would hang the test if a lone request waited for company.
    b = Batcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_us=10_000_000)).start()
    try:
        out = await asyncio.wait_for(b.submit(feeds(1, 1.0)), 5)
        np.testing.assert_array_equal(out["y"], np.full((1, 3), 2.0, np.float32))
        assert rec.calls == [1]
    finally:
        b.close()


async def test_concurrent_requests_are_merged_and_split_back_in_order():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=64, max_queue_delay_us=0)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, -1.0)))
        await asyncio.to_thread(rec.entered.wait, 5)  # worker busy on `first`: the rest queue up
        rest = [asyncio.ensure_future(b.submit(feeds(1 + i % 3, float(i)))) for i in range(20)]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
        assert len(rec.calls) == 2, rec.calls  # 21 requests, 2 compute calls
        assert sum(1 + i % 3 for i in range(20)) == 39 and rec.calls[1] == 64  # padded to a planned size
        for i, out in enumerate(results[1:]):
            rows = 1 + i % 3
            np.testing.assert_array_equal(out["y"], np.full((rows, 3), 2.0 * i, np.float32))
            np.testing.assert_array_equal(out["s"], np.full((rows,), 3.0 * i, np.float32))
    finally:
        gate.set()
        b.close()


async def test_max_batch_size_bounds_each_batch():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=4, max_queue_delay_us=0)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        rest = [asyncio.ensure_future(b.submit(feeds(1, float(i)))) for i in range(10)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), 10)
        assert rec.calls == [1, 4, 4, 2]
    finally:
        gate.set()
        b.close()


async def test_incompatible_shapes_are_not_merged():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=64, max_queue_delay_us=0)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        narrow = [asyncio.ensure_future(b.submit(feeds(1, 1.0, cols=3))) for _ in range(3)]
        wide = [asyncio.ensure_future(b.submit(feeds(1, 1.0, cols=5))) for _ in range(2)]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.wait_for(asyncio.gather(first, *narrow, *wide), 10)
        assert rec.calls == [1, 4, 2]  # three narrow ones padded to 4 rows
        assert all(o["y"].shape == (1, 5) for o in out[4:])
    finally:
        gate.set()
        b.close()


async def test_preferred_size_trims_batch_and_requeues_the_rest():
    gate = threading.Event()
    rec = Recorder(gate)
    cfg = BatcherConfig(max_batch_size=16, max_queue_delay_us=0, preferred_batch_sizes=(4,))
    b = Batcher(rec, cfg).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        rest = [asyncio.ensure_future(b.submit(feeds(1, float(i)))) for i in range(6)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), 10)
        assert rec.calls == [1, 4, 2]
    finally:
        gate.set()
        b.close()


async def test_queue_delay_collects_concurrent_arrivals():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_us=5_000_000)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        pair = [asyncio.ensure_future(b.submit(feeds(1, 1.0))) for _ in range(2)]
        await asyncio.sleep(0.02)
        gate.set()  # the worker takes the pair: concurrent traffic, so it waits for more...
        await asyncio.sleep(0.05)
        later = [asyncio.ensure_future(b.submit(feeds(1, 1.0))) for _ in range(6)]  # ...and these fill it
        await asyncio.wait_for(asyncio.gather(first, *pair, *later), 10)
        assert rec.calls == [1, 8]  # without the queue delay: [1, 2, 6]
    finally:
        gate.set()
        b.close()


async def test_full_queue_raises_queue_full_instead_of_buffering():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=1, max_queue_size=2)).start()
    try:
        running = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        queued = [asyncio.ensure_future(b.submit(feeds(1, 1.0))) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="queue is full"):
            await b.submit(feeds(1, 2.0))
        gate.set()
        await asyncio.wait_for(asyncio.gather(running, *queued), 10)
    finally:
        gate.set()
        b.close()


@pytest.mark.parametrize("fails", ["starting", "running"])
async def test_compute_error_fails_only_its_batch(fails: str):
    calls = []

    def run(f):
        calls.append(f["x"].shape[0])
        if np.any(f["x"] < 0):
            raise ArithmeticError("negative input")
        return {"y": f["x"] + 1}

    def start(f):
        """The error raised by compute itself, or carried by the run's Future."""
        if fails == "starting":
            done: Future = Future()
            done.set_result(run(f))
            return done
        return POOL.submit(run, f)

    b = Batcher(start, BatcherConfig(max_batch_size=8, max_queue_delay_us=0)).start()
    try:
        with pytest.raises(BatchComputeError, match="negative input") as info:
            await b.submit(feeds(1, -1.0))
        assert isinstance(info.value.__cause__, ArithmeticError)
        out = await asyncio.wait_for(b.submit(feeds(2, 1.0)), 5)  # batching survived
        np.testing.assert_array_equal(out["y"], np.full((2, 3), 2.0, np.float32))
    finally:
        b.close()


async def test_output_without_batch_dim_fails_merged_batch_clearly():
    gate = threading.Event()
    entered = threading.Event()

    def compute(f):
        entered.set()
        gate.wait(10)
        return {"y": f["x"].sum(keepdims=True).reshape(1)}  # batch dim lost

    b = Batcher(started(compute), BatcherConfig(max_batch_size=8, max_queue_delay_us=0)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 1.0)))
        await asyncio.to_thread(entered.wait, 5)
        merged = [asyncio.ensure_future(b.submit(feeds(1, 1.0))) for _ in range(2)]
        await asyncio.sleep(0.02)
        gate.set()
        await first
        for f in merged:
            with pytest.raises(BatchComputeError, match="cannot split"):
                await f
    finally:
        gate.set()
        b.close()


async def test_deadline_expires_queued_request_without_computing_it():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=1)).start()
    try:
        running = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        with pytest.raises(DeadlineExceeded):
            await b.submit(feeds(1, 1.0), deadline=time.monotonic() + 0.05)
        gate.set()
        await running
        await asyncio.sleep(0.05)
        assert rec.calls == [1]  # the expired request was skipped
    finally:
        gate.set()
        b.close()


async def test_closed_batcher_refuses_and_drains():
    rec = Recorder()
    b = Batcher(rec, BatcherConfig()).start()
    await b.submit(feeds(1, 1.0))
    b.close()
    with pytest.raises(BatcherClosed):
        await b.submit(feeds(1, 1.0))


async def test_unbatchable_model_runs_requests_alone():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_us=0), batchable=False).start()
    try:
        futs = [asyncio.ensure_future(b.submit(feeds(1, 1.0))) for _ in range(3)]
        await asyncio.to_thread(rec.entered.wait, 5)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*futs), 10)
        assert rec.calls == [1, 1, 1]
    finally:
        gate.set()
        b.close()


async def test_runs_complete_from_their_futures_with_at_most_workers_in_flight():
    """compute only starts runs: requests resolve when a run's Future completes, and the next
    batch is formed only while fewer than `workers` runs are in flight, so requests that arrive
    meanwhile are merged into it."""
    by_hand = ByHand()
    b = Batcher(by_hand, BatcherConfig(max_batch_size=8, max_queue_delay_us=0, workers=2)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 1.0)))
        await by_hand.wait_started()
        second = asyncio.ensure_future(b.submit(feeds(1, 2.0)))
        await by_hand.wait_started()  # two runs in flight at once, no thread waiting on either
        rest = [asyncio.ensure_future(b.submit(feeds(1, 3.0 + i))) for i in range(3)]
        await asyncio.sleep(0.05)
        assert len(by_hand.runs) == 2 and b.queued == 3, "no third run while both slots are taken"
        by_hand.finish(1)
        out = await asyncio.wait_for(second, 5)
        np.testing.assert_array_equal(out["y"], np.full((1, 3), 4.0, np.float32))
        assert not first.done()
        await by_hand.wait_started()
        assert by_hand.runs[2][0]["x"].shape[0] == 4  # the three waiting requests, merged, padded to 4
        by_hand.finish(2)
        by_hand.finish(0)
        results = await asyncio.wait_for(asyncio.gather(first, *rest), 5)
        assert [float(r["y"][0, 0]) for r in results] == [2.0, 6.0, 8.0, 10.0]
    finally:
        by_hand.abandon()
        b.close()


async def test_observer_gets_each_batch_with_the_time_until_its_run_completed():
    seen = []

    class Observer:
        def on_batch(self, rows, requests, queue_seconds, compute_seconds):
            seen.append((rows, requests, len(queue_seconds), compute_seconds))

    by_hand = ByHand()
    b = Batcher(by_hand, BatcherConfig(max_batch_size=8, max_queue_delay_us=0), observer=Observer()).start()
    try:
        request = asyncio.ensure_future(b.submit(feeds(2, 1.0)))
        await by_hand.wait_started()
        await asyncio.sleep(0.05)
        assert seen == []
        by_hand.finish(0)
        await asyncio.wait_for(request, 5)
        [(rows, requests, waits, compute_seconds)] = seen
        assert (rows, requests, waits) == (2, 1, 1) and compute_seconds >= 0.05
    finally:
        by_hand.abandon()
        b.close()


async def test_close_still_runs_what_was_queued():
    by_hand = ByHand()
    b = Batcher(by_hand, BatcherConfig(max_batch_size=8, max_queue_delay_us=0)).start()
    try:
        requests = [asyncio.ensure_future(b.submit(feeds(1, 1.0)))]
        await by_hand.wait_started()
        requests += [asyncio.ensure_future(b.submit(feeds(1, 2.0))) for _ in range(2)]
        await asyncio.sleep(0.02)
        b.close(timeout=0)  # refuses new requests at once; what is queued still runs
        by_hand.finish(0)
        await by_hand.wait_started()
        by_hand.finish(1)
        results = await asyncio.wait_for(asyncio.gather(*requests), 5)
        assert [r["y"].shape[0] for r in results] == [1, 1, 1] and len(by_hand.runs) == 2
    finally:
        by_hand.abandon()
        b.close()


async def test_close_returns_only_when_every_run_in_flight_has_completed():
    by_hand = ByHand()
    b = Batcher(by_hand, BatcherConfig(max_batch_size=8, max_queue_delay_us=0, workers=2)).start()
    closing = None
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 1.0)))
        await by_hand.wait_started()
        second = asyncio.ensure_future(b.submit(feeds(2, 2.0)))
        await by_hand.wait_started()
        closing = asyncio.ensure_future(asyncio.to_thread(b.close))
        await asyncio.sleep(0.05)
        assert not closing.done(), "close returned while two runs were in flight"
        by_hand.finish(0)
        await asyncio.sleep(0.05)
        assert not closing.done(), "close returned while a run was in flight"
        by_hand.finish(1)
        await asyncio.wait_for(closing, 10)
        results = await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert [r["y"].shape[0] for r in results] == [1, 2]
    finally:
        by_hand.abandon()
        if closing is not None:
            await asyncio.wait_for(closing, 10)


def test_batch_key_requires_agreeing_batch_dims():
    assert batch_key({"a": np.zeros((2, 3)), "b": np.zeros((2,), np.int32)})[0] == 2
    assert batch_key({"a": np.zeros((2, 3)), "b": np.zeros((3,))}) is None
    assert batch_key({"a": np.zeros(())}) is None
    assert batch_key({"a": np.zeros((1, 3))}) != batch_key({"a": np.zeros((1, 4))})
    assert batch_key({"a": np.zeros((1, 3), np.float32)}) != batch_key({"a": np.zeros((1, 3), np.float64)})


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_batch_size"):
        BatcherConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="preferred"):
        BatcherConfig(max_batch_size=4, preferred_batch_sizes=(8,))


def test_plan_sizes_are_powers_of_two_preferred_sizes_and_the_maximum():
    assert plan_sizes(BatcherConfig(max_batch_size=24, preferred_batch_sizes=(6,))) == (1, 2, 4, 6, 8, 16, 24)
    assert plan_sizes(BatcherConfig(max_batch_size=1)) == (1,)


async def test_a_merged_batch_is_padded_to_a_planned_size_and_its_padding_dropped():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=8)).start()
    try:
        first = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        rest = [asyncio.ensure_future(b.submit(feeds(1, float(i)))) for i in range(1, 6)]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
        assert rec.calls == [1, 8], "five rows run as a planned batch of eight"
        for i, o in enumerate(out):
            np.testing.assert_array_equal(o["y"], np.full((1, 3), 2.0 * i, np.float32))
    finally:
        gate.set()
        b.close()


def inline_batcher(monkeypatch, rec: Recorder) -> tuple[Batcher, list[str]]:
    """A batcher over `rec` that may run a lone request inline, and the threads its inline runs ran
    on. "Fast" by a bound these tests' runs meet even beside a busy suite (a pool hand-off can take
    over a millisecond on two loaded cores)."""
    monkeypatch.setattr(batcher_module, "INLINE_MAX_SECONDS", 1.0)
    threads: list[str] = []

    def run_now(f):
        threads.append(threading.current_thread().name)
        return rec.run(f)

    return Batcher(rec, BatcherConfig(max_batch_size=8), run_now=run_now).start(), threads


async def test_a_lone_request_on_a_fast_model_runs_on_the_callers_thread_and_a_crowd_does_not(monkeypatch):
    b, threads = inline_batcher(monkeypatch, Recorder())
    try:
        await b.submit(feeds(1, 1.0))  # the first run is timed on the pool: no measure yet to go by
        assert threads == []
        out = await b.submit(feeds(1, 3.0))
        np.testing.assert_array_equal(out["y"], np.full((1, 3), 6.0, np.float32))
        assert threads == [threading.current_thread().name], "alone and fast: run inline"
        crowd = await asyncio.gather(*(b.submit(feeds(1, float(i))) for i in range(5)))
        assert len(threads) == 1, "requests that reached the batcher together go through the pool"
        assert [float(o["y"][0, 0]) for o in crowd] == [0.0, 2.0, 4.0, 6.0, 8.0]
    finally:
        b.close()


async def test_one_stalled_run_keeps_a_fast_models_lone_requests_inline(monkeypatch):
    """A run the machine stalled (here one inline run takes five times the inline bound) does not
    send the next lone requests through the pool: the average it moves is of capped samples."""
    b, threads = inline_batcher(monkeypatch, Recorder())
    monkeypatch.setattr(batcher_module, "INLINE_MAX_SECONDS", 0.1)
    stall = threading.Event()
    run_now = b._run_now

    def stalled_once(f):
        if stall.is_set():
            stall.clear()
            time.sleep(0.5)
        return run_now(f)

    b._run_now = stalled_once
    try:
        await b.submit(feeds(1, 1.0))  # on the pool: the first measure
        await b.submit(feeds(1, 1.0))
        assert len(threads) == 1, "alone and fast: run inline"
        stall.set()
        await b.submit(feeds(1, 1.0))
        assert len(threads) == 2, "the stalled run was inline too"
        out = await b.submit(feeds(1, 5.0))
        np.testing.assert_array_equal(out["y"], np.full((1, 3), 10.0, np.float32))
        assert threads == [threading.current_thread().name] * 3, "after one stall: still inline"
    finally:
        b.close()


async def test_an_answer_leaves_after_its_run_has_freed_the_engine(monkeypatch):
    """A client that sends its next request on an answer finds the engine idle and the run measured:
    the run thread frees its slot before it hands the answer to the loop, however late it gets to
    anything after that (here it sleeps once the answer is handed over)."""
    resolve = batcher_module._resolve

    def resolve_then_stall(*args):
        resolve(*args)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)

    monkeypatch.setattr(batcher_module, "_resolve", resolve_then_stall)
    gate = threading.Event()  # the first run ends after the batcher waits on it: its end is the pool's
    threading.Timer(0.05, gate.set).start()
    b, threads = inline_batcher(monkeypatch, Recorder(gate))
    try:
        await b.submit(feeds(1, 1.0))  # on the pool, which then stalls after handing the answer over
        out = await asyncio.wait_for(b.submit(feeds(1, 2.0)), 5)
        np.testing.assert_array_equal(out["y"], np.full((1, 3), 4.0, np.float32))
        assert threads == [threading.current_thread().name], "the engine was free and measured: run inline"
    finally:
        b.close()


class Timed(Recorder):
    """A Recorder whose run takes the time `seconds` gives for its (padded) size."""

    def __init__(self, seconds: dict[int, float], gate: threading.Event) -> None:
        super().__init__(gate)
        self.seconds = seconds

    def run(self, feeds):
        time.sleep(self.seconds.get(feeds["x"].shape[0], 0.0))
        return super().run(feeds)


async def queued_batches(seconds_by_size: dict[int, float], singles: int, max_batch_size: int = 16) -> list[int]:
    """The runs a burst of one-row requests, queued behind a first run, gets from a batcher that
    has run each size of `seconds_by_size` once (a request of that many rows), taking that long."""
    gate = threading.Event()
    gate.set()
    rec = Timed(seconds_by_size, gate)
    b = Batcher(rec, BatcherConfig(max_batch_size=max_batch_size, max_queue_delay_us=0)).start()
    try:
        for size in seconds_by_size:
            await b.submit(feeds(size, 0.0))
        rec.calls.clear()
        rec.entered.clear()
        gate.clear()
        first = asyncio.ensure_future(b.submit(feeds(1, 0.0)))
        await asyncio.to_thread(rec.entered.wait, 5)
        rest = [asyncio.ensure_future(b.submit(feeds(1, float(i)))) for i in range(1, singles + 1)]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
        for i, o in enumerate(out):
            np.testing.assert_array_equal(o["y"], np.full((1, 3), 2.0 * i, np.float32))
        return rec.calls
    finally:
        gate.set()
        b.close()


SIZES = plan_sizes(BatcherConfig(max_batch_size=16))  # 1, 2, 4, 8, 16


@pytest.mark.parametrize("rows,seconds,now", [
    # a CPU engine: a run's time grows with its rows, so padding 9 rows to 16 costs 7 rows' work
    ([1] * 9, {8: 0.008, 16: 0.016}, 8),
    # one cut, one size down: 12 rows run as 8 (and 4 next), not as many small runs
    ([1] * 12, {1: 0.0001, 2: 0.0002, 4: 0.004, 8: 0.008, 16: 0.016}, 8),
    # requests of several rows: the longest prefix that fits 8 rows
    ([4, 4, 3, 3], {8: 0.008, 16: 0.016}, 2),
    # ...but not where the prefix runs padded itself and saves nothing per row
    ([3, 3, 3, 3], {8: 0.008, 16: 0.016}, 4),
    # an engine whose run barely grows with the batch: padding is cheaper than a second run
    ([1] * 9, {8: 0.010, 16: 0.010}, 9),
    # rows that are a planned size are never cut, whatever the timings say
    ([1] * 8, {4: 0.001, 8: 0.030}, 8),
    # while a size it could run at is untimed, the batch runs padded as before
    ([1] * 9, {8: 0.008}, 9),
    # a model of microseconds a row: the padding costs less than another run costs the server
    ([1] * 9, {8: 0.00016, 16: 0.00032}, 9),
    # a first request larger than the size below: nothing to cut
    ([9, 1], {8: 0.008, 16: 0.016}, 2),
])
def test_a_batch_that_would_run_padded_is_cut_where_its_rows_cost_least(rows, seconds, now):
    assert cut_at(rows, seconds, SIZES) == now


async def test_the_batcher_cuts_by_the_run_times_it_measured():
    """The sizes' times come from the batcher's own runs (a request of 8 rows, one of 16)."""
    assert await queued_batches({8: 0.04, 16: 0.08}, 9) == [1, 8, 1]
