"""Whole calls on one thread while a neighbour holds a core (runtime/call_teams.py): the way each
signature's calls run follows the mean time per call, stalls included; teams that gain much, and
long calls, keep the team for good; calls sent alone run alone and give the team's results."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime import load_model
from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.batch_streams import BatchStreams
from kubetrt.runtime.call_teams import MAX_SIGNATURES, WINDOW, CallTeams, CallWay
from kubetrt.runtime.kernels import omp
from test_batch_streams import conv_model, watched

FP32 = tolerance_for("fp32", "host")
US = 1e-6


def drive(way: CallWay, team_s: float | list[float], one_s: float, windows: int) -> list[bool]:
    """Windows whose calls take `team_s` on the team (in turn, where a list) and `one_s` alone:
    the way each ran."""
    team = team_s if isinstance(team_s, list) else [team_s]
    ways = []
    for i in range(windows):
        ways.append(way.alone)
        way.spent = (one_s if way.alone else team[i % len(team)]) * (WINDOW - 1)
        way.end_window()
    return ways


def test_a_team_that_stalls_gives_its_calls_to_one_thread_until_the_neighbour_leaves() -> None:
    way = CallWay()
    quiet = drive(way, team_s=55 * US, one_s=60 * US, windows=600)
    assert sum(quiet) <= 600 // CallWay.EXPLORE_ALONE + 2, "uncontended: the team runs, one thread only explores"
    # a neighbour takes a core: most team calls as fast as before, one in every other window waits 4 ms
    busy = drive(way, team_s=[55 * US + 4e-3 / (WINDOW - 1), 55 * US], one_s=60 * US, windows=200)
    assert sum(busy[-150:]) >= 150 - 150 // CallWay.EXPLORE_TEAM - 1, "contended: the calls run alone, the team only explores"
    calm = drive(way, team_s=55 * US, one_s=60 * US, windows=400)
    assert sum(calm[-200:]) <= 200 // CallWay.EXPLORE_ALONE + 1, "the team is taken back once its stalls are gone"
    assert not way.settled


def test_one_stalled_window_keeps_the_team() -> None:
    way = CallWay()
    drive(way, team_s=55 * US, one_s=60 * US, windows=40)
    after = drive(way, team_s=55 * US + 2e-3 / (WINDOW - 1), one_s=60 * US, windows=1)
    after += drive(way, team_s=55 * US, one_s=60 * US, windows=100)
    assert sum(after) <= 1, after


def test_a_team_that_gains_much_keeps_its_calls_for_good_beside_a_busy_core() -> None:
    # one thread takes 1.8x the team's time: the calls stay on the team even where its stalls make
    # its mean the slower, since most of them stay fast
    way = CallWay()
    ways = drive(way, team_s=16.5 * US, one_s=30 * US, windows=5)
    assert way.settled and ways.count(True) == 1, ways  # its one window alone told it so
    assert not any(drive(way, team_s=80 * US, one_s=30 * US, windows=10))
    # started beside the busy core: alone at first, until two windows on the team (of the last
    # three it is judged by) go unstalled
    way = CallWay()
    stalled = drive(way, team_s=16.5 * US + 4e-3 / (WINDOW - 1), one_s=30 * US, windows=4)
    assert stalled[-1] and not way.settled
    later = drive(way, team_s=16.5 * US, one_s=30 * US, windows=3 * CallWay.EXPLORE_TEAM)
    assert way.settled and not any(later[2 * CallWay.EXPLORE_TEAM + 1:]), later


def test_one_lucky_window_on_the_team_does_not_keep_it_for_good() -> None:
    # a small CNN beside a busy core: its team's windows stall (120 us a call), one thread takes
    # 80; one window on the team catches the neighbour off its core (54 us). Judged by that window
    # the team would gain 1.4x, and keep the calls for good at a mean of 120 us.
    way = CallWay()
    drive(way, team_s=120 * US, one_s=80 * US, windows=CallWay.WARM + 4)
    ways, team_windows = [], 0
    for _ in range(3 * CallWay.EXPLORE_TEAM):
        ways.append(way.alone)
        if not way.alone:
            team_windows += 1
        way.spent = (80 if way.alone else 54 if team_windows == 1 else 120) * US * (WINDOW - 1)
        way.end_window()
    assert team_windows >= 2 and not way.settled
    assert sum(ways[-CallWay.EXPLORE_TEAM:]) >= CallWay.EXPLORE_TEAM - 1, ways


def test_long_calls_keep_the_team_for_good_without_a_window_alone() -> None:
    way = CallWay()
    assert not any(drive(way, team_s=5e-3, one_s=8e-3, windows=CallWay.WARM + 2))
    assert way.settled and way.one is None


def test_calls_sent_alone_run_alone_and_give_the_team_s_results(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = watched(conv_model())
    calls = CallTeams(plan)
    x = np.random.default_rng(3).standard_normal((2, 3, 12, 12)).astype(np.float32)
    team = plan.run([x])[0]
    monkeypatch.setattr(CallWay, "choose", lambda self: self.windows % 2 == 1)  # windows take turns
    plan.calls.clear()
    results = [calls.run([x])[0] for _ in range(4 * WINDOW)]
    alone = [a for _, _, a in plan.calls]
    assert alone == ([False] * WINDOW + [True] * WINDOW) * 2
    for got in results:
        np.testing.assert_allclose(got, team, rtol=FP32.rtol, atol=FP32.atol)
    assert not omp.STREAM.alone, "the caller's thread is itself again after a call alone"


def test_settled_and_excess_signatures_go_straight_to_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = watched(conv_model())
    calls = CallTeams(plan)
    monkeypatch.setattr(CallWay, "LONG_CALL", 0.0)  # every call is long: the team for good
    x = np.zeros((1, 3, 12, 12), np.float32)
    for _ in range((CallWay.WARM + 2) * WINDOW):
        calls.run([x])
    assert calls._ways[x.shape] is None
    for n in range(2, MAX_SIGNATURES + 4):
        calls.run([np.zeros((n, 3, 12, 12), np.float32)])
    assert len(calls._ways) == MAX_SIGNATURES, "later signatures run on the team, and are not kept"


def test_a_batch_run_alone_is_not_split_in_streams() -> None:
    plan = watched(conv_model())
    streams = BatchStreams(plan, streams=2, mode="always", budget=1 << 40)
    x = np.random.default_rng(1).standard_normal((8, 3, 12, 12)).astype(np.float32)
    streams.run([x])  # decides the split
    plan.calls.clear()
    with omp.Alone():
        streams.run([x])
    assert [(batch, alone) for _, batch, alone in plan.calls] == [(8, True)]


def test_host_models_are_loaded_with_their_calls_timed(zoo: Any) -> None:
    model = load_model(zoo.package("mlp"))
    assert isinstance(model._exe, CallTeams) == omp.TeamChoice.ENABLED
