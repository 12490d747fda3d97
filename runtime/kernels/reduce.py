"""Host reductions and normalizations (Softmax, LayerNormalization, ReduceMean, ...)."""
from __future__ import annotations

import numpy as np

from . import jit
from .primitive_chain import KernelCall
from .registry import SOFTMAX_SCALE, ints, OutputShapes, KernelSpec, Run, norm_axis, register, same_as_input


def _reduce_axes(spec: KernelSpec, axes_in: np.ndarray | None, ndim: int) -> tuple[int, ...] | None:
    axes = ints(axes_in) if axes_in is not None else spec.attr("axes")
    if not axes:
        return () if spec.attr("noop_with_empty_axes", 0) else None
    return tuple(norm_axis(a, ndim) for a in axes)


def _reduce_shape(spec: KernelSpec) -> OutputShapes:
    s = spec.shapes[0]
    if s is None or (spec.has(1) and spec.const(1) is None):
        return [(None, spec.dtypes[0])]
    axes = _reduce_axes(spec, spec.const(1) if spec.has(1) else None, len(s))
    axes = tuple(range(len(s))) if axes is None else axes
    keep = spec.attr("keepdims", 1)
    out = tuple((1 if i in axes else d) for i, d in enumerate(s) if keep or i not in axes)
    return [(out, spec.dtypes[0])]


_REDUCE = {
    "ReduceMean": lambda x, a, k: np.mean(x, axis=a, keepdims=k, dtype=x.dtype),
    "ReduceSum": lambda x, a, k: np.sum(x, axis=a, keepdims=k, dtype=x.dtype),
    "ReduceMax": lambda x, a, k: np.max(x, axis=a, keepdims=k),
    "ReduceMin": lambda x, a, k: np.min(x, axis=a, keepdims=k),
    "ReduceProd": lambda x, a, k: np.prod(x, axis=a, keepdims=k, dtype=x.dtype),
    "ReduceSumSquare": lambda x, a, k: np.sum(np.square(x), axis=a, keepdims=k, dtype=x.dtype),
    "ReduceL2": lambda x, a, k: np.sqrt(np.sum(np.square(x), axis=a, keepdims=k, dtype=x.dtype)),
    "ReduceL1": lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k, dtype=x.dtype),
    "ReduceLogSumExp": lambda x, a, k: np.log(np.sum(np.exp(x), axis=a, keepdims=k, dtype=x.dtype)),
}


@register(list(_REDUCE), _reduce_shape, params=frozenset({1}))
def reduce(spec: KernelSpec) -> Run:
    f = _REDUCE[spec.op]
    keep = bool(spec.attr("keepdims", 1))

    def run(x: np.ndarray, axes: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        a = _reduce_axes(spec, axes, x.ndim)
        if a == ():
            return (x,)
        return (np.asarray(f(x, a, keep)),)

    return run


@register(["ArgMax", "ArgMin"], lambda s: [(None, np.dtype(np.int64))])
def argminmax(spec: KernelSpec) -> Run:
    axis, keep, last = spec.attr("axis", 0), spec.attr("keepdims", 1), spec.attr("select_last_index", 0)
    f = np.argmax if spec.op == "ArgMax" else np.argmin

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        a = norm_axis(axis, x.ndim)
        if last:
            r = x.shape[a] - 1 - f(np.flip(x, axis=a), axis=a, keepdims=bool(keep))
        else:
            r = f(x, axis=a, keepdims=bool(keep))
        return (np.asarray(r, dtype=np.int64),)

    return run


def softmax_inplace(x: np.ndarray, axis: int) -> np.ndarray:
    x -= x.max(axis=axis, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=axis, keepdims=True)
    return x


_SM_SRC, _SM_DST, _SM_ROWS, _SM_WIDTH, _SM_LOG, _SM_SCALE, _SM_FIELDS = range(7)  # softmax_call's parameter block

if jit.AVAILABLE:
    from numba import carray

    def _softmax_member(data):  # compiled into a C callable by jit.entry_address
        q = carray(jit.int64s_at(data), (_SM_FIELDS,))
        size, width = q[_SM_ROWS] * q[_SM_WIDTH], q[_SM_WIDTH]
        dst = carray(jit.float32s_at(q[_SM_DST]), (size,))
        if q[_SM_SRC] != q[_SM_DST]:
            dst[:] = carray(jit.float32s_at(q[_SM_SRC]), (size,))
        scale = carray(jit.float32s_at(q[_SM_SCALE]), (1,))[0]
        jit.softmax_row_range(dst, width, q[_SM_LOG] != 0, scale, 0, q[_SM_ROWS])


def softmax_call(shape: tuple[int, ...], log: bool, scale: float) -> KernelCall:
    """(Log)softmax of scale * x over the last axis of float32 `shape`, on the calling thread, as
    a primitive chain runs it: a classifier's tail after its last layer."""

    def block() -> tuple[np.ndarray, np.ndarray]:
        q, held = np.zeros(_SM_FIELDS, np.int64), np.array([scale], np.float32)
        q[_SM_ROWS], q[_SM_WIDTH], q[_SM_LOG], q[_SM_SCALE] = int(np.prod(shape[:-1])), shape[-1], log, held.ctypes.data
        return q, held
    return KernelCall(jit.entry_address(_softmax_member), block, _SM_SRC, _SM_DST, shape, team=False)


@register(["Softmax", "LogSoftmax"], same_as_input)
def softmax(spec: KernelSpec) -> Run:
    axis = spec.attr("axis", -1)
    inplace = 0 in spec.inplace
    log = spec.op == "LogSoftmax"
    scale = float(spec.attr(SOFTMAX_SCALE, 1.0))

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        y = x if inplace and x.flags.writeable and x.flags.c_contiguous else x.astype(x.dtype, copy=True)
        if jit.AVAILABLE and y.dtype == np.float32 and y.size and norm_axis(axis, y.ndim) == y.ndim - 1:
            return (jit.softmax_rows(y, log, scale),)
        if scale != 1.0:
            y *= y.dtype.type(scale)
        if log:
            y -= y.max(axis=axis, keepdims=True)
            y -= np.log(np.exp(y).sum(axis=axis, keepdims=True))
            return (y,)
        return (softmax_inplace(y, axis),)

    return run


@register("LayerNormalization", lambda s: [(s.shapes[0], s.dtypes[0])] + [(None, np.dtype(np.float32))] * (s.n_outputs - 1))
def layer_norm(spec: KernelSpec) -> Run:
    axis, eps = spec.attr("axis", -1), spec.attr("epsilon", 1e-5)

    def run(x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if jit.AVAILABLE and spec.n_outputs == 1 and x.dtype == np.float32 and x.size and norm_axis(axis, x.ndim) == x.ndim - 1 \
                and scale.size == x.shape[-1] and (bias is None or bias.size == x.shape[-1]):
            row = np.zeros(x.shape[-1], np.float32) if bias is None else np.ascontiguousarray(bias, np.float32).reshape(-1)
            return (jit.layer_norm_rows(np.ascontiguousarray(x), np.ascontiguousarray(scale, np.float32).reshape(-1), row,
                                        float(eps), np.empty(x.shape, np.float32)),)
        axes = tuple(range(norm_axis(axis, x.ndim), x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        d = x - mean
        var = np.mean(np.square(d), axis=axes, keepdims=True)
        inv = 1.0 / np.sqrt(var + eps)
        y = d * inv
        y *= scale
        if bias is not None:
            y += bias
        extra = (mean, inv)[: spec.n_outputs - 1]
        return (y, *extra)

    return run


@register("BatchNormalization", lambda s: [(s.shapes[0], s.dtypes[0])])
def batch_norm(spec: KernelSpec) -> Run:
    eps = spec.attr("epsilon", 1e-5)

    def run(x: np.ndarray, scale: np.ndarray, b: np.ndarray, mean: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, ...]:
        s = scale / np.sqrt(var + eps)
        shift = b - mean * s
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return ((x * s.reshape(shape) + shift.reshape(shape)).astype(x.dtype, copy=False),)

    return run
