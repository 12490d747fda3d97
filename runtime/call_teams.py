"""Whole calls on one thread while a neighbour holds one of the cores.

A team call waits for every member. Beside a busy core (another process on the node, another
runtime's pool in this process) the member there runs only in the scheduler's slices: the calls
made while it runs are as fast as ever, and one made between its slices waits for the next,
milliseconds. The kernels' own choices (omp.TeamChoice) do not see this where a kernel is shorter
than their timer's noise, and every kernel of a small model is, and they judge a way by its
typical time, which the stalls leave alone. So each input signature's calls run in windows, on the
team or alone, and a way is judged by its mean time per call, stalls included. Where one thread's
steady time beats the team's mean, the calls run alone (omp.Alone); the team is tried now and
then, and taken back once the neighbour is gone.
"""
from __future__ import annotations

import sys
from time import perf_counter
from typing import Any

import numpy as np

from .batch_streams import BatchStreams
from .executor import SequentialPlan
from .kernels import omp, parallel
from .specialize import ShapeSpecializedPlan

MAX_SIGNATURES = 16  # signatures timed per plan; later ones run on the team
WINDOW = 64  # calls run one way before the next window's way is chosen


class CallWay:
    """How one input signature's calls run: on the team or alone, for a window of WINDOW calls at a
    time. Each way's time is the mean time of its windows' calls, stalls included, averaged over
    windows by ALPHA; a window's first call is left out (after a switch it pays the other
    thread's wake-up or the other core's cache: the switch's cost, not the way's). At a window's
    end the next one's way is chosen: alone where one thread beats the team by MARGIN, and now and
    then the other way, so that both stay timed. Where the team's usual window (the median of its
    last few: its time without stalls that hit some windows) takes over LONG_CALL, or one thread
    takes GAIN times as long, the team keeps the calls for good."""

    # windows: the other way runs one window in this many; one thread rarely (the team leads by far
    # where no neighbour is, and small models pay for each window alone), the team more often (a
    # neighbour that left is noticed within seconds)
    EXPLORE_ALONE, EXPLORE_TEAM = 256, 32
    WARM = 2  # windows on the team before any choosing: first calls pay one-time costs
    MARGIN = omp.TeamChoice.MARGIN
    ALPHA = 0.25
    LOW_WINDOWS = 3  # the team's time without stalls: the median of its last this many windows
    # Calls longer than this keep the team for good: their kernels are long enough to choose for
    # themselves, and a window alone would cost seconds.
    LONG_CALL = 2e-3
    # So do calls whose one thread takes this many times the team's: a team that gains this much
    # keeps its typical call fast beside a busy core too, which a latency target counts, where
    # the calls alone would all be slower.
    GAIN = 1.4

    __slots__ = ("alone", "calls", "spent", "windows", "team", "team_low", "lows", "one", "settled")

    def __init__(self) -> None:
        self.alone = False  # this window's way
        self.calls = 0  # in this window
        self.spent = 0.0  # seconds in this window's calls, the first left out
        self.windows = 0
        self.team: float | None = None  # mean seconds per call on the team, on one thread
        self.one: float | None = None
        # the team's usual window lately: its time without stalls, where they hit some windows; one
        # lucky window (the neighbour off the core for its length) does not make it
        self.team_low: float | None = None
        self.lows: list[float] = []
        self.settled = False  # on the team for good (LONG_CALL, GAIN)

    def end_window(self) -> None:
        """The window's mean into its way's time, and the next window's way."""
        mean = self.spent / (WINDOW - 1)
        if self.windows >= self.WARM:
            if self.alone:
                self.one = mean if self.one is None else self.one + self.ALPHA * (mean - self.one)
            else:
                self.team = mean if self.team is None else self.team + self.ALPHA * (mean - self.team)
                self.team_low = omp.steady(self.lows, mean, self.LOW_WINDOWS)
        self.calls, self.spent = 0, 0.0
        self.windows += 1
        self.alone = self.choose()

    def choose(self) -> bool:
        """Whether the next window runs alone."""
        team, one, low = self.team, self.one, self.team_low
        if self.settled or self.windows <= self.WARM or team is None or low is None:
            return False
        if low > self.LONG_CALL or (one is not None and one > self.GAIN * low):
            self.settled = True
            return False
        if one is None:
            return True
        faster = one < self.MARGIN * team
        return not faster if self.windows % (self.EXPLORE_TEAM if faster else self.EXPLORE_ALONE) == 0 else faster


class CallTeams:
    """A host plan (or its batch streams) whose calls run alone where their CallWay says so."""

    def __init__(self, exe: SequentialPlan | ShapeSpecializedPlan | BatchStreams) -> None:
        self.exe = exe
        self.plan = exe.plan if isinstance(exe, BatchStreams) else exe
        # smaller batches go to the plan itself: batch streams would hand them on untouched
        self.min_batch = exe.min_batch if isinstance(exe, BatchStreams) and exe.active else sys.maxsize
        self._ways: dict[tuple[int, ...], CallWay | None] = {}  # by the first input's shape

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        try:
            key = feeds[0].shape
            exe = self.plan if key[0] < self.min_batch else self.exe
        except (AttributeError, IndexError):  # not arrays, or scalars: the plan says what is wrong
            return self.exe.run(feeds)
        if parallel.alone():  # the caller runs by itself already: nothing to choose or time
            return exe.run(feeds)
        way = self._ways.get(key, _UNSEEN)
        if way is _UNSEEN:
            way = self._way_for(key)
        if way is None:
            return exe.run(feeds)
        way.calls = calls = way.calls + 1
        start = perf_counter()
        if way.alone:
            with omp.Alone():
                results = exe.run(feeds)
        else:
            results = exe.run(feeds)
        if calls > 1:
            way.spent += perf_counter() - start
            if calls == WINDOW:
                way.end_window()
                if way.settled:
                    self._ways[key] = None
        return results

    def _way_for(self, key: tuple[int, ...]) -> CallWay | None:
        if len(self._ways) >= MAX_SIGNATURES:  # not kept: a model fed ever new shapes must not grow this
            return None
        return self._ways.setdefault(key, CallWay())


_UNSEEN = CallWay()  # a signature not yet called with


def call_teams(exe: Any) -> Any:
    """`exe` with its calls run alone while that is faster, where it is a host plan on a team."""
    if isinstance(exe, (SequentialPlan, ShapeSpecializedPlan, BatchStreams)) and omp.TeamChoice.ENABLED:
        return CallTeams(exe)
    return exe
