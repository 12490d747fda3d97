"""oneDNN calls choose between the OpenMP team and a team of one by timing both: the choice
follows whichever is faster, keeps exploring the other, and the single-threaded primitives
give the same numbers."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.kernels import omp, onednn
from kubetrt.runtime.kernels.omp import TeamChoice
import two_ways


def drive(choice: TeamChoice, team_s: float, alone_s: float, calls: int) -> list[bool]:
    """Whether each call ran alone."""
    return two_ways.drive(choice, team_s, alone_s, calls)


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_choice_follows_the_faster_team_and_keeps_exploring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    choice = TeamChoice()
    quiet = drive(choice, team_s=1e-3, alone_s=1.7e-3, calls=320)
    # the first try alone takes two calls (the first makes the one-thread primitives)
    assert sum(quiet[TeamChoice.WARM:]) <= 320 // TeamChoice.EXPLORE + 2, "uncontended: the team runs, one thread only explores"
    contended = drive(choice, team_s=6e-3, alone_s=1.7e-3, calls=320)  # a neighbour takes a core
    # exploring the team takes two calls (the first wakes its members)
    assert sum(contended[-200:]) >= 200 - 2 * (200 // TeamChoice.EXPLORE + 1), "contended: one thread runs"
    calm = drive(choice, team_s=1e-3, alone_s=1.7e-3, calls=640)  # the neighbour leaves
    assert sum(calm[-200:]) <= 200 // TeamChoice.EXPLORE + 1, "the team is taken back once it is faster again"


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_one_stall_does_not_hold_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    choice = TeamChoice()
    drive(choice, team_s=1e-3, alone_s=1.7e-3, calls=40)
    choice.record(False, 50e-3)  # one team call stalls (a descheduled thread)
    after = drive(choice, team_s=1e-3, alone_s=1.7e-3, calls=2 * TeamChoice.EXPLORE + 2)
    back = after[TeamChoice.EXPLORE + 1:]
    assert sum(back) <= len(back) // TeamChoice.EXPLORE + 1, "the team is back after its next fast call, one thread only explores"
    assert choice.mean[0] == pytest.approx(1e-3)


@pytest.mark.skipif(not onednn.AVAILABLE, reason="oneDNN is not installed (the `onednn` extra)")
def test_single_threaded_primitives_give_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    w, b = rng.standard_normal((16, 8, 3, 3)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    x, res = rng.standard_normal((2, 9, 9, 8)).astype(np.float32), rng.standard_normal((2, 9, 9, 16)).astype(np.float32)
    results = {}
    for serial in (False, True):
        monkeypatch.setattr(TeamChoice, "pick", lambda self, s=serial: s)
        conv = onednn.Conv2D(w, b, 1, [1, 1], [1, 1], ("eltwise_relu", 0.0, 0.0), True, "nhwc")
        pool = onednn.Pool2D("pooling_max", (3, 3), [2, 2], [1, 1])
        y = conv(x, 9, 9, [1, 1], [1, 1], res)
        results[serial] = (y, pool(y, 5, 5, [1, 1], [1, 1]))
        assert list(conv._shapes) == [(2, 9, 9, 9, 9, 1, 1, 1, 1, False, serial)], "the primitive made for the chosen team ran"
    for a, c in zip(results[False], results[True]):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)


def test_adaptive_teams_by_default_static_on_request_and_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert omp.adaptive_teams({})
    assert omp.adaptive_teams({omp.TEAMS_ENV: " Adaptive "})
    assert not omp.adaptive_teams({omp.TEAMS_ENV: "static"})
    with pytest.raises(ValueError, match="KUBETRT_ONEDNN_TEAMS='dynamic': expected 'adaptive' or 'static'"):
        omp.adaptive_teams({omp.TEAMS_ENV: "dynamic"})
    monkeypatch.setattr(TeamChoice, "ENABLED", False)  # static: no call is ever sent to one thread
    assert not any(drive(TeamChoice(), team_s=6e-3, alone_s=1e-3, calls=200))


def test_short_calls_keep_the_team(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    short = TeamChoice.MIN_TEAM_SECONDS / 2
    assert not any(drive(TeamChoice(), team_s=short, alone_s=short / 10, calls=300))


def test_short_team_calls_skip_the_bookkeeping_but_one_in_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    short, long = TeamChoice(keeps_apart=False), TeamChoice(keeps_apart=False)
    assert not short.untimed(), "not timed yet: nothing to go by"
    drive(short, team_s=TeamChoice.MIN_TEAM_SECONDS / 4, alone_s=1.0, calls=TeamChoice.WARM + 2)
    drive(long, team_s=TeamChoice.MIN_TEAM_SECONDS * 4, alone_s=1.0, calls=TeamChoice.WARM + 2)
    skips = [short.untimed() for _ in range(8 * TeamChoice.SAMPLE)]
    assert skips.count(False) == 8, "every SAMPLE-th short call is timed"
    assert not any(long.untimed() for _ in range(20)), "a long team call is always timed"
    with omp.Alone():
        assert not short.untimed(), "a stream's call goes to pick, which runs it alone"


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_the_team_s_first_call_after_calls_alone_is_not_what_it_is_judged_by(monkeypatch: pytest.MonkeyPatch) -> None:
    # A short call: one stall sends it alone; then each team call that explores after calls alone
    # waits for members that fell asleep, slower than one thread, while the team's other calls
    # are faster. Judged by its first call the team would never come back.
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    choice = TeamChoice()
    drive(choice, team_s=0.2e-3, alone_s=0.3e-3, calls=40)
    choice.record(False, 5e-3)  # one team call stalls
    picks, last = [], True
    for _ in range(4 * TeamChoice.EXPLORE):
        serial = choice.pick()
        choice.record(serial, 0.3e-3 if serial else 0.45e-3 if last else 0.2e-3)  # waking costs 0.25 ms
        picks.append(serial)
        last = serial
    assert sum(picks[-TeamChoice.EXPLORE:]) <= 2, "the team, timed warm, is back"


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_the_first_call_alone_is_not_what_one_thread_is_judged_by(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    choice = TeamChoice()
    drive(choice, team_s=3e-3, alone_s=2e-3, calls=TeamChoice.WARM + 1)
    alone_calls = 0
    for _ in range(8):
        serial = choice.pick()
        alone_calls += serial
        choice.record(serial, (20e-3 if alone_calls == 1 else 2e-3) if serial else 3e-3)  # the first makes its primitives
    assert choice.mean[1] == pytest.approx(2e-3)


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_a_steady_choice_judges_a_bimodal_team_by_its_usual_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # beside a busy core, a chain in bands: a third of the team's calls fast (the caller held its
    # core), the rest slow; one thread steady between them
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    team_times = [6.9e-3, 2.7e-3, 10.8e-3, 6.9e-3, 6.9e-3, 2.7e-3]
    judged = {}
    for kind in (omp.SteadyChoice, TeamChoice):
        choice = kind()
        drive(choice, team_s=6.9e-3, alone_s=4.4e-3, calls=TeamChoice.WARM + 3)  # warm, then two calls alone
        for t in team_times:
            choice.record(False, t)
        judged[kind] = choice.mean[0]
        picks = [choice.pick() for _ in range(100)]
        if kind is omp.SteadyChoice:
            assert sum(picks) >= 98, "one thread, by the team's median"
    assert judged[omp.SteadyChoice] == pytest.approx(6.9e-3)
    assert judged[TeamChoice] == pytest.approx(2.7e-3)  # what crediting a faster call at once makes of it
    steady = omp.SteadyChoice()
    drive(steady, team_s=1e-3, alone_s=1.7e-3, calls=40)
    steady.record(False, 50e-3)  # one stall: the median does not move
    assert steady.mean[0] == pytest.approx(1e-3)


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_a_steady_choice_of_long_calls_takes_the_team_back_soon_after_a_spell_of_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    # a chain of milliseconds (a model's run): a spell of stalled team calls sends it alone; once
    # the spell is over the team must be back within the explorations' time, not EXPLORE calls later
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    steady = omp.SteadyChoice()
    team_s, alone_s = 4e-3, 7e-3
    drive(steady, team_s=team_s, alone_s=alone_s, calls=20)
    for _ in range(omp.SteadyChoice.SAMPLES):
        steady.record(False, 13e-3)  # the spell
    assert steady.pick(), "stalled team calls: one thread"
    after = drive(steady, team_s=team_s, alone_s=alone_s, calls=TeamChoice.EXPLORE // 2)
    first_exploration = int(omp.SteadyChoice.EXPLORE_SECONDS / alone_s) + 2
    assert not any(after[first_exploration + omp.SteadyChoice.TRIES + 1:]), after
    assert steady.explore_after == omp.SteadyChoice.EXPLORE_SECONDS, "the team won: the count starts over"


@pytest.mark.skipif(not TeamChoice.CAPABLE, reason="one OpenMP thread (or no libgomp): there is nothing to choose")
def test_a_steady_choice_beside_a_neighbour_explores_less_and_less(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TeamChoice, "ENABLED", True)
    steady = omp.SteadyChoice()
    drive(steady, team_s=4e-3, alone_s=7e-3, calls=20)
    alone_s, calls = 7e-3, 1200  # 8.4 s alone
    picks = drive(steady, team_s=15e-3, alone_s=alone_s, calls=calls)  # a neighbour holds a core
    team_calls = [i for i, alone in enumerate(picks) if not alone]
    # explorations after 0.05, 0.1, 0.2, ... s alone, MAX_EXPLORE_SECONDS apart at most, and the
    # calls' own every EXPLORE-th: each a team call that wakes the team and one try that loses
    doublings = 0
    while omp.SteadyChoice.EXPLORE_SECONDS * 2 ** doublings < omp.SteadyChoice.MAX_EXPLORE_SECONDS:
        doublings += 1
    explorations = doublings + 1 + int(calls * alone_s / omp.SteadyChoice.MAX_EXPLORE_SECONDS) + calls // TeamChoice.EXPLORE + 1
    assert len(team_calls) <= explorations * 2, team_calls
    assert sum(picks[-TeamChoice.EXPLORE:]) >= TeamChoice.EXPLORE - 2 * (1 + omp.SteadyChoice.TRIES), "one thread, mostly"
    gaps = [b - a for a, b in zip(team_calls, team_calls[1:]) if b - a > 1]
    assert gaps[:3] == sorted(gaps[:3]), f"explorations come further apart: {gaps}"
