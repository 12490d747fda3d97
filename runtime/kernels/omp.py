"""The OpenMP team the host kernels run on: oneDNN's primitives and the runtime's own jitted GEMM.

Both run on GNU OpenMP (libgomp): one copy per process (same soname, same handle), so oneDNN's
calls and ours hand work to the same worker threads and never fight a second pool. Which team
size a call gets is decided here too (TeamChoice), for both.

GNU OpenMP's idle workers spin 300000 rounds (milliseconds) after each call by default; in a
server that is CPU taken from the event loop. 10000 still covers the gap between one layer's
call and the next (same-process ResNet50/small CNN latency unchanged); libgomp reads it once,
when it loads below, and only where the operator has not set it. OMP_NUM_THREADS caps the team.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Callable

from .native import load_first

TEAMS_ENV = "KUBETRT_ONEDNN_TEAMS"


def _load() -> ctypes.CDLL | None:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return load_first(("libgomp.so.1",))


def _address(lib: ctypes.CDLL | None, name: str) -> int:
    return 0 if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


_gomp = _load()
AVAILABLE = _gomp is not None
if _gomp is not None:
    _gomp.omp_set_num_threads.argtypes, _gomp.omp_set_num_threads.restype = [ctypes.c_int], None
TEAM = int(_gomp.omp_get_max_threads()) if _gomp is not None else 1  # the default team size
# Entry points jitted code calls by address (jit.c_call*): start a team on fn(data), wait for the
# whole team, and a member's place in it.
PARALLEL = _address(_gomp, "GOMP_parallel")
BARRIER = _address(_gomp, "GOMP_barrier")
THREAD_NUM = _address(_gomp, "omp_get_thread_num")
NUM_THREADS = _address(_gomp, "omp_get_num_threads")


def adaptive_teams(env: Any) -> bool:
    """Whether calls may run on a team of one when that is faster (TeamChoice): `adaptive`
    (the default), or `static` to always run the OpenMP team."""
    value = env.get(TEAMS_ENV, "adaptive").strip().lower() or "adaptive"
    if value not in ("static", "adaptive"):
        raise ValueError(f"{TEAMS_ENV}={value!r}: expected 'adaptive' or 'static'")
    return value == "adaptive"


class TeamChoice:
    """Per kernel and input shape: run the OpenMP team or a team of one, whichever has been faster lately.

    A team splits a call's work statically: when a neighbour (another process on the node, another
    runtime's pool in this process) holds one of the cores, every call waits for the thread it
    descheduled and takes several times longer, where one thread alone loses only the second
    core. Neither choice is right everywhere, so both are timed: each call runs the variant whose
    recent time (a faster call counts at once, a slower one by ALPHA) is lower (one thread by
    MARGIN), and every EXPLORE-th call the other one, so a neighbour that comes or goes is noticed
    within a few hundred calls.
    """

    ALPHA, EXPLORE, WARM = 0.25, 256, 4
    # One thread must beat the team by far: uncontended a team of two takes 0.5-0.6x one thread's
    # time, a stalled one 2-4x. A choice made on noise costs more than its own call: a call run
    # alone lets the team's other thread fall asleep, and the next team call waits for it to wake.
    MARGIN = 0.6
    MIN_TEAM_SECONDS = 100e-6  # shorter calls keep the team: their timings are mostly noise
    CAPABLE = AVAILABLE and TEAM > 1
    ENABLED = CAPABLE and adaptive_teams(os.environ)

    __slots__ = ("mean", "calls")

    def __init__(self) -> None:
        self.mean: list[float | None] = [None, None]  # seconds: [team, one thread]
        self.calls = 0

    def pick(self) -> bool:
        """Whether this call runs single-threaded."""
        self.calls += 1
        team, alone = self.mean
        if not self.ENABLED or team is None or self.calls < self.WARM or team < self.MIN_TEAM_SECONDS:
            return False
        if alone is None:
            return True
        faster = alone < self.MARGIN * team
        return not faster if self.calls % self.EXPLORE == 0 else faster

    def record(self, serial: bool, seconds: float) -> None:
        if self.calls <= self.WARM:  # first calls pay one-time costs (compiling, loading, first touch)
            return
        m = self.mean[serial]
        # a faster call counts at once, a slower one by ALPHA: one stall (a descheduled thread, a
        # page fault) must not hold the other variant for thousands of calls, as an average would
        self.mean[serial] = seconds if m is None or seconds < m else m + self.ALPHA * (seconds - m)


def choice_for(choices: dict[Any, TeamChoice], key: Any) -> TeamChoice:
    """A kernel's TeamChoice for one input shape (`key`), made on that shape's first call."""
    return choices.get(key) or choices.setdefault(key, TeamChoice())


def timed(choice: TeamChoice, run: Callable[[int], object]) -> None:
    """run(team size) on the team `choice` picks (a jitted kernel that starts its own team), timed for it."""
    serial = choice.pick()
    start = time.perf_counter()
    run(1 if serial else TEAM)
    choice.record(serial, time.perf_counter() - start)


class TeamOf:
    """OpenMP team size for this thread's calls inside the block (a oneDNN primitive must run
    with the team it was made for)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __enter__(self) -> None:
        if _gomp is not None and self.threads != TEAM:
            _gomp.omp_set_num_threads(self.threads)

    def __exit__(self, *_: Any) -> None:
        if _gomp is not None and self.threads != TEAM:
            _gomp.omp_set_num_threads(TEAM)
