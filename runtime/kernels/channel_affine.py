"""MulAdd (x * scale + shift per channel, then ReLU where asked) on the OpenMP team.

A pre-activation BatchNorm (DenseNet's, before every 1x1 convolution) cannot fold into a
convolution: it runs as its own pass over every channel the block has so far, read from the
growing Concat's buffer (passes/concat_chains.py) where the convolutions left it, out of the cache
by then. One thread cannot draw those reads fast enough; the team that ran the convolution just
before is still spinning, so halving the rows between its members costs a team start, not a thread
wake-up. Small tensors stay on the calling thread (jit.rows_affine), where a team start is most of
the call.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import jit, omp
from .omp import TeamChoice

# From this many elements the team's halves beat one thread's pass, inside a model as alone.
TEAM_MIN_ELEMENTS = 1 << 14

# The block a call hands the team; after it, where only _run reads them, the team's entry points.
_SRC, _STRIDE, _ROWS, _C, _SCALE, _SHIFT, _OUT, _RELU, _NUM_THREADS, _THREAD_NUM, _PLACE, _SIZE = range(12)
_PARALLEL, _MEMBER = _SIZE, _SIZE + 1

AVAILABLE = jit.AVAILABLE and omp.PARALLEL != 0

if AVAILABLE:
    from numba import carray

    def _member(data):  # compiled into a C callable by jit.entry_address
        q = carray(jit.int64s_at(data), (_SIZE,))
        team, me = jit.c_call0(q[_NUM_THREADS]), jit.c_call0(q[_THREAD_NUM])
        omp.apart(q[_PLACE], me)
        rows, c, stride = q[_ROWS], q[_C], q[_STRIDE]
        scale = carray(jit.float32s_at(q[_SCALE]), (c,))
        shift = carray(jit.float32s_at(q[_SHIFT]), (c,))
        src = carray(jit.float32s_at(q[_SRC]), ((rows - 1) * stride + c,))
        out = carray(jit.float32s_at(q[_OUT]), (rows, c))
        floor = np.float32(0.0) if q[_RELU] else np.float32(-np.inf)
        # the one-thread pass's own kernel, on this member's rows: the same bits at every team size
        jit.rows_affine_at(src, stride, scale, shift, floor, out, rows * me // team, rows * (me + 1) // team)

    @jit.njit(cache=True, nogil=True)
    def _run(consts, src, stride, rows, out, threads):
        q = consts.copy()
        q[_SRC], q[_STRIDE], q[_ROWS], q[_OUT] = src.ctypes.data, stride, rows, out.ctypes.data
        jit.c_call4(q[_PARALLEL], q[_MEMBER], q.ctypes.data, threads, 0)
        return q[0]  # a use after the team's: the block lives until the team is done


@functools.cache
def _entry() -> int:
    return jit.entry_address(_member)


class ChannelAffine:
    """One MulAdd node's constants and its team choices (omp.TeamChoice, per input shape)."""

    def __init__(self, scale: np.ndarray, shift: np.ndarray, relu: bool) -> None:
        self.scale = np.ascontiguousarray(scale, np.float32).reshape(-1)
        self.shift = np.ascontiguousarray(shift, np.float32).reshape(-1)
        self.relu = relu
        self._joined: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # per row-joining factor: the block, the vectors it points at
        self._choices: dict[tuple[int, ...], TeamChoice] = {}

    def __call__(self, x: np.ndarray, threads: int | None = None) -> np.ndarray:
        """x * scale + shift (then max(., 0) with relu) for float32 `x` whose last axis is the
        channels; its rows may lie apart in a larger buffer (a growing Concat's). `threads` fixes
        the team size instead of the team choice."""
        c = self.scale.size
        if not AVAILABLE or x.size < TEAM_MIN_ELEMENTS:
            return jit.rows_affine(x, self.scale, self.shift, self.relu)
        spaced = None if x.flags.c_contiguous else jit.row_stride(x)
        if spaced is not None:
            src, stride = x, spaced  # the team reads from x's first element on
            k = 1
        elif x.flags.c_contiguous:
            k = jit.rows_joined(c, x.size // c)  # narrow rows joined into wider ones, so the inner loop vectorizes
            src, stride = x.reshape(-1), c * k
        else:
            return jit.rows_affine(x, self.scale, self.shift, self.relu)
        consts = self._consts(k)
        rows = x.size // (c * k)
        out = np.empty(x.shape, np.float32)
        if threads is not None:
            _run(consts, src, stride, rows, out, threads)
        else:
            omp.timed(omp.choice_for(self._choices, x.shape, keeps_apart=False),
                      lambda n: _run(consts, src, stride, rows, out, n))
        return out

    def _consts(self, k: int) -> np.ndarray:
        found = self._joined.get(k)
        if found is not None:
            return found[0]
        scale, shift = np.tile(self.scale, k), np.tile(self.shift, k)
        q = np.zeros(_SIZE + 2, np.int64)
        q[[_C, _SCALE, _SHIFT, _RELU]] = [scale.size, scale.ctypes.data, shift.ctypes.data, int(self.relu)]
        q[[_NUM_THREADS, _THREAD_NUM, _PLACE, _PARALLEL, _MEMBER]] = [omp.NUM_THREADS, omp.THREAD_NUM, omp.PLACE, omp.PARALLEL, _entry()]
        self._joined[k] = (q, scale, shift)
        return q
