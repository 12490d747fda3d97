"""Whole runs stay on the thread that went idle last (one OpenMP team while runs come one at a
time), and a thread done with the engine lets its team's workers go (omp.release_team)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from kubetrt.runtime.kernels import omp
from kubetrt.runtime.run_threads import RunThreads


def test_runs_one_at_a_time_stay_on_one_thread() -> None:
    pool = RunThreads(4)
    try:
        idents = {pool.submit(threading.get_ident).result(timeout=10) for _ in range(50)}
        assert len(idents) == 1 and pool.threads == 1
    finally:
        pool.shutdown()


def test_runs_in_flight_together_get_a_thread_each_up_to_the_limit_and_the_rest_wait_in_order() -> None:
    pool = RunThreads(2)
    release = threading.Event()
    started = [threading.Event(), threading.Event()]
    order: list[int] = []

    def held(i: int) -> int:
        started[i].set()
        release.wait(10)
        return threading.get_ident()

    try:
        first, second = pool.submit(held, 0), pool.submit(held, 1)
        assert started[0].wait(10) and started[1].wait(10)  # both running at once
        later = [pool.submit(order.append, i) for i in range(5)]
        assert not any(f.done() for f in later) and pool.threads == 2
        release.set()
        assert first.result(10) != second.result(10)
        for f in later:
            f.result(10)
        assert order == [0, 1, 2, 3, 4]
    finally:
        release.set()
        pool.shutdown()


def test_a_failed_run_fails_its_future_and_the_thread_serves_on() -> None:
    pool = RunThreads(1)
    try:
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(10)
        assert pool.submit(lambda: 7).result(10) == 7
    finally:
        pool.shutdown()


def test_shutdown_finishes_what_was_submitted_and_refuses_more() -> None:
    pool = RunThreads(1)
    gate = threading.Event()
    futures = [pool.submit(gate.wait, 10)] + [pool.submit(lambda i=i: i) for i in range(3)]
    threading.Timer(0.05, gate.set).start()
    pool.shutdown()
    assert [f.result(0) for f in futures] == [True, 0, 1, 2]
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int)


def test_max_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_threads 0: expected >= 1"):
        RunThreads(0)


CHILD = textwrap.dedent("""
    import json, os, threading
    import numpy as np
    from kubetrt.runtime.kernels import omp, sgemm
    from kubetrt.runtime.kernels.activations import scalar_form

    rng = np.random.default_rng(0)
    chain = sgemm.PackedChain([sgemm.PackedDense(rng.standard_normal((256, 256), np.float32), None,
                                                 scalar_form(None), residual=False, name="fc")])
    x = rng.standard_normal((64, 256), np.float32)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    counts = {}
    go, done = threading.Event(), threading.Event()

    def loader():
        chain(x)  # this thread's team: its workers start
        counts["loader_team"] = tasks()
        go.wait()
        omp.release_team()
        counts["released"] = tasks()
        done.set()

    t = threading.Thread(target=loader)
    counts["before"] = tasks()
    t.start()
    while "loader_team" not in counts:
        pass
    chain(x)  # the main thread's own team, beside the loader's
    counts["two_teams"] = tasks()
    go.set()
    done.wait()
    t.join()
    counts["joined"] = tasks()
    print(json.dumps({"team": omp.TEAM, **counts}))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not omp.AVAILABLE,
                    reason="one CPU (or no OpenMP): a team of one has no workers to let go")
def test_release_team_lets_the_calling_threads_workers_exit() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    workers = got["team"] - 1
    assert workers >= 1, got
    # each calling thread keeps its own workers; releasing takes the loader's away, the main's stay
    assert got["two_teams"] == got["loader_team"] + workers, got
    assert got["released"] == got["two_teams"] - workers, got


ALONE_CHILD = textwrap.dedent("""
    import json, os, sys, threading
    import numpy as np
    from kubetrt.runtime import load_model, release_team

    model = load_model(sys.argv[1])
    x = {t.name: np.random.default_rng(0).random((1, *t.shape[1:]), np.float32) for t in model.inputs}
    model.predict(x)  # load-time costs (compiling, first touch) on this thread's team
    release_team()
    tasks = lambda: len(os.listdir("/proc/self/task"))
    counts = {}

    def caller():
        counts["before"] = tasks()
        for _ in range(20):
            model.predict_alone(x)
        counts["alone"] = tasks()
        for _ in range(20):
            model.predict(x)
        counts["team"] = tasks()

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    print(json.dumps(counts))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not omp.AVAILABLE,
                    reason="one CPU (or no OpenMP): no team to keep off")
def test_predict_alone_starts_no_team_on_the_calling_thread(zoo: Any) -> None:
    run = subprocess.run([sys.executable, "-c", ALONE_CHILD, str(zoo.package("small_cnn"))], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2", "KUBETRT_ONEDNN_TEAMS": "static"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["alone"] == got["before"], got  # serving's event loop runs these: no second team
    assert got["team"] > got["alone"], got  # the same calls by predict start this thread's workers
