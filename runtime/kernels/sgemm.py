"""float32 dense layers, act(a @ W + bias [+ residual]) with W constant, on the runtime's own
register-tiled kernel and the OpenMP team.

Why, beside oneDNN's inner product: at a few rows (batch 1, a short sequence) a layer takes a
few microseconds, and a oneDNN primitive call's fixed costs and its GEMV lose to this kernel
there, as do NumPy's matmul and separate epilogue on a classifier head (the MLP, the small CNN
and the transformer at batch 1 in bench/runtime.py); at more rows oneDNN keeps up or leads, so
the runtime picks by row count (MAX_ROWS). Without oneDNN it runs every float32 dense layer.

How: W is packed once into panels of NR columns, each panel (K, NR) contiguous and zero-padded.
A call computes MR x NR tiles of the output whose accumulators stay in registers: the tile is a
stack array, which LLVM promotes (a heap array would be re-read and re-written every step of K).
The sums start from the bias and the residual, and the activation (a numba scalar form) is
applied to the tile before it is stored. Threads take contiguous ranges of (row block, panel)
tiles. The team is started from jitted code with GOMP_parallel, on the worker threads oneDNN's
calls use, and sized per shape by omp.TeamChoice. The panels are made on a layer's first call
here: where oneDNN takes every call (larger batches), the weights are not held twice. Layers that
feed only each other (passes/chains.py) run as one PackedChain call: one team, a barrier between
layers, the layers' packed panels read through their constant blocks.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import activations, jit, omp
from .buffers import aligned_empty
from .jit import SCALAR_CLAMP, SCALAR_GELU
from .omp import TeamChoice
from .primitive_chain import KernelCall

MR, NR = 4, 16  # a tile: rows x columns (two AVX2 vectors), eight accumulators in flight
# Up to this many rows (a batch-1 request, a short sequence) this kernel runs a layer where
# oneDNN is installed; beyond it oneDNN's inner product keeps up or leads inside a plan.
MAX_ROWS = 16
_F32 = np.dtype(np.float32)

# The block of int64 words each call hands the team, and the kernel's constant block it points to.
_CONSTS, _A, _C, _RES, _M, _HAS_RES = range(6)
_PANELS, _BIAS, _BOUNDS, _FORM, _K, _N, _P, _THREAD_NUM, _NUM_THREADS, _PARALLEL, _MEMBER, _PLACE = range(12)
# A chain's call block, and its constant block: a header, then each layer's constant block's address.
_CHAIN_HEAD, _CHAIN_A, _CHAIN_C, _CHAIN_SCRATCH, _CHAIN_M = range(5)
_LAYERS, _H_THREAD_NUM, _H_NUM_THREADS, _H_PARALLEL, _H_MEMBER, _H_BARRIER, _H_SOFTMAX, _H_SCALE, _H_PLACE, _HEADER = range(10)
_NO_SOFTMAX, _SOFTMAX, _LOG_SOFTMAX = range(3)

AVAILABLE = jit.AVAILABLE and omp.PARALLEL != 0

if jit.numba is not None:
    from llvmlite import ir
    from numba import carray, types
    from numba.core import cgutils
    from numba.extending import intrinsic
    from numba.np.arrayobj import make_array, populate_array

    @intrinsic
    def stack_tile(typingctx: Any) -> Any:
        """An (MR, NR) float32 array on the caller's stack."""
        tile_type = types.Array(types.float32, 2, "C")

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f32 = ir.FloatType()
            data = builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(f32, MR * NR)), f32.as_pointer())
            intp = context.get_value_type(types.intp)
            tile = make_array(tile_type)(context, builder)
            populate_array(tile, data=data, shape=[ir.Constant(intp, MR), ir.Constant(intp, NR)],
                           strides=[ir.Constant(intp, 4 * NR), ir.Constant(intp, 4)],
                           itemsize=ir.Constant(intp, 4), meminfo=None)
            return tile._getvalue()

        return tile_type(), codegen

    from .jit import float32s_at, int64s_at

    # The tile's first and last steps touch memory through views made from addresses, starting
    # at the tile's first column (jit.float32_view): a slice costs a bounds normalization per tile.

    @jit.njit(cache=True, nogil=True, inline="always")
    def _segment(at, row, n, j0, width):
        """Columns [j0, j0 + width) of one row of a C-contiguous float32 (?, n) array at address `at`."""
        return jit.float32_view(at, row * n + j0, width)

    # The accumulator tile is only ever indexed by loops of constant length (MR, NR), which LLVM
    # keeps in registers; a partial tile at the edge of the output goes through a second stack
    # tile, `edge`, which takes the loops of variable length.

    @jit.njit(cache=True, nogil=True, inline="always")
    def _start(acc, edge, rows, cols, res_at, bias_at, n, i0, j0, has_res):
        # The sums start from the bias (and the residual): adding them later would read and
        # write the stored tile again.
        b = _segment(bias_at, 0, 0, j0, NR)
        if not has_res:
            for r in range(MR):
                for j in range(NR):
                    acc[r, j] = b[j]
        elif rows == MR and cols == NR:
            for r in range(MR):
                src = _segment(res_at, i0 + r, n, j0, NR)
                for j in range(NR):
                    acc[r, j] = b[j] + src[j]
        else:
            for r in range(MR):
                for j in range(NR):
                    edge[r, j] = 0.0
            for r in range(rows):
                src = _segment(res_at, i0 + r, n, j0, cols)
                for j in range(cols):
                    edge[r, j] = src[j]
            for r in range(MR):
                for j in range(NR):
                    acc[r, j] = b[j] + edge[r, j]
        if rows == 1:  # the one-row path's partial sums
            for r in range(1, MR):
                for j in range(NR):
                    acc[r, j] = 0.0

    @jit.njit(cache=True, nogil=True, inline="always")
    def _finish(acc, edge, rows, cols, c_at, n, i0, j0, form, lo, hi):
        if form == SCALAR_CLAMP:
            for r in range(MR):
                for j in range(NR):
                    acc[r, j] = jit.clamp(acc[r, j], lo, hi)
        elif form == SCALAR_GELU:
            for r in range(MR):
                for j in range(NR):
                    acc[r, j] = jit.gelu_erf(acc[r, j])
        if rows == MR and cols == NR:
            for r in range(MR):
                dst = _segment(c_at, i0 + r, n, j0, NR)
                for j in range(NR):
                    dst[j] = acc[r, j]
        else:
            for r in range(MR):
                for j in range(NR):
                    edge[r, j] = acc[r, j]
            for r in range(rows):
                dst = _segment(c_at, i0 + r, n, j0, cols)
                for j in range(cols):
                    dst[j] = edge[r, j]

    @jit.njit(cache=True, nogil=True, inline="always", fastmath={"contract"})
    def tile_step(acc, a0, a1, a2, a3, panels, p, kk):
        """One step of K for a tile of four rows: acc[r] += a_r * panel p's row kk."""
        for j in range(NR):
            w = panels[p, kk, j]
            acc[0, j] += a0 * w
            acc[1, j] += a1 * w
            acc[2, j] += a2 * w
            acc[3, j] += a3 * w

    @jit.njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
    def _tiles(a, panels, c, res, bias, has_res, form, lo, hi, start, stop):
        # Task t is a (panel, row block) pair, row blocks innermost: a member's share is a run of
        # panels, each read from memory once and kept in cache while every row block passes it,
        # and the rows (m x k, a few tens of KB) are re-read from L2. Blocks outermost re-read the
        # whole weight matrix once per block: as fast while it fits in L2, slower once it does not
        # (an L2 of half a megabyte meets that at a 512 x 512 layer).
        m, k = a.shape
        n = c.shape[1]
        k4 = k - k % 4
        c_at, res_at, bias_at = c.ctypes.data, res.ctypes.data, bias.ctypes.data
        acc, edge = stack_tile(), stack_tile()
        blocks = (m + MR - 1) // MR
        p, block = start // blocks, start % blocks
        for _ in range(start, stop):
            i0 = block * MR
            rows = min(MR, m - i0)
            j0 = p * NR
            cols = min(NR, n - j0)
            _start(acc, edge, rows, cols, res_at, bias_at, n, i0, j0, has_res)
            # Plain indexing only: a view (a row, a panel) made inside these loops costs a
            # reference count update each time.
            if rows == 1:
                # one row: four partial sums (k mod 4) keep as many additions in flight as four rows do
                for kk in range(0, k4, 4):
                    a0, a1, a2, a3 = a[i0, kk], a[i0, kk + 1], a[i0, kk + 2], a[i0, kk + 3]
                    for j in range(NR):
                        acc[0, j] += a0 * panels[p, kk, j]
                        acc[1, j] += a1 * panels[p, kk + 1, j]
                        acc[2, j] += a2 * panels[p, kk + 2, j]
                        acc[3, j] += a3 * panels[p, kk + 3, j]
                for kk in range(k4, k):
                    a0 = a[i0, kk]
                    for j in range(NR):
                        acc[0, j] += a0 * panels[p, kk, j]
                for j in range(NR):
                    acc[0, j] += (acc[1, j] + acc[2, j]) + acc[3, j]
            else:
                # a short last block repeats its last row: the same instructions, stores cut to `rows`
                i1, i2, i3 = i0 + 1, i0 + min(2, rows - 1), i0 + min(3, rows - 1)
                for kk in range(k):
                    tile_step(acc, a[i0, kk], a[i1, kk], a[i2, kk], a[i3, kk], panels, p, kk)
            _finish(acc, edge, rows, cols, c_at, n, i0, j0, form, lo, hi)
            block += 1
            if block == blocks:
                p, block = p + 1, 0

    @jit.njit(cache=True, nogil=True, inline="always")
    def _layer_share(kc_at, m, a_at, c_at, res_at, has_res, team, me):
        """Member `me`'s share of one layer's tiles: the layer's constant block at kc_at, its m rows
        of input, output and residual at the other addresses."""
        kc = carray(int64s_at(kc_at), (_PLACE + 1,))
        k, n, count = kc[_K], kc[_N], kc[_P]
        bounds = carray(float32s_at(kc[_BOUNDS]), (2,))
        tasks = (m + MR - 1) // MR * count
        _tiles(carray(float32s_at(a_at), (m, k)), carray(float32s_at(kc[_PANELS]), (count, k, NR)),
               carray(float32s_at(c_at), (m, n)), carray(float32s_at(res_at), (m, n)),
               carray(float32s_at(kc[_BIAS]), (count * NR,)), has_res, kc[_FORM], bounds[0], bounds[1],
               tasks * me // team, tasks * (me + 1) // team)

    def _member(data):  # compiled into a C callable by jit.entry_address
        q = carray(int64s_at(data), (_HAS_RES + 1,))
        kc = carray(int64s_at(q[_CONSTS]), (_PLACE + 1,))
        team, me = jit.c_call0(kc[_NUM_THREADS]), jit.c_call0(kc[_THREAD_NUM])
        omp.apart(kc[_PLACE], me)
        _layer_share(q[_CONSTS], q[_M], q[_A], q[_C], q[_RES], q[_HAS_RES] != 0, team, me)

    @jit.njit(cache=True, nogil=True)
    def _run(consts, a, c, res, has_res, threads):
        q = np.empty(_HAS_RES + 1, np.int64)
        q[_CONSTS], q[_A], q[_C], q[_RES] = consts.ctypes.data, a.ctypes.data, c.ctypes.data, res.ctypes.data
        q[_M], q[_HAS_RES] = a.shape[0], has_res
        jit.c_call4(consts[_PARALLEL], consts[_MEMBER], q.ctypes.data, threads, 0)

    def _chain_member(data):  # compiled into a C callable by jit.entry_address
        q = carray(int64s_at(data), (_CHAIN_M + 1,))
        layers = carray(int64s_at(q[_CHAIN_HEAD]), (_HEADER,))[_LAYERS]
        h = carray(int64s_at(q[_CHAIN_HEAD]), (_HEADER + layers,))
        team, me = jit.c_call0(h[_H_NUM_THREADS]), jit.c_call0(h[_H_THREAD_NUM])
        omp.apart(h[_H_PLACE], me)
        m, a_at, free_at = q[_CHAIN_M], q[_CHAIN_A], q[_CHAIN_SCRATCH]
        for layer in range(layers):
            n = carray(int64s_at(h[_HEADER + layer]), (_PLACE + 1,))[_N]
            last = layer == layers - 1
            c_at = q[_CHAIN_C] if last else free_at
            _layer_share(h[_HEADER + layer], m, a_at, c_at, c_at, False, team, me)
            if not last:  # the next layer reads every row this one wrote
                jit.c_call0(h[_H_BARRIER])
                a_at, free_at = c_at, free_at + m * n * 4
            elif h[_H_SOFTMAX] != _NO_SOFTMAX:  # each member's rows, once every column of them is written
                jit.c_call0(h[_H_BARRIER])
                scale = carray(float32s_at(h[_H_SCALE]), (1,))[0]
                jit.softmax_row_range(carray(float32s_at(c_at), (m * n,)), n, h[_H_SOFTMAX] == _LOG_SOFTMAX, scale,
                                      m * me // team, m * (me + 1) // team)

    @jit.njit(cache=True, nogil=True)
    def _run_chain(head, a, c, scratch_width, threads):
        scratch = np.empty(a.shape[0] * scratch_width, np.float32)
        q = np.empty(_CHAIN_M + 1, np.int64)
        q[_CHAIN_HEAD], q[_CHAIN_A], q[_CHAIN_C], q[_CHAIN_SCRATCH] = head.ctypes.data, a.ctypes.data, c.ctypes.data, scratch.ctypes.data
        q[_CHAIN_M] = a.shape[0]
        jit.c_call4(head[_H_PARALLEL], head[_H_MEMBER], q.ctypes.data, threads, 0)
        return scratch.shape[0]  # a use after the team's: the scratch lives until the team is done


def _packed(w: np.ndarray) -> np.ndarray:
    """W (K, N) as panels (ceil(N / NR), K, NR): each panel's rows contiguous, the last zero-padded."""
    k, n = w.shape
    count = -(-n // NR)
    padded = np.zeros((k, count * NR), dtype=_F32)
    padded[:, :n] = w
    panels = aligned_empty((count, k, NR), _F32)  # a panel row is a cache line: loads must not straddle two
    panels[...] = padded.reshape(k, count, NR).transpose(1, 0, 2)
    return panels


class _Packing(NamedTuple):
    """What the team reads, by address through `consts`: a call holds this while it runs."""

    consts: np.ndarray
    panels: np.ndarray
    bias: np.ndarray
    bounds: np.ndarray


class PackedDense:
    """y = act(a @ w + bias [+ residual]) for float32 a (..., K) and constant w (K, N); the
    activation is one of the numba kernels' scalar forms (activations.scalar_form)."""

    kind = "MatMul"

    def __init__(self, w: np.ndarray, bias: np.ndarray | None, form: activations.Scalar, residual: bool, name: str = "matmul") -> None:
        self.k, self.n = w.shape
        self.residual, self.name = residual, name
        self._w, self._bias, self._form = w, bias, form
        self._choices: dict[int, TeamChoice] = {}

    @functools.cached_property
    def _packing(self) -> _Packing:
        # Two threads' first calls may both pack: each holds its own result, one is kept.
        panels = _packed(self._w)
        bias = np.zeros(panels.shape[0] * NR, _F32)  # padded like the panels: whole tiles add it
        if self._bias is not None:
            bias[:self.n] = self._bias
        bounds = np.array(self._form[1:], dtype=_F32)
        consts = np.zeros(_PLACE + 1, np.int64)
        consts[[_PANELS, _BIAS, _BOUNDS]] = [panels.ctypes.data, bias.ctypes.data, bounds.ctypes.data]
        consts[[_FORM, _K, _N, _P]] = [self._form[0], self.k, self.n, panels.shape[0]]
        consts[[_THREAD_NUM, _NUM_THREADS, _PARALLEL, _MEMBER, _PLACE]] = [
            omp.THREAD_NUM, omp.NUM_THREADS, omp.PARALLEL, jit.entry_address(_member), omp.PLACE]
        return _Packing(consts, panels, bias, bounds)

    def __call__(self, a: np.ndarray, residual: np.ndarray | None = None, overwrite_residual: bool = False) -> np.ndarray:
        rows, shape = _rows(a, self.k, self.n, self.name)
        m, n = rows.shape[0], self.n
        if self.residual:
            if residual is None:
                raise ValueError(f"MatMul {self.name}: built with a residual sum, but no residual was passed")
            if residual.shape != shape or residual.dtype != _F32:
                raise ValueError(f"MatMul {self.name}: residual {residual.dtype}{list(residual.shape)} does not fit the output float32{list(shape)}")
            if overwrite_residual and residual.flags.writeable and residual.flags.c_contiguous:
                out = res = residual
            else:
                out, res = np.empty(shape, dtype=_F32), np.ascontiguousarray(residual)
        else:
            out = res = np.empty(shape, dtype=_F32)
        if m:
            consts = self._packing.consts
            omp.timed(omp.choice_for(self._choices, m, keeps_apart=False), lambda threads: _run(consts, rows, out.reshape(m, n), res.reshape(m, n), self.residual, threads))
        return out


def few_rows(a: np.ndarray) -> bool:
    """Whether `a` (..., K) has at most MAX_ROWS rows: the calls this kernel takes where oneDNN is installed."""
    return a.size <= MAX_ROWS * a.shape[-1]


def _rows(a: np.ndarray, k: int, n: int, name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """a (..., k) as C-contiguous rows, and the output's shape (..., n)."""
    shape = a.shape
    if a.dtype != _F32 or not shape or shape[-1] != k:
        raise ValueError(f"MatMul {name}: expected a float32 input of shape [..., {k}], got {a.dtype} of shape {shape}")
    if len(shape) == 2 and a.flags.c_contiguous:  # the common case pays no reshapes
        return a, (shape[0], n)
    return np.ascontiguousarray(a).reshape(-1, k), shape[:-1] + (n,)


class _Chained(NamedTuple):
    """What the team reads through a chain's header: the layers' packings, held while a call runs."""

    head: np.ndarray
    packings: tuple[_Packing, ...]
    scale: np.ndarray


class PackedChain:
    """Dense layers in sequence, each feeding only the next, then optionally a (log)softmax of
    scale * y over the last axis: one team call runs them all, its members passing a barrier
    between steps, where a call per step would pay the Python call, its checks and a team start
    each time (the larger part of a small layer's time at batch 1). `softmax` is (log, scale)."""

    kind = "MatMul"

    def __init__(self, layers: Sequence[PackedDense], name: str = "dense_chain", softmax: tuple[bool, float] | None = None) -> None:
        if not layers or any(layer.residual for layer in layers):
            raise ValueError(f"dense chain {name}: needs at least one layer and no residual sums")
        for before, after in zip(layers, layers[1:]):
            if before.n != after.k:
                raise ValueError(f"dense chain {name}: layer {after.name} takes {after.k} features, {before.name} gives {before.n}")
        self.layers, self.name = tuple(layers), name
        self.k, self.n = layers[0].k, layers[-1].n
        self._scratch_width = sum(layer.n for layer in layers[:-1])  # floats per row between layers
        self.softmax = softmax
        self._choices: dict[int, TeamChoice] = {}

    @functools.cached_property
    def _chained(self) -> _Chained:
        packings = tuple(layer._packing for layer in self.layers)
        head = np.zeros(_HEADER + len(packings), np.int64)
        head[[_LAYERS, _H_THREAD_NUM, _H_NUM_THREADS, _H_PARALLEL, _H_BARRIER, _H_PLACE]] = [
            len(packings), omp.THREAD_NUM, omp.NUM_THREADS, omp.PARALLEL, omp.BARRIER, omp.PLACE]
        head[_H_MEMBER] = jit.entry_address(_chain_member)
        head[_HEADER:] = [p.consts.ctypes.data for p in packings]
        log, scale = self.softmax or (False, 1.0)
        scales = np.array([scale], _F32)
        head[[_H_SOFTMAX, _H_SCALE]] = [_NO_SOFTMAX if self.softmax is None else _LOG_SOFTMAX if log else _SOFTMAX, scales.ctypes.data]
        return _Chained(head, packings, scales)

    def call_for(self, shape: tuple[int, ...]) -> KernelCall:
        """This chain for float32 inputs of `shape` (..., K), as a primitive chain runs it."""
        m = math.prod(shape[:-1])
        chained, width = self._chained, self._scratch_width

        def block() -> tuple[np.ndarray, Any]:
            scratch = np.empty(m * width, np.float32)
            q = np.zeros(_CHAIN_M + 1, np.int64)
            q[[_CHAIN_HEAD, _CHAIN_SCRATCH, _CHAIN_M]] = [chained.head.ctypes.data, scratch.ctypes.data, m]
            return q, (scratch, chained)
        return KernelCall(int(chained.head[_H_MEMBER]), block, _CHAIN_A, _CHAIN_C, shape[:-1] + (self.n,), team=True)

    def __call__(self, a: np.ndarray) -> np.ndarray:
        rows, shape = _rows(a, self.k, self.n, self.name)
        out = np.empty(shape, dtype=_F32)
        m = rows.shape[0]
        if m:
            head, width = self._chained.head, self._scratch_width
            flat = out if len(shape) == 2 else out.reshape(m, self.n)
            omp.timed(omp.choice_for(self._choices, m, keeps_apart=False), lambda threads: _run_chain(head, rows, flat, width, threads))
        return out


def dense_for_node(spec: Any, w: np.ndarray | None) -> PackedDense | None:
    """The packed kernel for a FusedMatMul node with constant 2-D float32 weights, a constant
    float32 bias and an activation numba applies, or None."""
    form = activations.scalar_form(spec.attrs.get("activation"))
    bias = spec.const(2) if spec.has(2) else None
    if not AVAILABLE or w is None or w.ndim != 2 or w.dtype != _F32 or form is None:
        return None
    if spec.has(2) and (bias is None or bias.shape != (w.shape[1],) or bias.dtype != _F32):
        return None
    return PackedDense(w, bias, form, residual=spec.has(3), name=spec.name)


def chain_for_layers(layers: Sequence[PackedDense | None], name: str, softmax: tuple[bool, float] | None) -> PackedChain | None:
    """The chained kernel over these layers' packed kernels, or None where one has none."""
    packed = [layer for layer in layers if layer is not None]
    return PackedChain(packed, name, softmax) if AVAILABLE and packed and len(packed) == len(layers) else None
