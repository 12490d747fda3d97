"""How much each runtime slows down when it does not have the CPU to itself.

    python bench/contention.py [--models small_cnn mobilenet_v2] [--engines kubetrt kubetrt-static onnxruntime]
                               [--batches 1] [--seconds 1] [--rounds 3]

Each cell runs in bench/runtime.py's measuring worker under three conditions: alone; beside a
busy core (another process spinning on one CPU, as a noisy pod on the node); and with another
runtime at work in the same process (OpenVINO's thread pool inferring the same model, as a
second model or a sidecar runtime in one pod). Engines and conditions take turns round by round,
and each reports the median of its rounds' medians. The last lines give each engine's slowdown
(time under the condition / time alone) per cell: the goal is kubetrt's no worse than
onnxruntime's; then, per condition and statistic, the cells where kubetrt's is worse in enough of
the rounds to be more than the rounds' noise (a paired sign test), and where only its median is.
`kubetrt-static` is kubetrt with KUBETRT_ONEDNN_TEAMS=static, `kubetrt-free` with
KUBETRT_TEAM_PLACEMENT=free.
"""
from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import runtime as bench  # noqa: E402  (bench/runtime.py: its worker, spawn and zoo access)

CONDITIONS = ("alone", "busy-core", "same-process")
# kubetrt with its OpenMP kernels always on the whole team (no omp.TeamChoice), and with its team
# members left where the scheduler puts them (no omp.keep_apart)
VARIANTS = {"kubetrt-static": ("kubetrt", {"KUBETRT_ONEDNN_TEAMS": "static"}),
            "kubetrt-free": ("kubetrt", {"KUBETRT_TEAM_PLACEMENT": "free"})}


@contextmanager
def condition(name: str) -> Iterator[dict[str, str]]:
    """The environment a worker runs in under `name`, with a busy neighbour process while needed."""
    if name == "busy-core":
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            yield {}
        finally:
            spinner.kill()
            spinner.wait()
    elif name == "same-process":
        yield {bench.NEIGHBOUR_ENV: "same-process"}
    else:
        yield {}


STATS = ("median_s", "mean_s", "p99_s")  # per worker: its calls' median, mean and 99th percentile


Rounds = dict[str, dict[tuple[str, str], list[float]]]  # statistic -> (engine, condition) -> its value in each round


def measure(model: str, batch: int, engines: list[str], paths: tuple[Path, Path], seconds: float, rounds: int) -> Rounds:
    """Per statistic of a worker's call times (STATS), per (engine, condition): its value in each round."""
    runs: Rounds = {stat: {} for stat in STATS}
    for r in range(rounds):
        for cond in CONDITIONS:
            for engine in engines:
                bench._progress(f"{model} batch {batch} {engine} {cond} (round {r + 1}/{rounds})")
                worker, variant_env = VARIANTS.get(engine, (engine, {}))
                args = ["--worker", worker, model, str(batch), *map(str, paths), "--seconds", str(seconds / rounds)]
                with condition(cond) as env:
                    result = bench.spawn(args, env={**env, **variant_env})
                for stat in STATS:
                    runs[stat].setdefault((engine, cond), []).append(result[stat])
    return runs


Slowdowns = dict[tuple[str, int, str, str, str], list[float]]  # (model, batch, engine, condition, statistic) -> per round
PEER = "onnxruntime"  # the runtime the clause measures kubetrt's slowdown against
# A cell counts against kubetrt only where it slowed down more than the peer in so many of the
# rounds that a fair coin would do so this rarely: each round runs both engines under the
# condition and alone minutes apart at most, and one noisy spell moves one round, not the median.
SIGN_TEST_P = 0.125


def slowdowns(model: str, batch: int, runs: Rounds) -> Slowdowns:
    """Each engine's slowdown per condition and statistic for one cell, round by round: its value
    there / its value alone in the same round."""
    return {(model, batch, e, c, stat): [x / a for x, a in zip(values, cells[(e, "alone")])]
            for stat, cells in runs.items() for (e, c), values in cells.items() if c != "alone"}


def worse_rounds_needed(rounds: int, p: float = SIGN_TEST_P) -> int:
    """The fewest of `rounds` paired rounds one engine must lose for the loss to be more than chance:
    the smallest k with P(k or more heads in `rounds` fair tosses) <= p."""
    for k in range(rounds + 1):
        if sum(math.comb(rounds, j) for j in range(k, rounds + 1)) / 2**rounds <= p:
            return k
    return rounds + 1  # too few rounds to tell: no cell counts against


def verdicts(slow: Slowdowns, engine: str, peer: str = PEER) -> list[str]:
    """Per condition and statistic: in how many cells `engine` slows down no more than `peer`, and
    the cells where it slows down more in enough rounds to count (worse_rounds_needed) and where
    only its median does (within the rounds' noise). The statistics disagree beside a busy core (a
    team's median call keeps its speed, its mean pays the waits for a descheduled member:
    bench/team_scheduling.py), so each gets its own count."""
    lines = []
    for c in CONDITIONS[1:]:
        parts = []
        for stat in STATS:
            cells = sorted({(m, b) for m, b, e, cc, st in slow if e == engine and cc == c and st == stat})
            worse: list[str] = []
            noise: list[str] = []
            for m, b in cells:
                mine, theirs = slow[(m, b, engine, c, stat)], slow[(m, b, peer, c, stat)]
                if statistics.median(mine) <= statistics.median(theirs):
                    continue
                lost = sum(x > y for x, y in zip(mine, theirs))
                said = f"{m} b{b} {statistics.median(mine):.2f}x vs {statistics.median(theirs):.2f}x, {lost}/{len(mine)} rounds"
                (worse if lost >= worse_rounds_needed(len(mine)) else noise).append(said)
            part = f"{stat.removesuffix('_s')} {len(cells) - len(worse) - len(noise)}/{len(cells)}"
            part += f" (worse: {'; '.join(worse)})" if worse else ""
            part += f" (within noise: {'; '.join(noise)})" if noise else ""
            parts.append(part)
        lines.append(f"{engine} degrades no more than {peer} {c}: " + ", ".join(parts))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small_cnn", "mobilenet_v2"], choices=bench.MODELS)
    p.add_argument("--engines", nargs="+", default=["kubetrt", "kubetrt-static", "onnxruntime"],
                   choices=[*bench.ENGINES, *VARIANTS])
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per cell and condition, split over the rounds")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()

    from _zoo import zoo

    z = zoo()
    lines = []
    slowed: Slowdowns = {}
    print(f"{'model':<14}{'batch':>6}  {'engine':<12}" + "".join(f"{c:>16}" for c in CONDITIONS))
    for m in a.models:
        paths = (z.package(m), z.savedmodel(m))
        for batch in a.batches:
            runs = measure(m, batch, a.engines, paths, a.seconds, a.rounds)
            slowed.update(slowdowns(m, batch, runs))
            stats = {stat: {cell: statistics.median(values) for cell, values in cells.items()} for stat, cells in runs.items()}
            times, means, tails = stats["median_s"], stats["mean_s"], stats["p99_s"]
            for e in a.engines:
                alone = times[(e, "alone")]
                cells = "".join(f"{times[(e, c)] * 1e3:>10.3f} ms" + (f" {times[(e, c)] / alone:3.1f}x" if c != "alone" else "   ")
                                for c in CONDITIONS)
                print(f"{m:<14}{batch:>6}  {e:<12}{cells}")
            for c in CONDITIONS[1:]:
                slow = ", ".join(f"{e} {times[(e, c)] / times[(e, 'alone')]:.2f}x"
                                 f" ({means[(e, c)] / means[(e, 'alone')]:.2f}x, p99 {tails[(e, c)] * 1e3:.3f} ms"
                                 f" from {tails[(e, 'alone')] * 1e3:.3f})" for e in a.engines)
                lines.append(f"slowdown  {m} b{batch} {c}: {slow}")
    print("\nslowdown = median call time under the condition / alone (lower is better);"
          " in brackets the same for the mean call time, which a call's stalls raise, and the 99th"
          " percentile call time under the condition and alone:")
    print("\n".join(lines))
    if PEER in a.engines:
        print()
        print("\n".join(v for e in a.engines if e != PEER for v in verdicts(slowed, e)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
