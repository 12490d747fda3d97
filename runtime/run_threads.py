"""The threads whole runs execute on when started asynchronously (Model.predict_async).

An OpenMP team belongs to the thread that starts it: libgomp keeps a pool of workers per calling
thread, for as long as that thread lives. Runs handed to a pool whose idle threads take turns (a
ThreadPoolExecutor's idle workers queue on one lock, first come first served) start teams from
every thread in it, and once libgomp manages more threads than the process has CPUs it stops
letting idle workers spin: every barrier of every team then sleeps and wakes (omp.release_team).

So a call goes to the thread that went idle last, and a new thread starts only while every one is
busy: runs one at a time stay on one thread and one team; runs in flight together each get one.
"""
from __future__ import annotations

import atexit
import collections
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class RunThreads:
    """An executor of at most `max_threads` threads that hands each call to the most recently idle one."""

    def __init__(self, max_threads: int, name: str = "kubetrt-run") -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads {max_threads}: expected >= 1")
        self.max_threads = max_threads
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # a stack: the last to go idle is taken first
        self._backlog: collections.deque[_Work] = collections.deque()  # calls waiting while every thread is busy
        self._threads: list[_Worker] = []
        self._closed = False

    @property
    def threads(self) -> int:
        """How many threads have started so far."""
        return len(self._threads)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        work: _Work = (future, fn, args)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after shutdown")
            if self._idle:
                self._idle.pop().give(work)
            elif len(self._threads) < self.max_threads:
                worker = _Worker(self, f"{self.name}-{len(self._threads)}")
                self._threads.append(worker)
                worker.give(work)
                worker.start()
            else:
                self._backlog.append(work)
        return future

    def _next(self, worker: "_Worker") -> _Work | None:
        """The finished worker's next call from the backlog, or None having put it on the idle stack."""
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            if not self._closed:
                self._idle.append(worker)
            return None

    def shutdown(self) -> None:
        """Finish what was submitted, then stop every thread."""
        with self._lock:
            self._closed = True
            self._idle = []
        for worker in self._threads:
            worker.stop()
        for worker in self._threads:
            worker.join()


class _Worker(threading.Thread):
    def __init__(self, pool: RunThreads, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._pool = pool
        self._ready = threading.Semaphore(0)
        self._work: _Work | None = None

    def give(self, work: _Work) -> None:
        self._work = work
        self._ready.release()

    def stop(self) -> None:
        """A wake-up with no work: the thread ends once its work (given or from the backlog) is done."""
        self._ready.release()

    def run(self) -> None:
        work: _Work | None = None
        while True:
            if work is None:
                self._ready.acquire()
                work, self._work = self._work, None
                if work is None:
                    return
            future, fn, args = work
            if not future.set_running_or_notify_cancel():
                work = self._pool._next(self)
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - the caller's Future carries it
                result, error = None, e
            # idle (or on to the backlog) before the caller hears: a caller that submits again from
            # the Future's callback finds this thread free, not a reason to start another
            work = self._pool._next(self)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


_RUNS: RunThreads | None = None
_RUNS_LOCK = threading.Lock()


def run_threads() -> RunThreads:
    """The process's threads for whole runs, as many as the CPUs the runtime uses: more runs in
    flight than cores only take turns."""
    global _RUNS
    if _RUNS is not None:  # every run asks: no lock once made
        return _RUNS
    with _RUNS_LOCK:
        if _RUNS is None:
            from .kernels.parallel import THREADS

            _RUNS = RunThreads(THREADS)
            atexit.register(_RUNS.shutdown)
        return _RUNS
