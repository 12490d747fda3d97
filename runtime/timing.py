"""One way to time a candidate during engine tuning, shared by every device runtime."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_seconds(run: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `run()` after `warmup` untimed calls (medians shrug off noisy spells)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
