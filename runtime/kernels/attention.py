"""FusedAttention: softmax(scale * q @ k) @ v per head, in one pass over the heads.

Why: written as ONNX, one attention is a head-split Transpose per operand, two batched MatMuls of
tiny matrices (a BLAS call per head), a Softmax over a scores tensor in memory and a Transpose
back: five copies of the activations and hundreds of calls. Here each head's scores stay in a
small scratch buffer, and q, k, v are read where the projections wrote them: the transposes and reshapes
that laid them out by head (passes/attention.py folds them into the node) become strides.

An operand arrives as its source array plus the view ops that made it from the source: ("T",
perm) and ("R", shape), NumPy's transpose and reshape. Its heads are then read through a 4-D
strided layout (A, B, rows, cols), the batch dims folded to two; where no such layout exists
without a copy (a reshape that splits the minor dims), the operand is copied once.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import jit, omp, sgemm
from .omp import TeamChoice
from .sgemm import MR, NR
from .registry import KernelSpec, OutputShapes, Run, register

View = tuple[str, tuple[int, ...]]  # ("T", perm) or ("R", shape)
Layout = tuple[int, int, int, int, int, int, int, int, int]  # offset, A, B, rows, cols, their strides (elements)
_F32 = np.dtype(np.float32)
MIN_TEAM_WORK = 1 << 16  # multiply-adds; below this (a few heads of a short sequence) one thread does it all


def apply_views(x: np.ndarray, views: Sequence[View]) -> np.ndarray:
    """x through the view ops, as NumPy does them (a reshape copies where it must)."""
    for kind, arg in views:
        x = x.transpose(arg) if kind == "T" else x.reshape(arg)
    return x


def _strided_layout(x: np.ndarray, base: np.ndarray, shape: tuple[int, ...]) -> Layout | None:
    """x (a view into `base`) read as C-order `shape` = (batch..., rows, cols), the batch folded to
    (A, B): in elements from base's start, or None where that takes a copy."""
    rows, cols = shape[-2:]
    dims = [(n, s // x.itemsize) for n, s in zip(x.shape, x.strides) if n != 1]
    tail: list[tuple[int, int]] = []
    for want in (cols, rows):  # the minor two dims must be dims of x as they are
        if want == 1:
            tail.insert(0, (1, 0))
        elif dims and dims[-1][0] == want:
            tail.insert(0, dims.pop())
        else:
            return None
    batch: list[tuple[int, int]] = []
    for n, s in dims:  # C order: a dim folds into the one before when it steps exactly over it
        if batch and batch[-1][1] == n * s:
            batch[-1] = (batch[-1][0] * n, s)
        else:
            batch.append((n, s))
    if len(batch) > 2:
        return None
    while len(batch) < 2:
        batch.insert(0, (1, 0))
    offset = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize
    (a, sa), (b, sb), (r, sr), (c, sc) = batch + tail
    return (offset, a, b, r, c, sa, sb, sr, sc)


def _folded(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """x read as `shape`, as a 4-D (A, B, rows, cols) view of x's memory, or None."""
    lay = _strided_layout(x, x, shape)
    if lay is None:
        return None
    return as_strided(x, lay[1:5], tuple(s * x.itemsize for s in lay[5:]))


def _reshaped(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    y = x.view()
    try:
        y.shape = shape  # raises where the reshape would copy
    except AttributeError:
        return None
    return y


def heads_layout(src: np.ndarray, views: Sequence[View], shape: tuple[int, ...]) -> Layout | None:
    """Where the heads of the operand of logical `shape` made from `src` by `views` lie in src's
    memory, or None where the views need a copy. Once a reshape cannot be a view, the value is
    held folded to (A, B, rows, cols): later ops may only regroup its batch dims or swap its
    rows and cols (a K that is split by head, then transposed)."""
    x, logical = src, tuple(src.shape)
    folded: np.ndarray | None = None
    for kind, arg in views:
        if kind == "T":
            if folded is None:
                x = x.transpose(arg)
            elif list(arg[:-2]) != list(range(len(arg) - 2)):
                return None
            elif arg[-1] != len(arg) - 1:
                folded = folded.swapaxes(2, 3)
            logical = tuple(logical[a] for a in arg)
            continue
        if folded is None:
            y = _reshaped(x, arg)
            if y is None:
                folded = _folded(x, arg)
                if folded is None:
                    return None
            else:
                x = y
        elif tuple(arg[-2:]) != logical[-2:]:
            return None
        logical = tuple(arg)
    if folded is None:
        folded = _folded(x, shape)
    if folded is None or tuple(folded.shape[2:]) != tuple(shape[-2:]):
        return None
    return _strided_layout(folded, src, folded.shape)


def output_layout(out: np.ndarray, views: Sequence[View], shapes: Sequence[tuple[int, ...]], shape: tuple[int, ...]) -> Layout | None:
    """Where, in `out` (the last view's result), the attention's result of logical `shape` lands:
    the views undone in reverse (shapes[i]: what view i was applied to), or None if that copies."""
    undo: list[View] = [("T", tuple(int(a) for a in np.argsort(arg))) if kind == "T" else ("R", before)
                        for (kind, arg), before in zip(reversed(views), reversed(shapes))]
    return heads_layout(out, undo, shape)


if sgemm.AVAILABLE:
    from numba import carray

    # A head's scores are computed transposed, (T, S), in panels of NR queries: the softmax over
    # T then runs down the columns, each step a whole vector of NR queries, and both products run
    # on sgemm's register tiles with loops of constant length. Operands are gathered into
    # zero-padded scratch per head through raw pointers (a transposed gather is the plain one
    # over the transposed layout).

    @jit.njit(cache=True, nogil=True, fastmath={"contract"})
    def _product(a, b, c, k):
        # c[p, i, j] = sum over kk < k of A[i, kk] * b[p, kk, j] in MR x NR register tiles, with A
        # held as panels too: A[i, kk] = a[i // NR, kk, i % NR]. Not inlined: alone, the tile's
        # accumulators keep their registers
        acc = sgemm.stack_tile()
        for p in range(b.shape[0]):
            for i0 in range(0, a.shape[0] * NR, MR):
                for r in range(MR):
                    for j in range(NR):
                        acc[r, j] = 0.0
                ip, ij = i0 // NR, i0 % NR
                for kk in range(k):
                    sgemm.tile_step(acc, a[ip, kk, ij], a[ip, kk, ij + 1], a[ip, kk, ij + 2], a[ip, kk, ij + 3], b, p, kk)
                for r in range(MR):
                    for j in range(NR):
                        c[p, i0 + r, j] = acc[r, j]

    @jit.njit(cache=True, nogil=True)
    def _transposed(lay):
        # the layout of each head transposed: rows and cols swapped
        t = lay.copy()
        t[3], t[4], t[7], t[8] = lay[4], lay[3], lay[8], lay[7]
        return t

    @jit.njit(cache=True, nogil=True, inline="always")
    def _head_at(lay, g):
        return lay[0] + (g // lay[2]) * lay[5] + (g % lay[2]) * lay[6]

    @jit.njit(cache=True, nogil=True, inline="always")
    def _gather_panels(src_at, lay, g, dst):
        # dst[c // NR, r, c % NR] = head g's [r, c]: columns in panels, copied a panel at a time
        # (an index computed per element, c // NR and c % NR, kept the copy one element at a time)
        src = sgemm.float32s_at(src_at)
        base, rows, cols, sr, sc = _head_at(lay, g), lay[3], lay[4], lay[7], lay[8]
        for p in range(dst.shape[0]):
            c0 = p * NR
            width = min(NR, cols - c0)
            for r in range(rows):
                at = base + r * sr + c0 * sc
                for j in range(width):
                    dst[p, r, j] = src[at + j * sc]

    @jit.njit(cache=True, nogil=True, inline="always")
    def _scatter_rows_scaled(src, scales, lay, g, dst_at):
        # head g's [r, c] = src[c // NR, r, c % NR] * scales[r]
        dst = sgemm.float32s_at(dst_at)
        base, rows, cols, sr, sc = _head_at(lay, g), lay[3], lay[4], lay[7], lay[8]
        for p in range(src.shape[0]):
            c0 = p * NR
            width = min(NR, cols - c0)
            for r in range(rows):
                at, scale = base + r * sr + c0 * sc, scales[r]
                for j in range(width):
                    dst[at + j * sc] = src[p, r, j] * scale

    @jit.njit(cache=True, nogil=True, error_model="numpy")
    def _softmax_columns(probs, p, t_n, scale, sums):
        # exp(scale * x - max) down each of panel p's NR columns over its first t_n rows, and
        # 1 / each column's sum into sums[p * NR:]; a register tile holds the maxima and the sums
        acc = sgemm.stack_tile()
        for j in range(NR):
            acc[0, j] = probs[p, 0, j] * scale
            acc[1, j] = 0.0
        for t in range(t_n):
            for j in range(NR):
                x = probs[p, t, j] * scale
                probs[p, t, j] = x
                acc[0, j] = max(acc[0, j], x)
        for t in range(t_n):
            for j in range(NR):
                e = jit.expf(probs[p, t, j] - acc[0, j])
                probs[p, t, j] = e
                acc[1, j] += e
        for j in range(NR):
            sums[p * NR + j] = np.float32(1.0) / acc[1, j]

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")
    def _heads(q_at, ql, k_at, kl, v_at, vl, out_at, ol, scale, start, stop):
        # heads [start, stop) of softmax(scale * q @ k) @ v, each operand at its address read
        # through its layout; the softmax's division waits for the result: rows of E, not T
        s_n, d_n, t_n, e_n = ql[3], ql[4], kl[4], vl[4]
        qtl = _transposed(ql)
        sp, tp, ep = -(-s_n // NR), -(-t_n // NR), -(-e_n // NR)
        q_t = np.zeros((sp, d_n, NR), np.float32)  # q transposed, in panels of NR queries
        k_p = np.zeros((tp, d_n, NR), np.float32)  # k (D, T) in panels of NR keys: k transposed, as product rows
        v_p = np.zeros((ep, t_n, NR), np.float32)
        probs = np.empty((sp, tp * NR, NR), np.float32)  # scores, then their exponentials, transposed
        sums = np.empty(sp * NR, np.float32)  # 1 / each query's sum of exponentials
        res = np.empty((ep, sp * NR, NR), np.float32)
        for g in range(start, stop):
            _gather_panels(q_at, qtl, g, q_t)
            _gather_panels(k_at, kl, g, k_p)
            _gather_panels(v_at, vl, g, v_p)
            _product(k_p, q_t, probs, d_n)
            for p in range(sp):
                _softmax_columns(probs, p, t_n, scale, sums)
            _product(probs, v_p, res, t_n)
            _scatter_rows_scaled(res, sums, ol, g, out_at)


    # The block a call hands the team: addresses, then the head count; the four layouts (9 words
    # each) and the scale (a float32) sit in two arrays of their own.
    _Q, _K, _V, _OUT, _LAYOUTS, _SCALE, _HEADS, _NUM_THREADS, _THREAD_NUM, _PLACE, _BLOCK = range(11)

    def _member(data):  # compiled into a C callable by jit.entry_address
        blk = carray(sgemm.int64s_at(data), (_BLOCK,))
        team, me = jit.c_call0(blk[_NUM_THREADS]), jit.c_call0(blk[_THREAD_NUM])
        omp.apart(blk[_PLACE], me)
        lay = carray(sgemm.int64s_at(blk[_LAYOUTS]), (4, 9))
        scale = carray(sgemm.float32s_at(blk[_SCALE]), (1,))[0]
        heads = blk[_HEADS]
        _heads(blk[_Q], lay[0], blk[_K], lay[1], blk[_V], lay[2], blk[_OUT], lay[3], scale, heads * me // team, heads * (me + 1) // team)

    @jit.njit(cache=True, nogil=True)
    def _on_team(q, k, v, out, layouts, scale, heads, entry, threads):
        # entry: GOMP_parallel, the member's address, omp_get_num_threads, omp_get_thread_num, omp.PLACE
        # (addresses are this process's: an argument, never a compiled-in constant)
        blk = np.empty(_BLOCK, np.int64)
        blk[_Q], blk[_K], blk[_V], blk[_OUT] = q.ctypes.data, k.ctypes.data, v.ctypes.data, out.ctypes.data
        blk[_LAYOUTS], blk[_SCALE], blk[_HEADS] = layouts.ctypes.data, scale.ctypes.data, heads
        blk[_NUM_THREADS], blk[_THREAD_NUM], blk[_PLACE] = entry[2], entry[3], entry[4]
        jit.c_call4(entry[0], entry[1], blk.ctypes.data, threads, 0)
        return blk[0]  # a use after the team's: the block lives until the team is done

    @jit.njit(cache=True, nogil=True)
    def _alone(q, k, v, out, layouts, scale, heads):
        _heads(q.ctypes.data, layouts[0], k.ctypes.data, layouts[1], v.ctypes.data, layouts[2], out.ctypes.data, layouts[3],
               scale[0], 0, heads)


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """The unfused ops, in NumPy: where numba is missing, and what the tests hold the kernel to."""
    scores = np.matmul(q, k) * q.dtype.type(scale)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.matmul(scores, v)


def _attention_shape(spec: KernelSpec) -> OutputShapes:
    return [(tuple(spec.attr("out_shape")), spec.dtypes[0])]


def _views(raw: Any) -> list[View]:
    return [(str(kind), tuple(int(a) for a in arg)) for kind, arg in raw]


@register("FusedAttention", _attention_shape)
def fused_attention(spec: KernelSpec) -> Run:
    """FusedAttention(q, k, v): attrs scale, the view ops per operand (q_views, k_views, v_views)
    and the operands' logical shapes (shapes: q (.., S, D), k (.., D, T), v (.., T, E)), the view
    ops from the result (.., S, E) to the output (out_views, applied to the shapes in out_from),
    and the output's shape (out_shape)."""
    scale = float(spec.attr("scale", 1.0))
    operand_views = [_views(spec.attr(f"{name}_views", [])) for name in ("q", "k", "v")]
    shapes = [tuple(int(d) for d in s) for s in spec.attr("shapes")]
    q_shape, k_shape, v_shape = shapes
    out_views = _views(spec.attr("out_views", []))
    out_from = [tuple(int(d) for d in s) for s in spec.attr("out_from", [])]
    out_shape = tuple(int(d) for d in spec.attr("out_shape"))
    logical = q_shape[:-1] + v_shape[-1:]
    heads = int(np.prod(logical[:-2], dtype=np.int64))
    work = heads * q_shape[-2] * k_shape[-1] * (q_shape[-1] + v_shape[-1])  # multiply-adds
    # per operands' shapes and strides: the four layouts, which of them copy, the team choice
    calls: dict[tuple[Any, ...], tuple[np.ndarray, list[bool], TeamChoice]] = {}
    scale_arg = np.array([scale], _F32)

    def layouts_for(srcs: list[np.ndarray], out: np.ndarray) -> tuple[np.ndarray, list[bool]]:
        """The four layouts (q, k, v, result), and which of them need a copy: an operand then
        goes in as a contiguous copy, the result comes out through one."""
        for x, s, name in zip(srcs, shapes, "qkv"):  # the views keep the size: a wrong one would read past the heads
            if x.size != int(np.prod(s, dtype=np.int64)):
                raise ValueError(f"FusedAttention {spec.name}: {name} has shape {list(x.shape)}, expected {int(np.prod(s))} "
                                 f"elements (the {list(s)} the plan was compiled for)")
        found = [heads_layout(x, vs, s) for x, vs, s in zip(srcs, operand_views, shapes)]
        found.append(output_layout(out, out_views, out_from, logical))
        copies = [lay is None for lay in found]
        plain = [_contiguous_layout(s) for s in (*shapes, logical)]
        return np.array([p if lay is None else lay for lay, p in zip(found, plain)], np.int64), copies

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, ...]:
        if not (q.dtype == k.dtype == v.dtype == _F32):
            raise ValueError(f"FusedAttention {spec.name}: expected float32 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}")
        srcs = [q, k, v]
        out = np.empty(out_shape, _F32)
        if not sgemm.AVAILABLE or not heads:
            qv, kv, vv = (apply_views(x, vs) for x, vs in zip(srcs, operand_views))
            np.copyto(out, apply_views(_reference(qv, kv, vv, scale), out_views))
            return (out,)
        key = tuple((x.shape, x.strides) for x in srcs)
        found = calls.get(key)
        if found is None:
            found = calls[key] = (*layouts_for(srcs, out), TeamChoice(keeps_apart=False))
        lays, copies, choice = found
        if any(copies[:3]):
            srcs = [np.ascontiguousarray(apply_views(x, vs)) if c else x for x, vs, c in zip(srcs, operand_views, copies)]
        target = np.empty(logical, _F32) if copies[3] else out
        if work < MIN_TEAM_WORK:
            _alone(srcs[0], srcs[1], srcs[2], target, lays, scale_arg, heads)
        else:
            omp.timed(choice, lambda threads: _on_team(srcs[0], srcs[1], srcs[2], target, lays, scale_arg, heads, _team_entry(), threads))
        if copies[3]:
            np.copyto(out, apply_views(target, out_views))
        return (out,)

    return run


def _contiguous_layout(shape: tuple[int, ...]) -> Layout:
    """The layout of a C-contiguous array of `shape`."""
    rows, cols = shape[-2:]
    return (0, 1, int(np.prod(shape[:-2], dtype=np.int64)), rows, cols, 0, rows * cols, cols, 1)


@functools.lru_cache(maxsize=1)
def _team_entry() -> np.ndarray:
    return np.array([omp.PARALLEL, jit.entry_address(_member), omp.NUM_THREADS, omp.THREAD_NUM, omp.PLACE], np.int64)
