"""What a two-thread team costs beside a busy core, by how its call waits for the second thread.

    python bench/team_scheduling.py [--units 2 8] [--reps 40] [--seconds 2] [--rounds 3]

A model, not the runtime: bench/team_scheduling.c times one fixed call (arithmetic in L1, cut
into units) run on one thread, on an OpenMP team of two splitting it statically (how oneDNN's
primitives and the runtime's team kernels split theirs), and by the caller with a helper thread
taking units from a shared counter (the caller finishes whatever the helper has not taken); idle
threads spin as long as the runtime's OpenMP workers (GOMP_SPINCOUNT, runtime/kernels/omp.py). Each
runs alone and beside a busy core (bench/contention.py's spinning neighbour), modes and
conditions taking turns round by round; each cell is the median of the rounds'. It needs a C
compiler with OpenMP (cc -fopenmp).

Why: beside a busy core a call's median and its mean pull apart, and which way a runtime should
run its calls depends on which of the two a design can keep. This shows what each way of waiting
for the second thread costs in both, apart from any kernel. GOMP_SPINCOUNT set in the environment
replaces the runtime's spin for both the team and the helper (libgomp's own default is 300000).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _bootstrap  # noqa: E402,F401  (kubetrt from this checkout)
from contention import condition  # noqa: E402  (the busy neighbour, one definition)

from kubetrt.runtime.kernels.omp import SPIN_ENV, SPIN_ROUNDS  # noqa: E402

MODES = ("one", "static", "helper")
CONDITIONS = ("alone", "busy-core")
STATS = ("median_s", "mean_s", "p99_s")


def build(workdir: Path) -> Path:
    """The model's binary, compiled into `workdir`."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("team_scheduling: needs a C compiler (cc or gcc) with OpenMP; none is on PATH")
    binary = workdir / "team_scheduling"
    subprocess.run([cc, "-O2", "-fopenmp", "-pthread", str(HERE / "team_scheduling.c"), "-o", str(binary)], check=True)
    return binary


def run(binary: Path, mode: str, units: int, seconds: float, reps: int) -> dict[str, float]:
    """One mode's call times; its idle threads spin as long as the runtime's OpenMP workers do."""
    env = {**os.environ, SPIN_ENV: os.environ.get(SPIN_ENV, str(SPIN_ROUNDS))}
    out = subprocess.run([str(binary), mode, str(units), str(seconds), str(reps)], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", nargs="+", type=int, default=[2, 8], help="units a call is cut into")
    p.add_argument("--reps", type=int, default=40, help="a call's arithmetic, in passes over the buffer")
    p.add_argument("--seconds", type=float, default=2.0, help="per mode and condition, split over the rounds")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        cells: dict[tuple[int, str, str], list[dict[str, float]]] = {}
        for r in range(a.rounds):
            for cond in CONDITIONS:
                for units in a.units:
                    for mode in MODES:
                        if mode != "helper" and units != a.units[0]:
                            continue  # units change nothing but the helper's protocol
                        print(f"# {mode} units {units} {cond} (round {r + 1}/{a.rounds})", file=sys.stderr, flush=True)
                        with condition(cond):
                            cells.setdefault((units, mode, cond), []).append(run(binary, mode, units, a.seconds / a.rounds, a.reps))
    med = {cell: {s: statistics.median(x[s] for x in runs) for s in STATS} for cell, runs in cells.items()}
    print(f"{'mode':<8}{'units':>6}  {'alone median':>13}{'busy median':>13}{'busy mean':>11}{'busy p99':>11}"
          f"  slowdown: median   mean")
    for units, mode in sorted({(u, m) for u, m, _ in med}, key=lambda k: (MODES.index(k[1]), k[0])):
        alone, busy = med[(units, mode, "alone")], med[(units, mode, "busy-core")]
        print(f"{mode:<8}{units:>6}  {alone['median_s'] * 1e6:>10.1f} us{busy['median_s'] * 1e6:>10.1f} us"
              f"{busy['mean_s'] * 1e6:>8.1f} us{busy['p99_s'] * 1e6:>8.0f} us"
              f"  {busy['median_s'] / alone['median_s']:>15.2f}x {busy['mean_s'] / alone['mean_s']:>5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
