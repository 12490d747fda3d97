"""Host NN kernels: convolution, pooling, matrix products, with fused epilogues.

Convolutions run as one BLAS GEMM over an im2col view (1x1 stride-1 convolutions need no im2col at
all); depthwise convolutions are a sum of shifted, per-channel-scaled views. The epilogue (bias,
residual add, activation) is applied in place on the GEMM output while it is still in cache.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import activations, jit, onednn, parallel, primitive_chain, sgemm
from .primitive_chain import Link, linkable
from .reduce import softmax, softmax_call
from .registry import SOFTMAX_SCALE, OutputShapes, KernelSpec, Run, register


# ---------------------------------------------------------------- epilogues

def make_epilogue(spec: KernelSpec) -> Callable[[np.ndarray], np.ndarray] | None:
    """In-place activation from a fused node's `activation` attr: ("Relu", {}) etc."""
    f = activations.epilogue(np, spec.attrs.get("activation"), may_be_half=spec.dtypes[0] in (None, np.float16))
    return None if f is None else lambda y: f(y, y)


# ---------------------------------------------------------------- conv geometry

def conv_geometry(spec: KernelSpec, in_hw: tuple[int, ...], kernel: tuple[int, ...]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads_begin, pads_end) with auto_pad resolved for these spatial dims."""
    nd = len(kernel)
    strides = list(spec.attr("strides") or [1] * nd)
    dil = list(spec.attr("dilations") or [1] * nd)
    auto = spec.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(nd):
            out = -(-in_hw[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - in_hw[i])
            small, big = total // 2, total - total // 2
            begin.append(small if auto == "SAME_UPPER" else big)
            end.append(big if auto == "SAME_UPPER" else small)
        return strides, dil, begin, end
    pads = list(spec.attr("pads") or [0] * (2 * nd))
    if auto == "VALID":
        pads = [0] * (2 * nd)
    return strides, dil, pads[:nd], pads[nd:]


Geometry = tuple[list[int], list[int], list[int], list[int], int, int]  # strides, dilations, pads begin/end, OH, OW


def geometry_by_input_size(spec: KernelSpec, kernel: tuple[int, int]) -> Callable[[int, int], Geometry]:
    """conv_geometry and the output size for a constant kernel, resolved once per input (H, W)."""
    @functools.lru_cache(maxsize=64)
    def geometry(h: int, wd: int) -> Geometry:
        strides, dil, b, e = conv_geometry(spec, (h, wd), kernel)
        return (strides, dil, b, e, out_size(h, kernel[0], strides[0], dil[0], b[0], e[0]),
                out_size(wd, kernel[1], strides[1], dil[1], b[1], e[1]))
    return geometry


def out_size(n: int, k: int, s: int, d: int, b: int, e: int, ceil: bool = False) -> int:
    span = n + b + e - ((k - 1) * d + 1)
    return (-(-span // s) if ceil else span // s) + 1


def pad_spatial(x: np.ndarray, begin: list[int], end: list[int], value: float = 0.0) -> np.ndarray:
    if not any(begin) and not any(end):
        return x
    n, c = x.shape[:2]
    hw = x.shape[2:]
    out = np.full((n, c) + tuple(h + b + e for h, b, e in zip(hw, begin, end)), value, dtype=x.dtype)
    out[(slice(None), slice(None)) + tuple(slice(b, b + h) for b, h in zip(begin, hw))] = x
    return out


def windows(xp: np.ndarray, kernel: tuple[int, int], strides: list[int], dil: list[int], oh: int, ow: int) -> np.ndarray:
    """View (N, C, kh, kw, OH, OW) of a padded NCHW tensor: im2col without a copy."""
    n, c, _, _ = xp.shape
    sn, sc, sh, sw = xp.strides
    return as_strided(
        xp,
        shape=(n, c, kernel[0], kernel[1], oh, ow),
        strides=(sn, sc, sh * dil[0], sw * dil[1], sh * strides[0], sw * strides[1]),
        writeable=False,
    )


def _conv_shape(spec: KernelSpec) -> OutputShapes:
    xs, ws = spec.shapes[0], spec.shapes[1]
    if xs is None or ws is None or len(xs) != 4 or -1 in xs[2:]:
        return [((xs[0], ws[0], -1, -1) if xs and ws else None, spec.dtypes[0])]
    k = tuple(ws[2:])
    strides, dil, b, e = conv_geometry(spec, tuple(xs[2:]), k)
    oh = out_size(xs[2], k[0], strides[0], dil[0], b[0], e[0])
    ow = out_size(xs[3], k[1], strides[1], dil[1], b[1], e[1])
    return [((xs[0], ws[0], oh, ow), spec.dtypes[0])]


@register(["Conv", "FusedConv"], _conv_shape)
def conv(spec: KernelSpec) -> Run:
    """NCHW 2-D convolution. FusedConv(x, w, b, [residual]) adds the residual, then the activation."""
    w_const = spec.const(1)
    group = spec.attr("group", 1)
    epilogue = make_epilogue(spec)
    has_bias = spec.has(2)
    has_residual = spec.has(3)
    residual_inplace = 3 in spec.inplace
    jit_act = activations.scalar_form(spec.attrs.get("activation"))
    # Depthwise float32 convolutions without a residual run as one fused JIT pass.
    jit_depthwise = (
        jit.AVAILABLE and w_const is not None and group > 1 and w_const.shape[0] == group and w_const.shape[1] == 1
        and w_const.dtype == np.float32 and not has_residual and jit_act is not None
    )

    def finish(y: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None) -> np.ndarray:
        if bias is not None:
            y += bias.reshape((1, -1) + (1,) * (y.ndim - 2))
        if residual is not None:
            y += residual
        if epilogue is not None:
            epilogue(y)
        return y

    @functools.lru_cache(maxsize=64)
    def geometry(h: int, wd: int, kh: int, kw: int) -> tuple[list[int], list[int], list[int], list[int], int, int]:
        """Resolved padding and output size per input size: once per shape, not per call."""
        strides, dil, b, e = conv_geometry(spec, (h, wd), (kh, kw))
        return strides, dil, b, e, out_size(h, kh, strides[0], dil[0], b[0], e[0]), out_size(wd, kw, strides[1], dil[1], b[1], e[1])

    def core(x: np.ndarray, w: np.ndarray, w2: np.ndarray | None) -> np.ndarray:
        if x.ndim != 4:
            raise ValueError(f"Conv {spec.name}: expected a 4-D NCHW input, got shape {x.shape}")
        o, cg, kh, kw = w.shape
        n, c, h, wd = x.shape
        strides, dil, b, e, oh, ow = geometry(h, wd, kh, kw)
        if c != cg * group:
            raise ValueError(f"Conv {spec.name}: input has {c} channels, weights expect {cg * group}")
        pointwise = kh == kw == 1 and strides == [1, 1] and not any(b) and not any(e)
        if group == 1 and pointwise:
            return parallel.matmul(w2 if w2 is not None else w.reshape(o, cg), x.reshape(n, c, h * wd)).reshape(n, o, oh, ow)
        xp = pad_spatial(x, b, e)
        if group == c and o == c:  # depthwise, multiplier 1
            return depthwise(xp, w, strides, dil, oh, ow)
        win = windows(xp, (kh, kw), strides, dil, oh, ow)
        if group == 1:
            cols = win.reshape(n, c * kh * kw, oh * ow)
            return parallel.matmul(w2 if w2 is not None else w.reshape(o, -1), cols).reshape(n, o, oh, ow)
        og = o // group
        out = np.empty((n, o, oh * ow), dtype=x.dtype)
        for g in range(group):
            cols = win[:, g * cg : (g + 1) * cg].reshape(n, cg * kh * kw, oh * ow)
            np.matmul(w[g * og : (g + 1) * og].reshape(og, -1), cols, out=out[:, g * og : (g + 1) * og])
        return out.reshape(n, o, oh, ow)

    dnnl = onednn.conv_for_node(spec, w_const, "nchw")
    w2_const = None if w_const is None or dnnl is not None else np.ascontiguousarray(w_const.reshape(w_const.shape[0], -1))

    def run_jit_depthwise(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        n, c, h, wd = x.shape
        kh, kw = w.shape[2:]
        if c != group or x.dtype != np.float32:
            return run(x, w, bias, residual)
        strides, dil, b, e, oh, ow = geometry(h, wd, kh, kw)
        kind, lo, hi = jit_act  # type: ignore[misc]
        return (jit.depthwise_conv(pad_spatial(x, b, e), w, bias if has_bias else None, strides, dil, oh, ow, kind, lo, hi),)

    def run(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        y = core(x, w, w2_const)
        if residual is not None and residual_inplace and residual.flags.writeable and residual.shape == y.shape:
            residual += y  # reuse the dying residual buffer, addition commutes
            y, residual = residual, None
        return (finish(y, bias if has_bias else None, residual if has_residual else None),)

    def run_onednn(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if x.ndim != 4 or x.dtype != np.float32:
            return run(x, w, bias, residual)
        _, _, b, e, oh, ow = geometry(x.shape[2], x.shape[3], w.shape[2], w.shape[3])
        return (dnnl(x, oh, ow, b, e, residual, overwrite_residual=residual_inplace),)  # type: ignore[misc]

    if dnnl is not None:
        return run_onednn
    return run_jit_depthwise if jit_depthwise else run


def depthwise(xp: np.ndarray, w: np.ndarray, strides: list[int], dil: list[int], oh: int, ow: int) -> np.ndarray:
    n, c = xp.shape[:2]
    kh, kw = w.shape[2:]
    out = np.zeros((n, c, oh, ow), dtype=xp.dtype)
    tmp = np.empty_like(out)
    sh, sw = strides
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dil[0], j * dil[1]
            view = xp[:, :, r0 : r0 + (oh - 1) * sh + 1 : sh, c0 : c0 + (ow - 1) * sw + 1 : sw]
            np.multiply(view, w[:, 0, i, j].reshape(1, c, 1, 1), out=tmp)
            out += tmp
    return out


# ---------------------------------------------------------------- pooling

def _pool_shape(spec: KernelSpec) -> OutputShapes:
    xs = spec.shapes[0]
    k = tuple(spec.attr("kernel_shape") or ())
    if xs is None or len(xs) != 4 or -1 in xs[2:]:
        return [((xs[0], xs[1], -1, -1) if xs else None, spec.dtypes[0])] * spec.n_outputs
    strides, dil, b, e = conv_geometry(spec, tuple(xs[2:]), k)
    ceil = bool(spec.attr("ceil_mode", 0))
    oh = out_size(xs[2], k[0], strides[0], dil[0], b[0], e[0], ceil)
    ow = out_size(xs[3], k[1], strides[1], dil[1], b[1], e[1], ceil)
    return [((xs[0], xs[1], oh, ow), spec.dtypes[0])]


PoolGeometry = tuple[list[int], list[int], list[int], list[int], list[int], int, int]


def pool_geometry(spec: KernelSpec, k: tuple[int, ...], h: int, wd: int, ceil: bool) -> PoolGeometry:
    """(strides, dilations, pads_begin, pads_end, tail_end, oh, ow). `tail_end` extends the end
    padding so every ceil-mode window stays in bounds; shared by the host and device kernels."""
    strides, dil, b, e = conv_geometry(spec, (h, wd), k)
    oh = out_size(h, k[0], strides[0], dil[0], b[0], e[0], ceil)
    ow = out_size(wd, k[1], strides[1], dil[1], b[1], e[1], ceil)
    tail = [max(e[0], (oh - 1) * strides[0] + (k[0] - 1) * dil[0] + 1 - h - b[0]),
            max(e[1], (ow - 1) * strides[1] + (k[1] - 1) * dil[1] + 1 - wd - b[1])]
    return strides, dil, b, e, tail, oh, ow


def pool_counts(k: tuple[int, ...], h: int, wd: int, geo: PoolGeometry, include_pad: bool) -> np.ndarray:
    """Elements each average-pool window divides by, (oh, ow): padding counts only with
    count_include_pad, and the ceil-mode overhang never does."""
    strides, dil, b, e, tail, oh, ow = geo
    ones = np.pad(np.ones((h, wd), np.float32), ((b[0], tail[0]), (b[1], tail[1])), constant_values=1.0 if include_pad else 0.0)
    if include_pad:
        ones[h + b[0] + e[0]:, :] = 0
        ones[:, wd + b[1] + e[1]:] = 0
    cnt = sum(ones[i * dil[0]: i * dil[0] + (oh - 1) * strides[0] + 1: strides[0],
                   j * dil[1]: j * dil[1] + (ow - 1) * strides[1] + 1: strides[1]] for i in range(k[0]) for j in range(k[1]))
    return np.maximum(cnt, 1)


def pool_attrs(spec: KernelSpec) -> tuple[tuple[int, ...], bool, bool, bool]:
    """(kernel, is_max, ceil_mode, count_include_pad) of a MaxPool/AveragePool node (2-D only)."""
    k = tuple(spec.attr("kernel_shape"))
    if len(k) != 2:
        raise ValueError(f"{spec.op} {spec.name}: only 2-D pooling is supported, kernel_shape={list(k)}")
    return k, spec.op.startswith("MaxPool"), bool(spec.attr("ceil_mode", 0)), bool(spec.attr("count_include_pad", 0))


@register(["MaxPool", "AveragePool"], _pool_shape)
def pool(spec: KernelSpec) -> Run:
    k, is_max, ceil, include_pad = pool_attrs(spec)

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        n, c, h, wd = x.shape
        geo = pool_geometry(spec, k, h, wd, ceil)
        strides, dil, b, e, tail, oh, ow = geo
        xp = pad_spatial(x, b, tail, -np.inf if is_max else 0.0)
        out: np.ndarray | None = None
        for i in range(k[0]):
            for j in range(k[1]):
                r0, c0 = i * dil[0], j * dil[1]
                v = xp[:, :, r0 : r0 + (oh - 1) * strides[0] + 1 : strides[0], c0 : c0 + (ow - 1) * strides[1] + 1 : strides[1]]
                if out is None:
                    out = v.copy()
                elif is_max:
                    np.maximum(out, v, out=out)
                else:
                    out += v
        assert out is not None
        if not is_max:
            if include_pad and tail == e:
                out /= k[0] * k[1]
            else:
                out /= pool_counts(k, h, wd, geo, include_pad).astype(out.dtype)
        return (out,)

    return run


def _global_pool_shape(spec: KernelSpec) -> OutputShapes:
    xs = spec.shapes[0]
    return [(None if xs is None else tuple(xs[:2]) + (1,) * (len(xs) - 2), spec.dtypes[0])]


@register(["GlobalAveragePool", "GlobalMaxPool"], _global_pool_shape)
def global_pool(spec: KernelSpec) -> Run:
    f = np.mean if spec.op == "GlobalAveragePool" else np.max

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        axes = tuple(range(2, x.ndim))
        return (np.asarray(f(x, axis=axes, keepdims=True), dtype=x.dtype),)

    return run


# ---------------------------------------------------------------- matrix products

def _matmul_shape(spec: KernelSpec) -> OutputShapes:
    a, b = spec.shapes[0], spec.shapes[1]
    if a is None or b is None:
        return [(None, spec.dtypes[0])]
    k_a, k_b = a[-1], (b[0] if len(b) == 1 else b[-2])
    if -1 not in (k_a, k_b) and k_a != k_b:
        raise ValueError(f"inner dimensions differ: {list(a)} @ {list(b)}")
    if len(b) == 1:
        return [(tuple(a[:-1]), spec.dtypes[0])]
    if len(a) == 1:
        return [(tuple(b[:-2]) + (b[-1],), spec.dtypes[0])]
    from .registry import broadcast

    batch = broadcast(tuple(a[:-2]), tuple(b[:-2])) or ()
    return [(tuple(batch) + (a[-2], b[-1]), spec.dtypes[0])]


@register(["MatMul", "FusedMatMul"], _matmul_shape)
def matmul(spec: KernelSpec) -> Run:
    """FusedMatMul(a, b, bias, [residual]) = act(a @ b + bias + residual)."""
    epilogue = make_epilogue(spec)
    b_const = spec.const(1)
    packed = sgemm.dense_for_node(spec, b_const)
    dense = onednn.dense_for_node(spec, b_const) or packed
    residual_inplace = 3 in spec.inplace
    b_fast = None if b_const is None else np.ascontiguousarray(b_const)

    def run(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        bb = b_fast if b_fast is not None else b
        if a.ndim > 2 and bb.ndim == 2:  # one big GEMM instead of a loop of small ones
            y = parallel.matmul(a.reshape(-1, a.shape[-1]), bb).reshape(a.shape[:-1] + (bb.shape[-1],))
        else:
            y = parallel.matmul(a, bb)
        if bias is not None:
            y += bias
        if residual is not None:
            y += residual
        if epilogue is not None:
            epilogue(y)
        return (y,)

    if dense is not None:
        n_out = b_const.shape[1]  # type: ignore[union-attr]

        def run_dense(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
            if packed is not None and sgemm.few_rows(a):  # however small: its call is cheaper than NumPy's
                return (packed(a, residual, overwrite_residual=residual_inplace),)
            if a.size * n_out < onednn.MIN_DENSE_MACS:  # e.g. a 64x10 classifier head: NumPy's call is cheaper than oneDNN's
                return run(a, b, bias, residual)
            return (dense(a, residual, overwrite_residual=residual_inplace),)
        return run_dense
    return run


def _chain_shape(spec: KernelSpec) -> OutputShapes:
    a, w = spec.shapes[0], spec.shapes[-2]
    if a is None or w is None:
        return [(None, spec.dtypes[0])]
    return [(tuple(a[:-1]) + (w[-1],), spec.dtypes[0])]


def _chain_layers(spec: KernelSpec) -> list[KernelSpec]:
    """Each layer of a DenseChain(a, w1, b1, ..., wL, bL) as the FusedMatMul it was."""
    layers = []
    for i, (act, name) in enumerate(zip(spec.attr("activations"), spec.attr("layers"))):
        w_at = 1 + 2 * i
        w, b = spec.const(w_at), spec.const(w_at + 1)
        if w is None or w.ndim != 2 or (spec.has(w_at + 1) and b is None):
            raise ValueError(f"DenseChain {spec.name}: layer {name} needs constant 2-D weights and a constant bias")
        shape = None if spec.shapes[0] is None else tuple(spec.shapes[0][:-1]) + (w.shape[0],)
        layers.append(KernelSpec("FusedMatMul", name, {"activation": act}, [None, w, b], [shape, w.shape, None if b is None else b.shape],
                                 [spec.dtypes[0]] * 3, present=[True, True, spec.has(w_at + 1)]))
    return layers


MAX_IN_LINE = 16  # input shapes a dense chain keeps a primitive chain for; others run layer by layer


@register("DenseChain", _chain_shape)
def dense_chain(spec: KernelSpec) -> Run:
    """DenseChain(a, w1, b1, ..., wL, bL): the layers in order, each act(y @ w + b), then the
    (log)softmax over the last axis its `softmax` attr names. At the row counts where the packed
    kernel runs a layer, one chained call runs it all; at more rows, the layers' oneDNN primitives
    and the softmax run as one primitive chain; otherwise each step runs as its own node would."""
    layers = _chain_layers(spec)
    runs = [matmul(layer) for layer in layers]
    tail = spec.attr("softmax")
    end = None if tail is None else softmax(KernelSpec("LogSoftmax" if tail["log"] else "Softmax", spec.name, {"axis": -1, SOFTMAX_SCALE: tail["scale"]},
                                                       [None], [_chain_shape(spec)[0][0]], [spec.dtypes[0]], inplace=frozenset({0}), present=[True]))
    chain = sgemm.chain_for_layers([sgemm.dense_for_node(layer, layer.const(1)) for layer in layers], spec.name,
                                   None if tail is None else (bool(tail["log"]), float(tail["scale"])))
    found = [onednn.dense_for_node(layer, layer.const(1)) for layer in layers]
    denses = [d for d in found if d is not None] if primitive_chain.AVAILABLE and None not in found else []  # every layer's, or none
    consts = [layer.const(i) if layer.has(i) else None for layer in layers for i in (1, 2)]
    in_line: dict[tuple[int, ...], primitive_chain.PrimitiveChain | None] = {}  # per input shape, at many rows

    def layer_by_layer(a: np.ndarray, *weights: np.ndarray | None) -> tuple[np.ndarray, ...]:
        for i, layer in enumerate(runs):
            a = layer(a, weights[2 * i], weights[2 * i + 1])[0]
        return (a,) if end is None else end(a)

    def line_for(shape: tuple[int, ...]) -> primitive_chain.PrimitiveChain | None:
        """The layers' oneDNN primitives (and the softmax) as one chain for inputs of `shape`; None
        where they cannot run it (layer by layer then names what is wrong with the input)."""
        if len(in_line) >= MAX_IN_LINE:  # not kept: inputs of ever new shapes must not grow this
            return None
        rows = math.prod(shape[:-1])
        if not denses or not rows or shape[-1] != denses[0].k:
            return in_line.setdefault(shape, None)
        steps: list[primitive_chain.Callee] = [d.site(rows) for d in denses]
        result = tuple(shape[:-1]) + (steps[-1].shape[-1],)
        if tail is not None:
            steps.append(softmax_call(result, bool(tail["log"]), float(tail["scale"])))
        return in_line.setdefault(shape, primitive_chain.in_line(steps, shape, result, lambda a: layer_by_layer(a, *consts), spec.name))

    def run(a: np.ndarray, *weights: np.ndarray | None) -> tuple[np.ndarray, ...]:
        if a.dtype == np.float32:
            if chain is not None and sgemm.few_rows(a):
                return (chain(a),)
            line = in_line[a.shape] if a.shape in in_line else line_for(a.shape)
            if line is not None:
                return line(a)
        return layer_by_layer(a, *weights)

    def link(a: np.ndarray, *_weights: np.ndarray | None) -> Link | None:
        if chain is None or a.dtype != np.float32 or not sgemm.few_rows(a):
            return None
        call = chain.call_for(a.shape)
        return Link(call, 0, call.shape)

    return linkable(run, link)


def _gemm_shape(spec: KernelSpec) -> OutputShapes:
    a, b = spec.shapes[0], spec.shapes[1]
    if a is None or b is None:
        return [(None, spec.dtypes[0])]
    m = a[1] if spec.attr("transA", 0) else a[0]
    n = b[0] if spec.attr("transB", 0) else b[1]
    return [((m, n), spec.dtypes[0])]


@register("Gemm", _gemm_shape)
def gemm(spec: KernelSpec) -> Run:
    alpha, beta = spec.attr("alpha", 1.0), spec.attr("beta", 1.0)
    ta, tb = spec.attr("transA", 0), spec.attr("transB", 0)
    b_const = spec.const(1)
    b_fast = None if b_const is None else np.ascontiguousarray(b_const.T if tb else b_const) * np.float32(alpha)
    epilogue = make_epilogue(spec)

    def run(a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        aa = a.T if ta else a
        if b_fast is not None:
            y = aa @ b_fast
        else:
            y = aa @ (b.T if tb else b)
            if alpha != 1.0:
                y *= alpha
        if c is not None:
            y += c if beta == 1.0 else beta * c
        if epilogue is not None:
            epilogue(y)
        return (y.astype(a.dtype, copy=False),)

    return run


@register("Einsum", lambda s: [(None, s.dtypes[0])])
def einsum(spec: KernelSpec) -> Run:
    eq = spec.attr("equation").replace(" ", "")
    paths: dict[tuple[tuple[int, ...], ...], Any] = {}

    def run(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
        key = tuple(x.shape for x in xs)
        path = paths.get(key)
        if path is None:
            path = paths[key] = np.einsum_path(eq, *xs, optimize="optimal")[0]
        return (np.asarray(np.einsum(eq, *xs, optimize=path)),)

    return run
