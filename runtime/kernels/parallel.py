"""Matrix products split across the runtime's own thread pool, BLAS kept single-threaded.

Why not let OpenBLAS thread? Its workers spin-wait on a barrier; on a 2-core node that also runs
the server, the batcher or a neighbour, one descheduled worker stalls every GEMM, and pointwise
convolutions slow down by an order of magnitude under load. Our pool's idle threads block instead of spin,
and independent kernels of the dataflow executor share the same workers rather than fighting a
second pool. NumPy releases the GIL inside BLAS, so the halves run truly in parallel.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from . import blas

def threads_from_env(name: str) -> int:
    """A thread count from `name` (the operator sets it from the pod's CPU limit), else the CPUs
    this process may run on; a bad value is an error naming the variable, not a silent default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}={text!r}: expected a positive number of threads")
    return n


THREADS = threads_from_env("KUBETRT_THREADS")
MIN_FLOPS_PER_THREAD = 8_000_000  # below this a thread hop costs more than the GEMM slice it moves
_limited = False


def single_threaded_blas() -> None:
    """Pin BLAS to one thread, once per process (the runtime parallelizes above BLAS)."""
    global _limited
    if _limited:
        return
    _limited = True
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is a base dependency
        pass


class _Stream(threading.local):
    alone = False  # a class default: reading it never raises (an attribute missing per thread costs an exception)


STREAM = _Stream()  # .alone: this thread is one stream of several (omp.Alone sets it)


def alone() -> bool:
    """Whether this thread runs its kernels by itself: it is one of several streams at work, each on its own core."""
    return STREAM.alone


_POOL: ThreadPoolExecutor | None = None


def shared_pool() -> ThreadPoolExecutor:
    """One pool per process, as wide as the CPU the process may use (KUBETRT_THREADS, which the
    operator fills from the pod's CPU limit): kernels and BLAS already use the cores; more threads
    only thrash the CFS quota. Whole inferences and GEMM slices share it."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="kubetrt")
    return _POOL


def parts_for(flops: int, extent: int) -> int:
    """How many threads a job of `flops` over `extent` independent slices is worth (one in a stream:
    the other cores run the other streams)."""
    if alone():
        return 1
    return max(1, min(THREADS, extent, flops // MIN_FLOPS_PER_THREAD))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with NumPy broadcasting semantics for a (M,K) weight and b (K,P) or (N,K,P) stack,
    or an (M,K) activation times a (K,P) weight; split along the largest independent axis."""
    if a.ndim == 2 and b.ndim == 2:
        return _matmul_2d(a, b)
    if a.ndim == 2 and b.ndim == 3:  # conv: W (O,K) @ cols (N,K,P) -> (N,O,P)
        n, k, p = b.shape
        o = a.shape[0]
        out = np.empty((n, o, p), dtype=np.result_type(a, b))
        flops = 2 * n * o * k * p
        if n >= THREADS and parts_for(flops, n) > 1:
            _split(lambda lo, hi: np.matmul(a, b[lo:hi], out=out[lo:hi]), n, parts_for(flops, n))
        else:
            axis_len = o if o >= p else p
            parts = parts_for(flops, axis_len)
            if parts == 1:
                np.matmul(a, b, out=out)
            elif o >= p:
                _split(lambda lo, hi: np.matmul(a[lo:hi], b, out=out[:, lo:hi]), o, parts)
            else:
                _split(lambda lo, hi: np.matmul(a, b[:, :, lo:hi], out=out[:, :, lo:hi]), p, parts)
        return out
    return np.matmul(a, b)


def _matmul_2d(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    m, k = a.shape
    p = b.shape[1]
    out = np.empty((m, p), dtype=np.result_type(a, b))
    flops = 2 * m * k * p
    if m >= p:
        parts = parts_for(flops, m)
        if parts == 1:
            return blas.gemm(a, b, out)
        _split(lambda lo, hi: blas.gemm(a[lo:hi], b, out[lo:hi]), m, parts)
    else:
        parts = parts_for(flops, p)
        if parts == 1:
            return blas.gemm(a, b, out)
        _split(lambda lo, hi: blas.gemm(a, b[:, lo:hi], out[:, lo:hi]), p, parts)
    return out


def _split(work: Callable[[int, int], object], extent: int, parts: int) -> None:
    """Run work(lo, hi) over `parts` slices of [0, extent): one here, the rest on the pool.

    The caller may itself be a pool thread (a whole inference runs on the pool), so it must never
    block on a task queued behind itself: a slice nobody has started yet is taken back and run
    inline. Slices are leaf tasks, so this always makes progress.
    """
    bounds = [extent * i // parts for i in range(parts + 1)]
    futures: list[Future] = [shared_pool().submit(work, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    try:
        work(bounds[0], bounds[1])
    finally:
        for f, lo, hi in zip(futures, bounds[1:-1], bounds[2:]):
            if f.cancel():
                work(lo, hi)
            else:
                f.result()


def split_range(work: Callable[[int, int], object], extent: int, parts: int) -> None:
    """Public form of the slice runner for other kernels (e.g. the JIT depthwise convolution)."""
    _split(work, extent, max(1, min(parts, extent)))
