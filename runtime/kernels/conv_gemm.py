"""Convolution as im2col GEMM over cache-sized tiles, the epilogue applied while a tile is hot.

Materializing the whole im2col matrix (9x the input for a 3x3) streams it through DRAM twice; at
batch 32 that left ResNet50's 3x3 convolutions at half the rate of the same GEMM on cached data.
A tile here is a run of whole output rows whose columns fit in about half an L2 cache; pool
workers pull tiles from a shared counter, so an uneven tile count still balances across cores.
Small problems (a few tiles) keep the one-shot GEMM, which splits along output channels instead.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable

import numpy as np

from . import blas, parallel

TILE_BYTES = 3 << 19  # im2col columns per tile: about what stays in L2 across the GEMM
MIN_TILES = 4
MIN_TILE_ROWS = 192  # GEMM rows per tile: fewer and OpenBLAS packs the weights for too little work

RowEpilogue = Callable[[np.ndarray, int, int], None]  # (y2d, first row, end row), in place


def _pull_tiles(n_tiles: int, flops: int, work: Callable[[int], None]) -> None:
    """work(t) for every tile t, by as many pool workers as the FLOPs are worth."""
    counter = itertools.count()  # next() is atomic under the GIL: each tile is taken once

    def pull(_lo: int = 0, _hi: int = 0) -> None:
        while (t := next(counter)) < n_tiles:
            work(t)

    parts = parallel.parts_for(flops, n_tiles)
    if parts == 1:
        pull()
    else:
        parallel.split_range(pull, parts, parts)


def worth_row_tiling(rows: int) -> bool:
    """Whether a pointwise GEMM has rows for two tiles; fewer, and splitting the output channels
    across threads (parallel.matmul) is the better use of the cores."""
    return rows >= 2 * MIN_TILE_ROWS


def tiled_matmul(x2: np.ndarray, w: np.ndarray, epilogue: RowEpilogue | None) -> np.ndarray:
    """x2 (rows, K) @ w (K, O) in row tiles, the epilogue run on each tile while it is in cache
    (a pointwise convolution: no im2col, but one pass less over the output)."""
    rows, k = x2.shape
    o = w.shape[1]
    balanced = -(-rows // (2 * parallel.THREADS))  # at least two tiles per thread when rows allow
    step = max(MIN_TILE_ROWS, min(balanced, TILE_BYTES // max(1, (k + o) * x2.itemsize)))
    y2 = np.empty((rows, o), dtype=np.result_type(x2, w))

    def tile(t: int) -> None:
        r0, r1 = t * step, min(rows, (t + 1) * step)
        blas.gemm(x2[r0:r1], w, y2[r0:r1])
        if epilogue is not None:
            epilogue(y2, r0, r1)

    _pull_tiles(-(-rows // step), 2 * rows * k * o, tile)
    return y2


def _blocks(n: int, oh: int, ow: int, row_bytes: int) -> list[tuple[int, int, int, int]]:
    """(b0, b1, i0, i1) tiles: several whole images when one is small, else bands of rows."""
    rows = max(1, TILE_BYTES // row_bytes, -(-MIN_TILE_ROWS // ow))  # output rows (width ow) per tile
    if rows >= oh:
        per = rows // oh
        return [(b, min(n, b + per), 0, oh) for b in range(0, n, per)]
    return [(b, b + 1, i, min(oh, i + rows)) for b in range(n) for i in range(0, oh, rows)]


def worth_tiling(win: np.ndarray) -> bool:
    """Whether the im2col matrix of this (N, OH, OW, kh, kw, C) window view spans enough tiles."""
    return win.size * win.itemsize >= MIN_TILES * TILE_BYTES


def tiled_conv(win: np.ndarray, w_gemm: np.ndarray, epilogue: RowEpilogue | None) -> np.ndarray:
    """y (N, OH, OW, O) = im2col(win) @ w_gemm, the epilogue run on each tile as it is produced.

    `win` is the (N, OH, OW, kh, kw, C) window view of the padded input (nhwc.windows_hw).
    """
    n, oh, ow = win.shape[:3]
    k, o = w_gemm.shape
    row_bytes = ow * k * win.itemsize
    blocks = _blocks(n, oh, ow, row_bytes)
    y = np.empty((n, oh, ow, o), dtype=np.result_type(win, w_gemm))
    y2 = y.reshape(-1, o)
    tile_rows = max((b1 - b0) * (i1 - i0) for b0, b1, i0, i1 in blocks) * ow
    buffers: dict[int, np.ndarray] = {}  # one column buffer per worker thread

    def tile(t: int) -> None:
        buf = buffers.get(threading.get_ident())
        if buf is None:
            buf = buffers[threading.get_ident()] = np.empty(tile_rows * k, dtype=win.dtype)
        b0, b1, i0, i1 = blocks[t]
        view = win[b0:b1, i0:i1]
        rows = view.shape[0] * view.shape[1] * ow
        cols = buf[: rows * k]
        np.copyto(cols.reshape(view.shape), view)
        r0 = (b0 * oh + i0) * ow
        blas.gemm(cols.reshape(rows, k), w_gemm, y2[r0:r0 + rows])
        if epilogue is not None:
            epilogue(y2, r0, r0 + rows)

    _pull_tiles(len(blocks), 2 * n * oh * ow * k * o, tile)
    return y
