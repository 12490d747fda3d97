"""A team member the scheduler put on the calling thread's CPU moves off it; the caller stays put.

Each case runs in a child process: it pins the caller and its team's members to one CPU (the
worst placement, where the two take turns on one core; for a caller that moved, the CPU it moved
to), makes a team call, and reports where each thread may run afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kubetrt.runtime.kernels import omp
from kubetrt.runtime.kernels.omp import TeamChoice

CHILD = textwrap.dedent("""
    import json, os, sys, threading
    import numpy as np
    from kubetrt.runtime.kernels import omp, sgemm
    from kubetrt.runtime.kernels.activations import scalar_form

    rng = np.random.default_rng(0)
    chain = sgemm.PackedChain([sgemm.PackedDense(rng.standard_normal((64, 64), np.float32), None, scalar_form(None),
                                                 residual=False, name="fc")])
    x = rng.standard_normal((1, 64), np.float32)
    omp.keep_apart()  # the team's workers exist from here on
    chain(x)
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    me = threading.get_native_id()
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        os.sched_setaffinity(tid, {cpu})
    if sys.argv[1] == "keep_apart":
        omp.keep_apart()
    else:
        chain(x)  # the dense chain's members check on every call, against the caller's CPU
        chain(x)  # as of its last call at the latest
    masks = {tid: sorted(os.sched_getaffinity(tid)) for tid in tids}
    print(json.dumps({"cpu": cpu, "allowed": sorted(allowed), "caller": masks.pop(me), "others": list(masks.values())}))
""")

MOVED_CHILD = textwrap.dedent("""
    import json, os, threading
    from kubetrt.runtime.kernels import omp

    allowed = sorted(os.sched_getaffinity(0))
    first, second = allowed[0], allowed[1]
    me = threading.get_native_id()
    os.sched_setaffinity(me, {first})
    before = set(os.listdir("/proc/self/task"))
    omp.keep_apart()  # the team's workers start, and the check notes the caller on its first CPU
    workers = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
    os.sched_setaffinity(me, {second})  # the caller wakes on the other CPU, where its workers were put
    for tid in workers:
        os.sched_setaffinity(tid, {second})
    choice = omp.TeamChoice()
    serial = choice.pick()  # the first of APART_EVERY calls: no periodic check due
    print(json.dumps({"second": second, "serial": serial, "calls": choice.calls,
                      "workers": [sorted(os.sched_getaffinity(t)) for t in workers]}))
""")

TWO_CALLERS_CHILD = textwrap.dedent("""
    import json, os, threading
    from kubetrt.runtime.kernels import omp

    both_checked = threading.Barrier(2)
    moved = {}

    def caller(cpu):
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        omp.keep_apart()
        both_checked.wait()  # the process's one placement slot now holds whichever checked last
        moved[cpu] = bool(omp.caller_moved())

    threads = [threading.Thread(target=caller, args=(cpu,)) for cpu in sorted(os.sched_getaffinity(0))[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(moved))
""")

TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not omp.KEEP_APART,
                              reason="one CPU (or no OpenMP team): no member can share the caller's")


def child(code: str, *args: str, **env: str) -> dict:
    """What the child process running `code` printed last, as JSON."""
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2", **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def placed(how: str, **env: str) -> dict:
    return child(CHILD, how, **env)


@TWO_CPUS
@pytest.mark.parametrize("how", ["keep_apart", "dense_chain"])
def test_a_member_on_the_callers_cpu_moves_off_it(how: str) -> None:
    got = placed(how)
    rest = [c for c in got["allowed"] if c != got["cpu"]]
    assert got["caller"] == [got["cpu"]], "the caller's own placement is not touched"
    assert got["others"].count(rest) == 1, f"one worker (a team of two) moved to {rest}: {got['others']}"


@TWO_CPUS
def test_a_caller_that_moved_cpu_moves_its_members_off_the_new_one_on_its_next_team_call() -> None:
    got = child(MOVED_CHILD)
    assert not got["serial"] and got["calls"] % TeamChoice.APART_EVERY != 0, got
    assert got["workers"] and all(got["second"] not in mask for mask in got["workers"]), got


@TWO_CPUS
def test_two_callers_on_their_own_cpus_are_not_taken_for_moved_ones() -> None:
    moved = child(TWO_CALLERS_CHILD)
    assert len(moved) == 2 and not any(moved.values()), moved


@TWO_CPUS
def test_free_placement_leaves_members_where_the_scheduler_put_them() -> None:
    got = placed("keep_apart", KUBETRT_TEAM_PLACEMENT="free")
    assert all(mask == [got["cpu"]] for mask in got["others"]), got


def test_placement_is_apart_by_default_free_on_request_and_a_bad_value_is_named() -> None:
    assert omp.apart_placement({})
    assert omp.apart_placement({omp.PLACEMENT_ENV: " Apart "})
    assert not omp.apart_placement({omp.PLACEMENT_ENV: "free"})
    with pytest.raises(ValueError, match="KUBETRT_TEAM_PLACEMENT='pinned': expected 'apart' or 'free'"):
        omp.apart_placement({omp.PLACEMENT_ENV: "pinned"})


def test_onednn_teams_check_placement_every_few_calls_and_own_kernels_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[int] = []
    monkeypatch.setattr(omp, "keep_apart", lambda: checks.append(1))
    monkeypatch.setattr(omp, "caller_moved", lambda: False)  # a caller that stays on its CPU
    monkeypatch.setattr(TeamChoice, "ENABLED", False)  # every call runs on the team
    calls = 4 * TeamChoice.APART_EVERY
    for keeps_apart, want in ((True, 4), (False, 0)):
        checks.clear()
        choice = TeamChoice(keeps_apart)
        for _ in range(calls):
            choice.record(choice.pick(), 1e-3)
        assert len(checks) == want
