"""Buffers the vector kernels read whole cache lines of.

A heap array's start moves with the process's allocation history (16 bytes past a cache line in
some processes, and glibc serves large arrays from the heap here: runtime/memory.py), so a
kernel that loads 64 bytes at a time would straddle two lines on every load there.
"""
from __future__ import annotations

import numpy as np

LINE = 64


def whole_lines(nbytes: int) -> int:
    """`nbytes` rounded up to whole cache lines: where the next buffer laid after it may start."""
    return -(-nbytes // LINE) * LINE


def aligned(nbytes: int) -> np.ndarray:
    """A byte buffer whose start is a cache line's."""
    raw = np.empty(nbytes + LINE, dtype=np.uint8)
    off = (-raw.ctypes.data) % LINE
    return raw[off:off + nbytes]


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.empty(shape, dtype), starting on a cache line."""
    dt = np.dtype(dtype)
    return aligned(int(np.prod(shape)) * dt.itemsize).view(dt).reshape(shape)
