"""Convolution as im2col GEMM over cache-sized tiles, the epilogue applied while a tile is hot.

Materializing the whole im2col matrix (9x the input for a 3x3) streams it through DRAM twice; at
batch 32 that left ResNet50's 3x3 convolutions at half the rate of the same GEMM on cached data.
A tile here is a run of whole output rows whose columns fit in about half an L2 cache; pool
workers pull tiles from a shared counter, so an uneven tile count still balances across cores.
Small problems (a few tiles) keep the one-shot GEMM, which splits along output channels instead.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from . import parallel

TILE_BYTES = 3 << 19  # 1.5 MiB of im2col columns per tile (bench: 1-2 MiB best on 3x3 layers)
MIN_TILES = 4
MIN_TILE_ROWS = 192  # GEMM rows per tile: fewer and OpenBLAS packs the weights for too little work

RowEpilogue = Callable[[np.ndarray, int, int], None]  # (y2d, first row, end row), in place


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
    counter = itertools.count()  # next() is atomic under the GIL: each tile is taken once

    def pull(_lo: int = 0, _hi: int = 0) -> None:
        buf = np.empty(tile_rows * k, dtype=win.dtype)
        while (t := next(counter)) < len(blocks):
            b0, b1, i0, i1 = blocks[t]
            view = win[b0:b1, i0:i1]
            rows = view.shape[0] * view.shape[1] * ow
            cols = buf[: rows * k]
            np.copyto(cols.reshape(view.shape), view)
            r0 = (b0 * oh + i0) * ow
            np.matmul(cols.reshape(rows, k), w_gemm, out=y2[r0:r0 + rows])
            if epilogue is not None:
                epilogue(y2, r0, r0 + rows)

    parts = parallel.parts_for(2 * n * oh * ow * k * o, len(blocks))
    if parts == 1:
        pull()
    else:
        parallel.split_range(pull, parts, parts)
    return y
