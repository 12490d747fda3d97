"""Allocator settings for the host runtime's activation buffers.

Every kernel returns fresh NumPy arrays; glibc serves arrays above its mmap threshold with new
mappings and unmaps them on free, so each large activation costs a page fault per page on every
request, a visible share of a large model's batch-1 latency. Raising the threshold and the trim
threshold keeps freed activation memory in the heap for the next request to reuse: the process
keeps its peak working set, as an arena would. Set KUBETRT_MALLOC_TUNING=0 to leave glibc alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
_done = False


def keep_freed_memory() -> bool:
    """Apply once per process; returns whether the allocator was tuned."""
    global _done
    if _done:
        return True
    if os.environ.get("KUBETRT_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    _done = ok
    return ok
