"""3x3 stride-1 float32 convolutions as Winograd F(4x4, 3x3): a quarter of the multiply-adds.

Why: a direct 3x3 convolution spends 144 multiply-adds per input channel on a 4x4 patch of
results; Winograd's minimal filtering spends 36, in 36 independent matrix products, at the price
of transforming each 6x6 input patch before and each 6x6 product after (adds and a few small
constants, computed once per patch and channel). ResNet's 3x3 layers run on oneDNN's direct
kernels near the cores' peak, so fewer multiply-adds is what is left to gain there.

How: the weights are transformed once (U = G g Gᵀ, float64 then float32) and laid out as 36
matrices (C, O). A call cuts the image's 4x4 result tiles into blocks; each team member takes
blocks in turn and, per block: transforms its tiles' input patches into V (36, tiles, C) in its
own scratch, multiplies V by U with a one-thread oneDNN batched matmul, and transforms the
products back into its result tiles (Aᵀ m A), adding the bias and clamping (ReLU, ReLU6, none)
on the way out. Padding is the convolution's: patch values outside the image read as zero, and
result pixels beyond the image are not stored. A pooled call (passes/conv_pool.py) stores each
tile's 2x2 maxima instead of its 16 results.

The transform's constants grow the rounding error by about a digit over the direct kernel's;
float32 stays within the host tolerance the numerics tests hold every layer to.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, Mapping

import numpy as np

from . import jit, omp, onednn
from .activations import Eltwise
from .buffers import aligned
from .primitive_chain import KernelCall, in_line
from .settings import switched_on

WINOGRAD_ENV = "KUBETRT_WINOGRAD"
TILE, PATCH = 4, 6  # results per tile side, input patch side (TILE + 3 - 1)
# A block's tiles: its V and M scratch (36 x tiles x (C + O) floats) fits about this much of a
# core's cache, within bounds the batched matmul still runs near its peak at.
BLOCK_BYTES = 1 << 20
MIN_BLOCK_TILES, MAX_BLOCK_TILES = 16, 128
# Below these the direct kernel wins. Few tiles: the members stream all 36 transformed weight
# matrices, four times the direct kernel's weights, for few rows; within a model the weights come
# from memory, not cache, so a layer alone can mislead (ResNet-50's 14x14x256 layers, 16 tiles,
# ran 1.3x faster alone and made the model 2% slower). Few input channels: the transforms' work
# per tile grows with the channels, the products' with their square; from 16 inputs the products
# saved still outweigh the transforms (a CNN's 16->32 and 32->64 layers gained within the model,
# AVX2 and AVX-512 alike), and only a first layer's RGB input has fewer.
MIN_TILES = 32
MIN_CHANNELS = 16
MAX_CHANNELS = 512  # input and output channels: the transforms' stack arrays hold 36 rows of this many (74 KB)

_BT = np.array([[4, 0, -5, 0, 1, 0],
                [0, -4, -4, 1, 1, 0],
                [0, 4, -4, -1, 1, 0],
                [0, -2, -1, 2, 1, 0],
                [0, 2, -1, -2, 1, 0],
                [0, 4, 0, -5, 0, 1]], dtype=np.float64)
_G = np.array([[1 / 4, 0, 0],
               [-1 / 6, -1 / 6, -1 / 6],
               [-1 / 6, 1 / 6, -1 / 6],
               [1 / 24, 1 / 12, 1 / 6],
               [1 / 24, -1 / 12, 1 / 6],
               [0, 0, 1]], dtype=np.float64)
_AT = np.array([[1, 1, 1, 1, 1, 0],
                [0, 1, -1, 2, -2, 0],
                [0, 1, 1, 4, 4, 0],
                [0, 1, -1, 8, -8, 1]], dtype=np.float64)


def _u(w: np.ndarray) -> np.ndarray:
    """U = G g Gᵀ for every (output, input) channel pair of OIHW 3x3 weights: (6, 6, C, O), float64."""
    return np.einsum("ik,ockl,jl->ijco", _G, w.astype(np.float64), _G)


def transformed_weights(w: np.ndarray) -> np.ndarray:
    """The kernel's weights: U as 36 float32 (C, O) matrices."""
    return np.ascontiguousarray(_u(w).reshape(PATCH * PATCH, w.shape[1], w.shape[0]), dtype=np.float32)


def reference(x: np.ndarray, w: np.ndarray, pad_top: int, pad_left: int, oh: int, ow: int) -> np.ndarray:
    """The same algorithm in NumPy, float64 throughout, tile by tile: equal to a direct
    convolution but for rounding, which is what shows its transforms are right."""
    n, h, wd, c = x.shape
    th, tw = -(-oh // TILE), -(-ow // TILE)
    xp = np.zeros((n, th * TILE + 2, tw * TILE + 2, c))
    rows, cols = min(h, th * TILE + 2 - pad_top), min(wd, tw * TILE + 2 - pad_left)
    xp[:, pad_top:pad_top + rows, pad_left:pad_left + cols] = x[:, :rows, :cols]
    u = _u(w)
    y = np.zeros((n, th * TILE, tw * TILE, u.shape[-1]))
    for i in range(th):
        for j in range(tw):
            d = xp[:, i * TILE:i * TILE + PATCH, j * TILE:j * TILE + PATCH]  # n, 6, 6, c
            v = np.einsum("ik,nklc,jl->nijc", _BT, d, _BT)
            m = np.einsum("nijc,ijco->nijo", v, u)
            y[:, i * TILE:(i + 1) * TILE, j * TILE:(j + 1) * TILE] = np.einsum("ik,nklo,jl->nijo", _AT, m, _AT)
    return y[:, :oh, :ow]


def tiles_of(n: int, oh: int, ow: int) -> int:
    """Result tiles of a batch of n (oh, ow) results."""
    return n * -(-oh // TILE) * -(-ow // TILE)


def block_tiles(c: int, o: int, tiles: int, members: int) -> int:
    """Tiles per block for c input and o output channels: the cache's share, evened out so the
    members get as many blocks each."""
    most = max(MIN_BLOCK_TILES, min(MAX_BLOCK_TILES, BLOCK_BYTES // (PATCH * PATCH * 4 * (c + o))))
    blocks = -(-tiles // most)
    blocks = -(-blocks // members) * members
    return -(-tiles // blocks)


def winograd_enabled(env: Mapping[str, str]) -> bool:
    """WINOGRAD_ENV: 1 (the default) runs 3x3 layers with enough tiles as Winograd's, 0 never does."""
    return switched_on(env, WINOGRAD_ENV, "Winograd's form for 3x3 layers where it gains")


# The block a chain hands the team: source and destination (written per call), the addresses
# members call, the geometry, the bias followed by the clamp's bounds, the members' table, and
# whether the results are max-pooled 2x2 on their way out.
# A member's row: its stream, its V and M, then per matmul (full block, last block): primitive,
# argument count, packed arguments.
(_SRC, _DST, _NUM_THREADS, _THREAD_NUM, _PLACE, _EXECUTE, _WAIT, _N, _H, _W, _C, _O, _OH, _OW, _PAD_TOP, _PAD_LEFT,
 _TILES, _BLOCK_TILES, _BIAS, _TABLE, _POOL, _HEAD) = range(22)
_STREAM, _V, _M, _FULL, _LAST = 0, 1, 2, 3, 6
_ROW = 9


if jit.AVAILABLE:
    from llvmlite import ir
    from numba import carray, types
    from numba.core import cgutils
    from numba.extending import intrinsic
    from numba.np.arrayobj import make_array, populate_array

    @intrinsic
    def _stack_rows(typingctx: Any, count: Any) -> Any:
        """A (count, MAX_CHANNELS) float32 array on the caller's stack (count a literal). Its
        memory is known to alias nothing else, so a loop that reads x (or writes V) and writes
        (or reads) it needs no run-time overlap check to vectorize."""
        if not isinstance(count, types.IntegerLiteral):
            return None
        rows = count.literal_value
        array_type = types.Array(types.float32, 2, "C")

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f32 = ir.FloatType()
            intp = context.get_value_type(types.intp)
            # an alloca of n floats, not of an [n x float]: LLVM then never tries to split it up
            data = cgutils.alloca_once(builder, f32, size=ir.Constant(intp, rows * MAX_CHANNELS))
            data.align = 64
            cells = make_array(array_type)(context, builder)
            populate_array(cells, data=data, shape=[ir.Constant(intp, rows), ir.Constant(intp, MAX_CHANNELS)],
                           strides=[ir.Constant(intp, 4 * MAX_CHANNELS), ir.Constant(intp, 4)],
                           itemsize=ir.Constant(intp, 4), meminfo=None)
            return cells._getvalue()

        return array_type(count), codegen

    # Inner loops run along the channels; x, V, M and y are read and written through views made
    # from addresses (jit.float32_view), the transform's middle step through stack arrays.
    _view = jit.float32_view

    @jit.njit(cache=True, nogil=True, inline="always", fastmath=True)
    def _b_t(u0, u1, u2, u3, u4, u5):
        """Bᵀ u for one channel's six values."""
        return (4.0 * u0 - 5.0 * u2 + u4, -4.0 * (u1 + u2) + u3 + u4, 4.0 * (u1 - u2) - u3 + u4,
                2.0 * (u3 - u1) - u2 + u4, 2.0 * (u1 - u3) - u2 + u4, 4.0 * u1 - 5.0 * u3 + u5)

    @jit.njit(cache=True, nogil=True, inline="always", fastmath=True)
    def _a_t(m0, m1, m2, m3, m4, m5):
        """Aᵀ m for one channel's six values."""
        a, d = m1 + m2, m1 - m2
        e, f = m3 + m4, m3 - m4
        return (m0 + a + e, d + 2.0 * f, a + 4.0 * e, d + 8.0 * f + m5)

    @jit.njit(cache=True, nogil=True, inline="always", fastmath=True)
    def _b_t_into(u0, u1, u2, u3, u4, u5, o, first, k):
        """Bᵀ u at channel k into rows first..first + 5 of the stack array o."""
        o[first, k], o[first + 1, k], o[first + 2, k], o[first + 3, k], o[first + 4, k], o[first + 5, k] = _b_t(u0, u1, u2, u3, u4, u5)

    @jit.njit(cache=True, nogil=True, fastmath=True)
    def _patches_in(x, v, t0, t1, rows, h, wd, c, th, tw, pad_top, pad_left):
        """V[e, q, :] for the tiles t0..t1 (q = t - t0) of NHWC x (addresses both): Bᵀ d B, with
        d the tile's 6x6 input patch, zero outside the image."""
        per_image = th * tw
        cols = _stack_rows(36)  # Bᵀ d: row s * 6 + i holds (Bᵀ d)[i, s]
        patch = _stack_rows(6)  # a column of the patch, at an edge
        step = rows * c
        for t in range(t0, t1):
            q = t - t0
            img, rest = t // per_image, t % per_image
            y0, x0 = (rest // tw) * TILE - pad_top, (rest % tw) * TILE - pad_left
            inside = 0 <= y0 and y0 + PATCH <= h and 0 <= x0 and x0 + PATCH <= wd
            for s in range(PATCH):  # Bᵀ d, column by column
                xx = x0 + s
                if inside:
                    at, down = ((img * h + y0) * wd + xx) * c, wd * c
                    r0, r1, r2 = _view(x, at, c), _view(x, at + down, c), _view(x, at + 2 * down, c)
                    r3, r4, r5 = _view(x, at + 3 * down, c), _view(x, at + 4 * down, c), _view(x, at + 5 * down, c)
                    for k in range(c):
                        _b_t_into(r0[k], r1[k], r2[k], r3[k], r4[k], r5[k], cols, s * PATCH, k)
                else:  # at an edge: rows or the column outside the image read as zero
                    for r in range(PATCH):
                        yy = y0 + r
                        if 0 <= yy < h and 0 <= xx < wd:
                            src = _view(x, ((img * h + yy) * wd + xx) * c, c)
                            for k in range(c):
                                patch[r, k] = src[k]
                        else:
                            for k in range(c):
                                patch[r, k] = 0.0
                    for k in range(c):
                        _b_t_into(patch[0, k], patch[1, k], patch[2, k], patch[3, k], patch[4, k], patch[5, k], cols, s * PATCH, k)
            for i in range(PATCH):  # (Bᵀ d) B, row by row, into row q of the 36 matrices
                at = (i * PATCH * rows + q) * c
                o0, o1, o2 = _view(v, at, c), _view(v, at + step, c), _view(v, at + 2 * step, c)
                o3, o4, o5 = _view(v, at + 3 * step, c), _view(v, at + 4 * step, c), _view(v, at + 5 * step, c)
                for k in range(c):
                    o0[k], o1[k], o2[k], o3[k], o4[k], o5[k] = _b_t(cols[i, k], cols[PATCH + i, k], cols[2 * PATCH + i, k],
                                                                    cols[3 * PATCH + i, k], cols[4 * PATCH + i, k], cols[5 * PATCH + i, k])

    @jit.njit(cache=True, nogil=True, inline="always", fastmath=True)
    def _a_t_columns(m, cols, q, rows, o):
        """Aᵀ m of tile q of a block of `rows` tiles, column by column, into the stack array cols:
        row p * 6 + s holds (Aᵀ m)[p, s]."""
        step = PATCH * rows * o
        for s in range(PATCH):
            at = (s * rows + q) * o
            m0, m1, m2 = _view(m, at, o), _view(m, at + step, o), _view(m, at + 2 * step, o)
            m3, m4, m5 = _view(m, at + 3 * step, o), _view(m, at + 4 * step, o), _view(m, at + 5 * step, o)
            for k in range(o):
                cols[s, k], cols[PATCH + s, k], cols[2 * PATCH + s, k], cols[3 * PATCH + s, k] = _a_t(m0[k], m1[k], m2[k], m3[k], m4[k], m5[k])

    @jit.njit(cache=True, nogil=True, fastmath=True)
    def _tiles_out(m, y, bias, t0, t1, rows, o, oh, ow, th, tw, lo, hi):
        """Result tiles t0..t1 of NHWC y from M[e, q, :] (addresses all): Aᵀ m A, the bias added
        and clamped to [lo, hi]."""
        per_image = th * tw
        cols = _stack_rows(24)  # Aᵀ m: row p * 6 + s holds (Aᵀ m)[p, s]
        b = _view(bias, 0, o)
        for t in range(t0, t1):
            q = t - t0
            img, rest = t // per_image, t % per_image
            y0, x0 = (rest // tw) * TILE, (rest % tw) * TILE
            _a_t_columns(m, cols, q, rows, o)
            width = min(TILE, ow - x0)
            for p in range(min(TILE, oh - y0)):  # (Aᵀ m) A, row by row, into the image
                at, r = ((img * oh + y0 + p) * ow + x0) * o, p * PATCH
                if width == TILE:
                    y0_, y1_, y2_, y3_ = _view(y, at, o), _view(y, at + o, o), _view(y, at + 2 * o, o), _view(y, at + 3 * o, o)
                    for k in range(o):
                        v0, v1, v2, v3 = _a_t(cols[r, k], cols[r + 1, k], cols[r + 2, k], cols[r + 3, k], cols[r + 4, k], cols[r + 5, k])
                        bk = b[k]
                        y0_[k] = min(max(v0 + bk, lo), hi)
                        y1_[k] = min(max(v1 + bk, lo), hi)
                        y2_[k] = min(max(v2 + bk, lo), hi)
                        y3_[k] = min(max(v3 + bk, lo), hi)
                else:  # at the right edge: the (at most three) pixels inside the image
                    for j in range(width):
                        out = _view(y, at + j * o, o)
                        for k in range(o):
                            v0, v1, v2, _ = _a_t(cols[r, k], cols[r + 1, k], cols[r + 2, k], cols[r + 3, k], cols[r + 4, k], cols[r + 5, k])
                            out[k] = min(max((v0 if j == 0 else v1 if j == 1 else v2) + b[k], lo), hi)

    @jit.njit(cache=True, nogil=True, fastmath=True)
    def _tiles_pooled(m, y, bias, t0, t1, rows, o, oh, ow, th, tw, lo, hi):
        """Result tiles t0..t1 as _tiles_out makes them, each 2x2 square of results max-pooled into
        NHWC y (n, oh // 2, ow // 2, o). oh and ow are even, so every square lies in one tile. The
        bias and the clamp go after the maximum: both keep the order of values, so the result is
        the same as pooling the clamped results."""
        per_image = th * tw
        cols = _stack_rows(24)
        b = _view(bias, 0, o)
        ph, pw = oh // 2, ow // 2
        for t in range(t0, t1):
            q = t - t0
            img, rest = t // per_image, t % per_image
            y0, x0 = (rest // tw) * TILE, (rest % tw) * TILE
            _a_t_columns(m, cols, q, rows, o)
            for pr in range(min(2, (oh - y0) // 2)):  # a pooled row from each pair of result rows
                at = ((img * ph + y0 // 2 + pr) * pw + x0 // 2) * o
                r, u = 2 * pr * PATCH, (2 * pr + 1) * PATCH
                left = _view(y, at, o)
                if x0 + TILE <= ow:
                    right = _view(y, at + o, o)
                    for k in range(o):
                        a0, a1, a2, a3 = _a_t(cols[r, k], cols[r + 1, k], cols[r + 2, k], cols[r + 3, k], cols[r + 4, k], cols[r + 5, k])
                        c0, c1, c2, c3 = _a_t(cols[u, k], cols[u + 1, k], cols[u + 2, k], cols[u + 3, k], cols[u + 4, k], cols[u + 5, k])
                        bk = b[k]
                        left[k] = min(max(max(max(a0, a1), max(c0, c1)) + bk, lo), hi)
                        right[k] = min(max(max(max(a2, a3), max(c2, c3)) + bk, lo), hi)
                else:  # at the right edge: one pooled column
                    for k in range(o):
                        a0, a1, _, _ = _a_t(cols[r, k], cols[r + 1, k], cols[r + 2, k], cols[r + 3, k], cols[r + 4, k], cols[r + 5, k])
                        c0, c1, _, _ = _a_t(cols[u, k], cols[u + 1, k], cols[u + 2, k], cols[u + 3, k], cols[u + 4, k], cols[u + 5, k])
                        left[k] = min(max(max(max(a0, a1), max(c0, c1)) + b[k], lo), hi)

    def _member(data):  # compiled into a C callable by jit.entry_address
        head = carray(jit.int64s_at(data), (_HEAD,))
        team, me = jit.c_call0(head[_NUM_THREADS]), jit.c_call0(head[_THREAD_NUM])
        omp.apart(head[_PLACE], me)
        n, h, wd, c, o = head[_N], head[_H], head[_W], head[_C], head[_O]
        oh, ow = head[_OH], head[_OW]
        th, tw = (oh + TILE - 1) // TILE, (ow + TILE - 1) // TILE
        tiles, per_block = head[_TILES], head[_BLOCK_TILES]
        bounds = _view(head[_BIAS], o, 2)
        lo, hi = bounds[0], bounds[1]
        mine = carray(jit.int64s_at(head[_TABLE] + me * _ROW * 8), (_ROW,))
        blocks = (tiles + per_block - 1) // per_block
        for b in range(me, blocks, team):
            t0 = b * per_block
            t1 = min(t0 + per_block, tiles)
            rows = per_block if t1 - t0 == per_block else t1 - t0
            at = _FULL if rows == per_block else _LAST
            _patches_in(head[_SRC], mine[_V], t0, t1, rows, h, wd, c, th, tw, head[_PAD_TOP], head[_PAD_LEFT])
            jit.c_call4(head[_EXECUTE], mine[at], mine[_STREAM], mine[at + 1], mine[at + 2])
            jit.c_call1(head[_WAIT], mine[_STREAM])
            if head[_POOL]:
                _tiles_pooled(mine[_M], head[_DST], head[_BIAS], t0, t1, rows, o, oh, ow, th, tw, lo, hi)
            else:
                _tiles_out(mine[_M], head[_DST], head[_BIAS], t0, t1, rows, o, oh, ow, th, tw, lo, hi)


BIG = float(np.finfo(np.float32).max)  # "no bound": finite, as fast-math code may assume no infinities
CLAMPS = {"": (-BIG, BIG), "eltwise_relu": (0.0, BIG)}  # activations as clamps; clip's come from its bounds


def clamp_of(activation: Eltwise | None) -> tuple[float, float] | None:
    """The activation as a clamp to [lo, hi], or None where it is not one (a leaky ReLU, swish)."""
    kind, alpha, beta = activation if activation is not None else ("", 0.0, 0.0)
    if kind in ("eltwise_clip", "eltwise_clip_v2"):
        return (alpha, beta)
    if kind == "eltwise_relu" and alpha != 0.0:
        return None
    return CLAMPS.get(kind)


def applies(w: np.ndarray, group: int, strides: list[int], dil: list[int], activation: Eltwise | None,
            residual: bool) -> bool:
    """Whether a convolution has Winograd's form here: float32 3x3, stride and dilation 1, one
    group, MIN_CHANNELS to MAX_CHANNELS inputs and at most MAX_CHANNELS outputs, no residual
    sum, and an activation that is a clamp."""
    o, c, kh, kw = w.shape
    return (AVAILABLE and w.dtype == np.float32 and (kh, kw) == (3, 3) and group == 1 and list(strides) == [1, 1]
            and list(dil) == [1, 1] and MIN_CHANNELS <= c <= MAX_CHANNELS and o <= MAX_CHANNELS and not residual
            and clamp_of(activation) is not None)


def for_conv(conv: onednn.Conv2D) -> "WinogradConv | None":
    """The Winograd form of a oneDNN convolution (its weights, bias and activation), where it applies."""
    if conv.quant is not None or not applies(conv.w, conv.group, conv.strides, conv.dil, conv.activation, conv.residual):
        return None
    return WinogradConv(conv.w, conv.bias, conv.activation, conv.name)


class WinogradConv:
    """One convolution's Winograd form: its transformed weights as a batched matmul, and its bias
    with the clamp's bounds (see the module's docstring)."""

    def __init__(self, w: np.ndarray, bias: np.ndarray | None, activation: Eltwise | None, name: str) -> None:
        clamp = clamp_of(activation)
        if clamp is None:
            raise ValueError(f"Conv {name}: activation {activation} is not a clamp; Winograd's form takes ReLU, clip or none")
        self.o, self.c = w.shape[:2]
        self.name, self.w = name, w
        consts = np.zeros(self.o + 2, np.float32)
        if bias is not None:
            consts[:self.o] = bias
        consts[self.o:] = clamp
        self.consts = consts

    @functools.cached_property
    def matmul(self) -> onednn.BatchedMatmul:
        """The transformed weights' products, made when a shape first takes this form: a layer
        that never does (too few tiles at its batch) holds no second copy of its weights."""
        return onednn.BatchedMatmul(transformed_weights(self.w), name=f"{self.name}/winograd")

    def call(self, x_shape: tuple[int, ...], oh: int, ow: int, pad_top: int, pad_left: int, pool: bool = False) -> KernelCall:
        """The chain's call for NHWC inputs of `x_shape`, writing (n, oh, ow, o); with `pool`, the
        results max-pooled 2x2 with stride 2, (n, oh // 2, ow // 2, o), for even oh and ow."""
        n, h, wd, c = x_shape
        if c != self.c:
            raise ValueError(f"Conv {self.name}: input has {c} channels, weights expect {self.c}")
        if pool and not pools(oh, ow):
            raise ValueError(f"Conv {self.name}: a 2x2 pooling of {oh}x{ow} results needs even sides")
        tiles = tiles_of(n, oh, ow)
        per_block = block_tiles(self.c, self.o, tiles, omp.TEAM)
        last = tiles % per_block
        sizes = [per_block] + ([last] if last else [])

        def block() -> tuple[np.ndarray, Any]:
            made = [self.matmul.primitive_for(rows) for rows in sizes]
            members = omp.TEAM
            table = np.zeros((members, _ROW), np.int64)
            kept: list[Any] = [table, self.consts, made]
            for row in table:
                v = aligned(PATCH * PATCH * per_block * self.c * 4)
                m = aligned(PATCH * PATCH * per_block * self.o * 4)
                stream = onednn.Stream()
                kept += [v, m, stream]
                row[_STREAM], row[_V], row[_M] = stream.handle.value or 0, v.ctypes.data, m.ctypes.data
                for at, (prim, consts, _) in zip((_FULL, _LAST), made):
                    pad = aligned(prim.scratch_bytes) if prim.scratch_bytes else None
                    args = onednn.Arguments(prim, [v.ctypes.data, m.ctypes.data, *consts], pad, stream)
                    kept += [pad, args]
                    row[at:at + 3] = [prim.handle.value or 0, len(args.packed), ctypes.addressof(args.packed)]
            head = np.zeros(_HEAD, np.int64)
            head[_NUM_THREADS:_WAIT + 1] = [omp.NUM_THREADS, omp.THREAD_NUM, omp.PLACE, onednn.C_FUNCTIONS[1], onednn.C_FUNCTIONS[2]]
            head[_N:_BLOCK_TILES + 1] = [n, h, wd, c, self.o, oh, ow, pad_top, pad_left, tiles, per_block]
            head[_BIAS], head[_TABLE], head[_POOL] = self.consts.ctypes.data, table.ctypes.data, int(pool)
            return head, kept

        shape = (n, oh // 2, ow // 2, self.o) if pool else (n, oh, ow, self.o)
        return KernelCall(jit.entry_address(_member), block, _SRC, _DST, shape, team=True)

    def site(self, x_shape: tuple[int, ...], oh: int, ow: int, pad_top: int, pad_left: int, pool: bool = False) -> "WinogradSite":
        """This convolution for NHWC inputs of one shape (`pool`: as `call` says): what a kernel
        keeps per shape it sees."""
        return WinogradSite(self, x_shape, self.call(x_shape, oh, ow, pad_top, pad_left, pool))


class WinogradSite:
    """A WinogradConv bound to one input shape: `kernel` is what a chain calls; called alone it
    runs as a chain of that one call (the team or one thread, whichever is faster lately)."""

    def __init__(self, conv: WinogradConv, x_shape: tuple[int, ...], kernel: KernelCall) -> None:
        self.kernel, self.shape, self.x_shape, self.name = kernel, kernel.shape, tuple(x_shape), conv.name
        self._chain = in_line([kernel], self.x_shape, kernel.shape, self._other_input, conv.name)

    def _other_input(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        raise ValueError(f"Conv {self.name}: bound to float32 inputs of shape {list(self.x_shape)}, got {x.dtype}{list(x.shape)}")

    def __call__(self, x: np.ndarray, residual: None = None, overwrite_residual: bool = False) -> np.ndarray:
        return self._chain(x)[0]


def pools(oh: int, ow: int) -> bool:
    """Whether the results' 2x2 max pooling (stride 2, no padding) can be made in the tiles: with
    even sides every pooling window lies in one tile, and none is left over at an edge."""
    return oh % 2 == 0 and ow % 2 == 0


def worth(x_shape: tuple[int, ...], oh: int, ow: int) -> bool:
    """Whether Winograd's form gains on inputs of this shape: NHWC, with MIN_TILES tiles or more."""
    return ENABLED and len(x_shape) == 4 and tiles_of(x_shape[0], oh, ow) >= MIN_TILES


AVAILABLE = jit.AVAILABLE and onednn.AVAILABLE and omp.PARALLEL != 0
ENABLED = AVAILABLE and winograd_enabled(os.environ)
