"""Dynamic batcher unit tests with plain NumPy compute functions (no server, no model)."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kubetrt.runtime.batcher import (
    BatchComputeError,
    Batcher,
    BatcherClosed,
    BatcherConfig,
    DeadlineExceeded,
    QueueFull,
    batch_key,
)


class Recorder:
    """compute = y = 2x (+ rows of `z` summed), recording the batch sizes it was called with."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[int] = []
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, feeds):
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
        assert rec.calls[1] == sum(1 + i % 3 for i in range(20))
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
        assert rec.calls == [1, 3, 2]
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


async def test_compute_error_fails_only_its_batch():
    calls = []

    def compute(f):
        calls.append(f["x"].shape[0])
        if np.any(f["x"] < 0):
            raise ArithmeticError("negative input")
        return {"y": f["x"] + 1}

    b = Batcher(compute, BatcherConfig(max_batch_size=8, max_queue_delay_us=0)).start()
    try:
        with pytest.raises(BatchComputeError, match="negative input") as info:
            await b.submit(feeds(1, -1.0))
        assert isinstance(info.value.__cause__, ArithmeticError)
        out = await asyncio.wait_for(b.submit(feeds(2, 1.0)), 5)  # the worker survived
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

    b = Batcher(compute, BatcherConfig(max_batch_size=8, max_queue_delay_us=0)).start()
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
