"""Progress for long work (lowering, engine builds, benchmarks): one line per step on stderr.

Shown when stderr is a terminal or KUBETRT_PROGRESS=1; silent otherwise, so logs stay quiet.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator


def enabled() -> bool:
    flag = os.environ.get("KUBETRT_PROGRESS")
    if flag is not None:
        return flag not in ("0", "", "false")
    return sys.stderr.isatty()


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    """`with step("lowering to ONNX"): ...` prints `... lowering to ONNX` then `done (1.2s)`."""
    show = enabled()
    t0 = time.perf_counter()
    if show:
        print(f"[kubetrt] {what} ...", file=sys.stderr, flush=True)
    try:
        yield
    except BaseException:
        if show:
            print(f"[kubetrt] {what} failed after {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        raise
    if show:
        print(f"[kubetrt] {what} done ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)


def note(line: str) -> None:
    """One line of what a step found (e.g. an engine's kernel coverage), shown like the steps."""
    if enabled():
        print(f"[kubetrt]   {line}", file=sys.stderr, flush=True)
