"""Observing a live server's dynamic batching: queue requests behind a large one, then read the
batch sizes the runtime saw from /metrics. Shared by the serving CLI tests and the e2e tests."""
from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request
from typing import Callable

BLOCKER_ROWS = 512  # above the histogram's 256 bucket, so the probe's batches can be told apart


def batch_sizes(base_url: str, model: str) -> tuple[int, int, dict[float, int]]:
    """(batches, rows, cumulative bucket counts) of the kubetrt_batch_size histogram."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    label = f'model="{model}"'
    count = float(re.search(rf"kubetrt_batch_size_count{{{label}}} (\S+)", text).group(1))
    rows = float(re.search(rf"kubetrt_batch_size_sum{{{label}}} (\S+)", text).group(1))
    buckets = {float(le): int(float(v)) for le, v in
               re.findall(rf'kubetrt_batch_size_bucket{{le="([^"]+)",{label}}} (\S+)', text) if le != "+Inf"}
    return int(count), int(rows), buckets


def burst(send: Callable[[int], object], n: int) -> None:
    """send(BLOCKER_ROWS) to keep the batcher busy, then `n` concurrent send(1) that queue behind it."""
    with concurrent.futures.ThreadPoolExecutor(n + 1) as pool:
        blocker = pool.submit(send, BLOCKER_ROWS)
        time.sleep(0.05)
        list(pool.map(send, [1] * n))
        blocker.result()
