"""The OpenMP team the host kernels run on: oneDNN's primitives and the runtime's own jitted GEMM.

Both run on GNU OpenMP (libgomp): one copy per process (same soname, same handle), so oneDNN's
calls and ours hand work to the same worker threads and never fight a second pool. Which team
size a call gets is decided here too (TeamChoice), for both.

GNU OpenMP's idle workers spin 300000 rounds (milliseconds) after each call by default; in a
server that is CPU taken from the event loop. 10000 still covers the gap between one layer's
call and the next (same-process ResNet50/small CNN latency unchanged); libgomp reads it once,
when it loads below, and only where the operator has not set it. OMP_NUM_THREADS caps the team.

Where its workers run is the scheduler's choice, and it can choose badly: beside a busy core it
wakes a sleeping worker on the caller's own CPU, where the two take turns and a team call takes
longer than one thread would. So the runtime's own team kernels check where their members are on
every call, and teams that only oneDNN starts every few calls and whenever the caller has moved to
another CPU: a member on the caller's CPU moves off it (apart). The caller itself is never moved.
One slot holds the caller's CPU for the process: with several calling threads, members keep off
whichever called last. KUBETRT_TEAM_PLACEMENT=free leaves them be.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from . import jit
from .native import load_first
from .parallel import STREAM

TEAMS_ENV = "KUBETRT_ONEDNN_TEAMS"
PLACEMENT_ENV = "KUBETRT_TEAM_PLACEMENT"
SPIN_ENV, SPIN_ROUNDS = "GOMP_SPINCOUNT", 10000  # idle workers' spin before they sleep, where the operator sets none


def _load() -> ctypes.CDLL | None:
    os.environ.setdefault(SPIN_ENV, str(SPIN_ROUNDS))
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
# OpenMP 5.0's omp_pause_resource_all: in libgomp it frees the calling thread's pool of workers
_pause_all = getattr(_gomp, "omp_pause_resource_all", None) if _gomp is not None else None
_PAUSE_SOFT = 1  # omp_pause_soft
if _pause_all is not None:
    _pause_all.argtypes, _pause_all.restype = [ctypes.c_int], ctypes.c_int
TEAM = int(_gomp.omp_get_max_threads()) if _gomp is not None else 1  # the default team size
# Entry points jitted code calls by address (jit.c_call*): start a team on fn(data), wait for the
# whole team, and a member's place in it.
PARALLEL = _address(_gomp, "GOMP_parallel")
BARRIER = _address(_gomp, "GOMP_barrier")
THREAD_NUM = _address(_gomp, "omp_get_thread_num")
NUM_THREADS = _address(_gomp, "omp_get_num_threads")


# The placement block the members read: sched_getcpu, sched_setaffinity, omp_get_thread_num, the
# caller's CPU at its last check, the address of the masks (row c: every allowed CPU but c), a
# mask's bytes, the number of rows.
_GETCPU, _SETAFFINITY, _ME, _CALLER_CPU, _MASKS, _MASK_BYTES, _ROWS = range(7)


def _switch(env: Any, name: str, default: str, other: str) -> bool:
    """Whether the two-word setting `name` is `default` (where unset) rather than `other`."""
    value = env.get(name, default).strip().lower() or default
    if value not in (default, other):
        raise ValueError(f"{name}={value!r}: expected '{default}' or '{other}'")
    return value == default


def apart_placement(env: Any) -> bool:
    """Whether team members move off the calling thread's CPU: `apart` (the default) or `free`."""
    return _switch(env, PLACEMENT_ENV, "apart", "free")


def _placement(allowed: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """The placement block and the masks it points to, for a process allowed on `allowed` CPUs."""
    rows = max(allowed) + 1 if allowed else 0
    words = max(1, (rows + 63) // 64)
    bits = np.zeros(words * 64, bool)
    bits[sorted(allowed)] = True
    masks = np.tile(bits, (max(rows, 1), 1))
    masks[np.arange(rows), np.arange(rows)] = False  # row c: every allowed CPU but c
    # a cpu_set_t per row: bit c % 64 of native word c // 64
    masks = np.packbits(masks, axis=1, bitorder="little").view("<u8").astype(np.uint64)
    libc = ctypes.CDLL(None)
    block = np.array([_address(libc, "sched_getcpu"), _address(libc, "sched_setaffinity"), THREAD_NUM, -1,
                      masks.ctypes.data, words * 8, rows], np.int64)
    return block, masks


_ALLOWED = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
PLACEMENT, _MASK_TABLE = _placement(_ALLOWED)  # the table stays alive beside the block that points to it
KEEP_APART = (jit.AVAILABLE and PARALLEL != 0 and TEAM > 1 and len(_ALLOWED) > 1
              and bool(PLACEMENT[_GETCPU] and PLACEMENT[_SETAFFINITY]) and apart_placement(os.environ))

PLACE = int(PLACEMENT.ctypes.data) if KEEP_APART else 0  # what a kernel's block hands apart(): 0 leaves members be

if jit.numba is not None:
    from numba import carray

    @jit.njit(cache=True, nogil=True, inline="always")
    def apart(place_at, me):
        """In a team member: the caller (member 0) notes its CPU, another member on it moves off it.
        A member may read the caller's CPU as of its last team call: it moves one call later."""
        if place_at == 0:
            return
        place = carray(jit.int64s_at(place_at), (_ROWS + 1,))
        cpu = np.int64(jit.c_call0(place[_GETCPU]))
        if me == 0:
            place[_CALLER_CPU] = cpu
        elif cpu == place[_CALLER_CPU] and 0 <= cpu < place[_ROWS]:
            jit.c_call4(place[_SETAFFINITY], np.int64(0), place[_MASK_BYTES], place[_MASKS] + cpu * place[_MASK_BYTES], np.int64(0))

    def _apart_member(data):  # compiled into a C callable by jit.entry_address
        place = carray(jit.int64s_at(data), (_ROWS + 1,))
        apart(place.ctypes.data, np.int64(jit.c_call0(place[_ME])))

    @jit.njit(cache=True, nogil=True)
    def _check_apart(parallel, entry, place_at, threads):
        place = carray(jit.int64s_at(place_at), (_ROWS + 1,))
        place[_CALLER_CPU] = jit.c_call0(place[_GETCPU])  # before the team starts: no member reads an older one
        jit.c_call4(parallel, entry, place_at, threads, np.int64(0))


_sched_getcpu = ctypes.CFUNCTYPE(ctypes.c_int)(int(PLACEMENT[_GETCPU])) if KEEP_APART else None
_checked = threading.local()  # `cpu`: where this thread ran at its last placement check


def keep_apart() -> None:
    """A team call that does nothing but apart(): for teams that only oneDNN's primitives start."""
    if PLACE and _sched_getcpu is not None:
        _checked.cpu = _sched_getcpu()
        _check_apart(PARALLEL, jit.entry_address(_apart_member), PLACE, TEAM)


def caller_moved() -> bool:
    """Whether this thread now runs on another CPU than at its last placement check (or has had
    none). A caller that sleeps between calls (a server's run thread between requests) wakes on
    either CPU, and may wake on the one its member was moved to: until the next check the two take
    turns on it. Per thread, so that two threads calling at once do not take each other's checks
    for moves. One call into libc, yet not free: asked only before calls long enough to be timed."""
    return _sched_getcpu is not None and _sched_getcpu() != getattr(_checked, "cpu", -1)


def adaptive_teams(env: Any) -> bool:
    """Whether calls may run on a team of one when that is faster (TeamChoice): `adaptive`
    (the default), or `static` to always run the OpenMP team."""
    return _switch(env, TEAMS_ENV, "adaptive", "static")


def recent(seconds_so_far: float | None, seconds: float, alpha: float, rise: float) -> float:
    """A way's recent time after a call of `seconds`: a faster call counts at once, a slower one by
    `alpha`, and by `rise` times the time so far at most. One stall (a descheduled thread, a page
    fault) must not hold the other way for thousands of calls, as an average would."""
    m = seconds_so_far
    return seconds if m is None or seconds < m else m + alpha * min(seconds - m, rise * m)


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
    RISE = float("inf")  # the most one slower call raises a variant's time, as a share of it
    # One thread must beat the team clearly: uncontended a team of two takes 0.5-0.6x one thread's
    # time, a stalled one 1.5-4x. A choice made on noise costs more than its own call: a call run
    # alone lets the team's other thread fall asleep, and the next team call waits for it to wake.
    # A stricter margin kept some processes beside a busy core on a team stalling at 1.5x one thread.
    MARGIN = 0.8
    MIN_TEAM_SECONDS = 100e-6  # shorter calls keep the team: their timings are mostly noise
    APART_EVERY = 8  # team calls per placement check (keep_apart), besides one whenever the caller moved CPU
    SAMPLE = 8  # a short call on the team (MIN_TEAM_SECONDS) is timed once in this many
    CAPABLE = AVAILABLE and TEAM > 1
    ENABLED = CAPABLE and adaptive_teams(os.environ)

    __slots__ = ("mean", "calls", "keeps_apart", "skipped", "waking", "first_alone")

    def __init__(self, keeps_apart: bool = True) -> None:
        self.mean: list[float | None] = [None, None]  # seconds: [team, one thread]
        self.calls = 0
        # every APART_EVERY-th team call checks placement (keep_apart); kernels whose members call
        # apart() on every call pass False
        self.keeps_apart = keeps_apart
        self.skipped = 0  # short team calls run without the choice (untimed)
        self.waking = False  # this call's time says little: the team's members were asleep, or its one-thread primitives new
        self.first_alone = True

    def pick(self) -> bool:
        """Whether this call runs single-threaded."""
        if STREAM.alone:
            return True
        self.calls += 1
        team, alone = self.mean
        if not self.ENABLED or team is None or self.calls < self.WARM or team < self.MIN_TEAM_SECONDS:
            serial = False
        elif alone is None:  # two calls alone: the first makes the one-thread primitives (a chain its table)
            serial = True
            self.waking, self.first_alone = self.first_alone, False
        else:
            # exploring the team after calls alone takes two calls, and the first is not recorded:
            # it waits for members that fell asleep, which a short call's team time would never win back
            faster = self.alone_faster()
            phase = self.calls % self.EXPLORE
            serial = faster and phase > 1 or not faster and phase == 0
            self.waking = faster and phase == 0
        if not serial and self.keeps_apart and (self.calls % self.APART_EVERY == 0 or caller_moved()):
            keep_apart()
        return serial

    def alone_faster(self) -> bool:
        """Whether the way alone (one thread; a StreamChoice's streams) has lately been faster than
        the team by MARGIN: the way pick takes between explorations. False while either is untimed."""
        team, alone = self.mean
        return team is not None and alone is not None and alone < self.MARGIN * team

    def untimed(self) -> bool:
        """Whether this call runs on the team without pick and record: its team has been shorter
        than MIN_TEAM_SECONDS, where pick keeps it, and their bookkeeping costs as much as a short
        primitive. Every SAMPLE-th such call goes through them, so a team that grows long is noticed."""
        team = self.mean[0]
        if team is None or team >= self.MIN_TEAM_SECONDS or STREAM.alone:
            return False
        self.skipped += 1
        if self.skipped % self.SAMPLE == 0:
            return False
        if self.keeps_apart and self.skipped % self.APART_EVERY == self.APART_EVERY // 2:  # pick checks at the others
            keep_apart()
        return True

    def record(self, serial: bool, seconds: float) -> bool:
        """Count a call's time for its way; False where it says little and is not counted."""
        # first calls pay one-time costs (compiling, loading, first touch); a stream's calls share the cores
        if self.calls <= self.WARM or STREAM.alone:
            return False
        if self.waking:
            self.waking = False
            return False
        self._update(serial, seconds)
        return True

    def _update(self, serial: bool, seconds: float) -> None:
        self.mean[serial] = recent(self.mean[serial], seconds, self.ALPHA, self.RISE)


class SteadyChoice(TeamChoice):
    """A TeamChoice that judges each way by the median of its last SAMPLES timed calls: for calls
    whose team time is bimodal, as a chain in bands beside a busy core (fast in the slices where
    the caller happens to hold its core, slow in the rest), where counting a faster call at once
    would credit the team with its luckiest calls. One stall moves a median no more than one
    lucky call does.

    Its calls are long (a chain: a whole model's run, milliseconds), so exploring the team every
    EXPLORE-th call would come seconds apart, and a spell of stalls on a quiet machine (the host's,
    not a neighbour's) would hold the calls alone, at nearly twice the team's time, for seconds. So
    while alone it also explores after EXPLORE_SECONDS of calls alone, with up to TRIES recorded
    team calls (after the unrecorded one that wakes the team): enough to move the median back where
    the team is fast again, and cut short by a try that loses. Each exploration the team loses
    doubles the time until the next, up to MAX_EXPLORE_SECONDS, so that beside a real neighbour,
    where team calls stall, their cost fades; one the team wins starts the count over."""

    __slots__ = ("last", "alone_spent", "explore_after", "exploring")
    SAMPLES = 3
    EXPLORE_SECONDS, MAX_EXPLORE_SECONDS = 0.05, 2.0
    TRIES = 2  # a median of SAMPLES = 3 moves with two fresh times

    def __init__(self, keeps_apart: bool = True) -> None:
        super().__init__(keeps_apart)
        self.last: tuple[list[float], list[float]] = ([], [])
        self.alone_spent = 0.0  # seconds of calls alone since the team last ran
        self.explore_after = self.EXPLORE_SECONDS
        self.exploring = 0  # team calls still to run in this exploration

    def pick(self) -> bool:
        if self.exploring:
            self.exploring -= 1
            self.calls += 1
            return False
        serial = super().pick()
        if serial and self.alone_spent >= self.explore_after and not STREAM.alone:
            self.alone_spent = 0.0
            self.explore_after = min(2 * self.explore_after, self.MAX_EXPLORE_SECONDS)
            self.exploring, self.waking = self.TRIES, True
            return False
        return serial

    def _update(self, serial: bool, seconds: float) -> None:
        self.mean[serial] = steady(self.last[serial], seconds, self.SAMPLES)
        if serial:
            self.alone_spent += seconds
            return
        self.alone_spent = 0.0
        team, alone = self.mean
        if self.exploring and alone is not None and self.MARGIN * seconds > alone:
            self.exploring = 0  # this try lost to one thread already: the rest would stall alike
        if team is not None and (alone is None or alone >= self.MARGIN * team):  # the team is the way again
            self.explore_after = self.EXPLORE_SECONDS


def steady(last: list[float], seconds: float, samples: int) -> float:
    """The median of the last `samples` times, `seconds` the newest (kept in `last`): a way's
    usual time, which neither one stall nor one lucky call moves."""
    last.append(seconds)
    if len(last) > samples:
        del last[0]
    return sorted(last)[len(last) // 2]


def choice_for(choices: dict[Any, TeamChoice], key: Any, keeps_apart: bool = True) -> TeamChoice:
    """A kernel's TeamChoice for one input shape (`key`), made on that shape's first call."""
    return choices.get(key) or choices.setdefault(key, TeamChoice(keeps_apart))


def timed(choice: TeamChoice, run: Callable[[int], object]) -> None:
    """run(team size) on the team `choice` picks (a jitted kernel that starts its own team), timed for it."""
    if choice.untimed():
        run(TEAM)
        return
    serial = choice.pick()
    start = time.perf_counter()
    run(1 if serial else TEAM)
    choice.record(serial, time.perf_counter() - start)


def release_team() -> None:
    """Let this thread's OpenMP workers exit (they start again on its next team call).

    libgomp keeps a pool of workers per thread that starts a team, until that thread exits, and
    once it manages more threads than the process has CPUs its idle workers spin 100 rounds
    instead of GOMP_SPINCOUNT's: every barrier of every team sleeps and wakes. A thread done with
    the engine for good (a loader after its golden check) hands its workers back, so the threads
    that serve keep theirs spinning."""
    if _pause_all is not None:
        _pause_all(_PAUSE_SOFT)


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


class Alone(TeamOf):
    """Inside the block, this thread's kernels run on a team of one without timing the choice:
    a stream of a batch split across the cores (runtime/batch_streams.py), whose cores are the
    streams' own."""

    def __init__(self) -> None:
        super().__init__(1)

    def __enter__(self) -> None:
        STREAM.alone = True
        super().__enter__()

    def __exit__(self, *_: Any) -> None:
        STREAM.alone = False
        super().__exit__()
