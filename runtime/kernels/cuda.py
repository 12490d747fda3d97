"""Kernels of the `cuda` device, written against an array module `xp`, in the one registry
(device "cuda"): the ops and their shape functions are the host's.

On a GPU node `xp` is CuPy; in CI it is NumPy, a stand-in at the GPU boundary, so the kernels'
math and the plan around them are checked against onnxruntime and TensorFlow golden outputs on
every machine. Only the fused epilogue (`cupy.ElementwiseKernel`), streams and CUDA Graph capture
are GPU-only (devices/cuda.py).

A factory takes the node's static facts (KernelSpec, whose `ctx` is the DeviceContext) and
returns run(*operands) -> tuple of arrays. Operands arrive already resident where the plan says:
data operands on the device (constants uploaded once, in the compute dtype), shape-like parameter
operands (the op's `params`: reshape targets, axes, pads) as host NumPy arrays, so nothing here
synchronizes. Nothing here imports CuPy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .activations import UNARY_OPS, bind, cuda_expr
from .activations import epilogue as activation_epilogue
from .elementwise import clip_at_run_time, clip_bounds
from .nn import conv_geometry, out_size, pool_attrs, pool_counts, pool_geometry
from .registry import ints, KernelSpec, norm_axis, register_device

Run = Callable[..., tuple[Any, ...]]
DEVICE = "cuda"

CONV_ALGOS = ("im2col", "shifted", "cudnn")


@dataclass
class DeviceContext:
    """What kernels may depend on besides the node: the array module and the tuned choices."""

    xp: Any
    compute_dtype: np.dtype = np.dtype(np.float32)
    conv_algo: str = "im2col"
    fused_epilogue: Callable[..., Any] | None = None  # GPU: ElementwiseKernel builder (see devices/cuda.py)
    gemm: Callable[[Any, Any], Any] | None = None  # GPU: cuBLAS that a CUDA Graph may record (devices/cuda_native.py)
    native: Any = None  # GPU: one-launch convolution, gather and pool kernels (devices/cuda_native.py)
    dnn: Any = None  # GPU, conv_algo "cudnn": cuDNN's convolutions (devices/cudnn.py)
    conv_choices: dict[str, int] = field(default_factory=dict)  # per layer and input shape: cuDNN algorithm, or -1: GEMMs
    stats: dict[str, int] = field(default_factory=dict)

    def matmul(self, a: Any, b: Any) -> Any:
        return self.gemm(a, b) if self.gemm is not None else self.xp.matmul(a, b)

    def upload(self, x: Any) -> Any:
        """Host array -> device, float tensors in the compute dtype (fp16 runs stay fp16)."""
        a = np.asarray(x)
        if a.dtype.kind == "f" and a.dtype != self.compute_dtype:
            a = a.astype(self.compute_dtype)
        return self.xp.asarray(a)

    def const(self, spec: KernelSpec, i: int) -> Any:
        c = spec.const(i)
        return None if c is None else self.upload(c)



def _ctx(spec: KernelSpec) -> DeviceContext:
    if not isinstance(spec.ctx, DeviceContext):
        raise TypeError(f"{spec.op} {spec.name}: a cuda kernel needs spec.ctx to be a DeviceContext, got {type(spec.ctx).__name__}")
    return spec.ctx


def _may_be_half(ctx: DeviceContext) -> bool:
    return ctx.compute_dtype == np.float16


# --------------------------------------------------------------------- epilogue

def epilogue(spec: KernelSpec, ctx: DeviceContext) -> Callable[[Any, Any, Any], Any]:
    """y -> act(y + bias + residual). One fused pass on the GPU; separate xp ops on the stand-in."""
    act = spec.attrs.get("activation")
    if ctx.fused_epilogue is not None:
        fused = ctx.fused_epilogue(act)
        if fused is not None:
            return fused
    f = activation_epilogue(ctx.xp, act, _may_be_half(ctx))

    def run(y: Any, bias: Any, residual: Any) -> Any:
        if bias is not None:
            y = y + bias
        if residual is not None:
            y = y + residual
        return f(y, None) if f is not None else y

    return run


# --------------------------------------------------------------------- convolution / pooling

def _pad(xp: Any, x: Any, begin: list[int], end: list[int], value: float = 0.0) -> Any:
    if not any(begin) and not any(end):
        return x
    return xp.pad(x, ((0, 0), (0, 0)) + tuple(zip(begin, end)), mode="constant", constant_values=value)


def _tap(xp: Any, x: Any, i: int, j: int, strides: list[int], dil: list[int], oh: int, ow: int) -> Any:
    """The strided view of padded input that kernel tap (i, j) multiplies: (N, C, OH, OW)."""
    r0, c0 = i * dil[0], j * dil[1]
    return x[:, :, r0 : r0 + (oh - 1) * strides[0] + 1 : strides[0], c0 : c0 + (ow - 1) * strides[1] + 1 : strides[1]]


@register_device(("Conv", "FusedConv"), DEVICE, own_consts=frozenset({1, 2}))
def conv(spec: KernelSpec) -> Run:
    """NCHW convolution as GEMMs (cuBLAS); FusedConv adds bias/residual/activation.

    Algorithms for dense k>1 convolutions, chosen per GPU type by tuning: `im2col` gathers all
    taps into one (C*kh*kw, OH*OW) matrix and runs one large GEMM; `shifted` runs one GEMM per
    tap over a strided view and accumulates, trading GEMM size for no im2col buffer; `cudnn`
    (GPU only) runs each layer and input shape on whichever measured faster there, cuDNN's best
    algorithm or the im2col GEMMs (im2col where the padding is asymmetric). On a GPU, depthwise
    convolutions (epilogue included) and the im2col gather are one launch each.
    """
    ctx = _ctx(spec)
    xp = ctx.xp
    group = spec.attr("group", 1)
    w = ctx.const(spec, 1)
    if w is None:
        raise ValueError(f"Conv {spec.name}: the cuda runtime needs constant weights")
    o, cg, kh, kw = w.shape
    w2 = xp.ascontiguousarray(w.reshape(o, -1))
    w_taps = [[xp.ascontiguousarray(w[:, :, i, j]) for j in range(kw)] for i in range(kh)]
    bias = ctx.const(spec, 2) if spec.has(2) else None
    bias = None if bias is None else bias.reshape(1, -1, 1, 1)
    finish = epilogue(spec, ctx)
    algo = ctx.conv_algo
    native = ctx.native
    act_c = cuda_expr(spec.attrs.get("activation"))
    dnn_layers: dict[tuple[int, ...], Any] = {}

    def dnn_conv(x: Any, oh: int, ow: int, strides: list[int], pads: list[int], dil: list[int],
                 gemm_path: Callable[[], Any]) -> Any:
        geometry = (*strides, *pads, *dil)
        layer = dnn_layers.get(geometry)
        if layer is None:
            layer = dnn_layers[geometry] = ctx.dnn.layer(w, pads, strides, dil, group, ctx.conv_choices, spec.name)
        return layer(x, oh, ow, gemm_path)

    def gemm_conv(x: Any, oh: int, ow: int, strides: list[int], b: list[int], e: list[int], dil: list[int]) -> Any:
        """The convolution without its epilogue, as cuBLAS GEMMs: (N, O, OH, OW)."""
        n, c, h, wd = x.shape
        depthwise = group == c and o == c and cg == 1
        if group == 1 and kh == kw == 1 and strides == [1, 1] and not any(b) and not any(e):
            y = ctx.matmul(w2, x.reshape(n, c, h * wd))
        elif native is not None and algo in ("im2col", "cudnn") and (group == 1 or n == 1):
            cols = native.im2col(x, kh, kw, oh, ow, strides, b, dil)  # (N, C*kh*kw, P), channel-major like w
            if group == 1:
                y = ctx.matmul(w2, cols)
            else:
                y = ctx.matmul(w2.reshape(group, o // group, cg * kh * kw), cols.reshape(group, cg * kh * kw, oh * ow))
        else:
            xpad = _pad(xp, x, b, e)
            if depthwise:  # per-channel scaled taps
                y = xp.zeros((n, c, oh, ow), dtype=x.dtype)
                for i in range(kh):
                    for j in range(kw):
                        y += _tap(xp, xpad, i, j, strides, dil, oh, ow) * w[:, 0, i, j].reshape(1, c, 1, 1)
            elif group == 1 and algo == "shifted":
                y = None
                for i in range(kh):
                    for j in range(kw):
                        t = xp.ascontiguousarray(_tap(xp, xpad, i, j, strides, dil, oh, ow)).reshape(n, c, oh * ow)
                        p = ctx.matmul(w_taps[i][j], t)
                        y = p if y is None else y + p
            else:
                cols = xp.stack([_tap(xp, xpad, i, j, strides, dil, oh, ow) for i in range(kh) for j in range(kw)], axis=2)
                cols = cols.reshape(n, group, cg * kh * kw, oh * ow)  # (N, G, Cg*kh*kw, P): channel-major like w
                og = o // group
                y = ctx.matmul(w2.reshape(group, og, cg * kh * kw), cols)
        return y.reshape(n, o, oh, ow)

    def run(x: Any, _w: Any = None, _b: Any = None, residual: Any = None) -> tuple[Any, ...]:
        n, c, h, wd = x.shape
        strides, dil, b, e = conv_geometry(spec, (h, wd), (kh, kw))
        oh = out_size(h, kh, strides[0], dil[0], b[0], e[0])
        ow = out_size(wd, kw, strides[1], dil[1], b[1], e[1])
        if c != cg * group:
            raise ValueError(f"Conv {spec.name}: input has {c} channels, weights expect {cg * group}")
        if native is not None and act_c is not None and group == c and o == c and cg == 1:
            # depthwise: one launch, epilogue included
            return (native.depthwise(x, w, bias if bias is not None else _b, residual, act_c, oh, ow, strides, b, dil),)
        if ctx.dnn is not None and b == e:  # cuDNN pads symmetrically only
            y = dnn_conv(x, oh, ow, strides, b, dil, lambda: gemm_conv(x, oh, ow, strides, b, e, dil))
        else:
            y = gemm_conv(x, oh, ow, strides, b, e, dil)
        if native is not None and act_c is not None and y.flags.c_contiguous:  # one pass, no broadcast indexing
            return (native.bias_act(y, bias if bias is not None else _b, residual, act_c),)
        return (finish(y, bias if bias is not None or _b is None else _b.reshape(1, -1, 1, 1), residual),)

    ctx.stats[f"conv_{algo}"] = ctx.stats.get(f"conv_{algo}", 0) + 1
    return run


@register_device(("MaxPool", "AveragePool"), DEVICE)
def pool(spec: KernelSpec) -> Run:
    ctx = _ctx(spec)
    xp = ctx.xp
    k, is_max, ceil, include_pad = pool_attrs(spec)

    def run(x: Any) -> tuple[Any, ...]:
        n, c, h, wd = x.shape
        geo = pool_geometry(spec, k, h, wd, ceil)
        strides, dil, b, e, tail, oh, ow = geo
        if ctx.native is not None:
            return (ctx.native.pool(x, k, oh, ow, strides, b, e, dil, is_max, include_pad),)
        xpad = _pad(xp, x, b, tail, -np.inf if is_max else 0.0)
        taps = [_tap(xp, xpad, i, j, strides, dil, oh, ow) for i in range(k[0]) for j in range(k[1])]
        out = taps[0].copy()
        for t in taps[1:]:
            out = xp.maximum(out, t) if is_max else out + t
        if is_max:
            return (out,)
        return (out / ctx.upload(pool_counts(k, h, wd, geo, include_pad)).astype(out.dtype),)

    return run


@register_device(("GlobalAveragePool", "GlobalMaxPool"), DEVICE)
def global_pool(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    is_avg = spec.op == "GlobalAveragePool"

    def run(x: Any) -> tuple[Any, ...]:
        axes = tuple(range(2, x.ndim))
        if is_avg:  # accumulate in fp32 even for fp16 activations
            return (xp.mean(x, axis=axes, keepdims=True, dtype=np.float32).astype(x.dtype),)
        return (xp.max(x, axis=axes, keepdims=True),)

    return run


# --------------------------------------------------------------------- matrix products

@register_device(("MatMul", "FusedMatMul"), DEVICE, own_consts=frozenset({1, 2}))
def matmul(spec: KernelSpec) -> Run:
    ctx = _ctx(spec)
    xp = ctx.xp
    b_const = ctx.const(spec, 1)
    bias = ctx.const(spec, 2) if spec.op == "FusedMatMul" and spec.has(2) else None
    finish = epilogue(spec, ctx)

    def run(a: Any, b: Any, _bias: Any = None, residual: Any = None) -> tuple[Any, ...]:
        bb = b_const if b_const is not None else b
        if a.ndim > 2 and bb.ndim == 2:  # one GEMM over all leading dims
            y = ctx.matmul(a.reshape(-1, a.shape[-1]), bb).reshape(a.shape[:-1] + (bb.shape[-1],))
        else:
            y = ctx.matmul(a, bb)
        return (finish(y, bias if bias is not None else _bias, residual),)

    return run


@register_device("Gemm", DEVICE)
def gemm(spec: KernelSpec) -> Run:
    ctx = _ctx(spec)
    alpha, beta = float(spec.attr("alpha", 1.0)), float(spec.attr("beta", 1.0))
    ta, tb = spec.attr("transA", 0), spec.attr("transB", 0)

    def run(a: Any, b: Any, c: Any = None) -> tuple[Any, ...]:
        y = ctx.matmul(a.T if ta else a, b.T if tb else b)
        if alpha != 1.0:
            y = y * y.dtype.type(alpha)
        if c is not None:
            y = y + (c if beta == 1.0 else c * c.dtype.type(beta))
        return (y,)

    return run


# --------------------------------------------------------------------- elementwise

@register_device(UNARY_OPS, DEVICE)
def unary(spec: KernelSpec) -> Run:
    ctx = _ctx(spec)
    f = bind(ctx.xp, spec.op, spec.attrs, _may_be_half(ctx))
    return lambda x: (f(x, None),)


@register_device("Dropout", DEVICE)
def dropout(spec: KernelSpec) -> Run:
    return lambda x, *_: (x,)


@register_device("Clip", DEVICE)
def clip(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    bounds = clip_bounds(spec)
    if bounds is None:
        return lambda x, lo=None, hi=None: (clip_at_run_time(xp, x, lo, hi),)
    f = bind(xp, "Clip", bounds, may_be_half=False)
    return lambda x, *_: (f(x, None),)


_BINARY = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide", "Pow": "power",
           "And": "logical_and", "Or": "logical_or", "Xor": "logical_xor", "Equal": "equal", "Less": "less",
           "Greater": "greater", "LessOrEqual": "less_equal", "GreaterOrEqual": "greater_equal"}


@register_device(tuple(_BINARY), DEVICE)
def binary(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    f = getattr(xp, _BINARY[spec.op])
    int_div = spec.op == "Div" and spec.dtypes[0] is not None and spec.dtypes[0].kind in "iu"
    if int_div:  # ONNX integer Div truncates toward zero
        return lambda a, b: (xp.trunc(a / b).astype(a.dtype),)
    if spec.op == "Pow":
        return lambda a, b: (xp.power(a, b.astype(a.dtype)),)
    return lambda a, b: (f(a, b),)


@register_device(("Max", "Min", "Sum", "Mean"), DEVICE)
def variadic(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    f = {"Max": xp.maximum, "Min": xp.minimum, "Sum": xp.add, "Mean": xp.add}[spec.op]

    def run(*xs: Any) -> tuple[Any, ...]:
        acc = xs[0]
        for x in xs[1:]:
            acc = f(acc, x)
        return (acc / acc.dtype.type(len(xs)) if spec.op == "Mean" else acc,)

    return run


@register_device("Where", DEVICE)
def where(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    return lambda c, a, b: (xp.where(c, a, b),)


@register_device("Cast", DEVICE)
def cast(spec: KernelSpec) -> Run:
    ctx = _ctx(spec)
    from onnx import helper

    to = np.dtype(helper.tensor_dtype_to_np_dtype(spec.attr("to")))
    if to.kind == "f":  # float casts keep the run's compute precision (fp16 engines stay fp16)
        to = ctx.compute_dtype
    return lambda x: (x.astype(to, copy=False),)


# --------------------------------------------------------------------- reductions / normalization

@register_device(("Softmax", "LogSoftmax"), DEVICE)
def softmax(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    axis = spec.attr("axis", -1)
    log = spec.op == "LogSoftmax"

    def run(x: Any) -> tuple[Any, ...]:
        y = x.astype(np.float32)  # exp/sum in fp32 for fp16 runs
        y = y - y.max(axis=axis, keepdims=True)
        if log:
            return ((y - xp.log(xp.exp(y).sum(axis=axis, keepdims=True))).astype(x.dtype),)
        e = xp.exp(y)
        return ((e / e.sum(axis=axis, keepdims=True)).astype(x.dtype),)

    return run


@register_device("LayerNormalization", DEVICE)
def layer_norm(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    axis, eps = spec.attr("axis", -1), float(spec.attr("epsilon", 1e-5))

    def run(x: Any, scale: Any, bias: Any = None) -> tuple[Any, ...]:
        xf = x.astype(np.float32)
        axes = tuple(range(norm_axis(axis, x.ndim), x.ndim))
        mean = xf.mean(axis=axes, keepdims=True)
        d = xf - mean
        inv = 1.0 / xp.sqrt((d * d).mean(axis=axes, keepdims=True) + np.float32(eps))
        y = (d * inv).astype(x.dtype) * scale
        if bias is not None:
            y = y + bias
        return (y, mean, inv)[: spec.n_outputs]

    return run


@register_device("BatchNormalization", DEVICE)
def batch_norm(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    eps = float(spec.attr("epsilon", 1e-5))

    def run(x: Any, scale: Any, b: Any, mean: Any, var: Any) -> tuple[Any, ...]:
        s = scale / xp.sqrt(var + var.dtype.type(eps))
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return (x * s.reshape(shape) + (b - mean * s).reshape(shape),)

    return run


@register_device(("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL1",
                  "ReduceL2", "ReduceLogSumExp"), DEVICE)
def reduce(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    keep = bool(spec.attr("keepdims", 1))
    op = spec.op

    def run(x: Any, axes_in: Any = None) -> tuple[Any, ...]:
        axes = ints(axes_in) if axes_in is not None else spec.attr("axes")
        if not axes:
            if spec.attr("noop_with_empty_axes", 0):
                return (x,)
            axes = list(range(x.ndim))
        a = tuple(norm_axis(v, x.ndim) for v in axes)
        acc = np.float32 if x.dtype == np.float16 else None
        if op == "ReduceMean":
            r = xp.mean(x, axis=a, keepdims=keep, dtype=acc)
        elif op == "ReduceSum":
            r = xp.sum(x, axis=a, keepdims=keep, dtype=acc)
        elif op == "ReduceMax":
            r = xp.max(x, axis=a, keepdims=keep)
        elif op == "ReduceMin":
            r = xp.min(x, axis=a, keepdims=keep)
        elif op == "ReduceProd":
            r = xp.prod(x, axis=a, keepdims=keep)
        elif op == "ReduceSumSquare":
            r = xp.sum(x * x, axis=a, keepdims=keep, dtype=acc)
        elif op == "ReduceL1":
            r = xp.sum(xp.abs(x), axis=a, keepdims=keep, dtype=acc)
        elif op == "ReduceL2":
            r = xp.sqrt(xp.sum(x.astype(np.float32) ** 2, axis=a, keepdims=keep))
        else:  # ReduceLogSumExp
            r = xp.log(xp.sum(xp.exp(x.astype(np.float32)), axis=a, keepdims=keep))
        return (xp.asarray(r).astype(x.dtype, copy=False),)

    return run


@register_device(("ArgMax", "ArgMin"), DEVICE)
def argminmax(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    axis, keep, last = spec.attr("axis", 0), bool(spec.attr("keepdims", 1)), spec.attr("select_last_index", 0)
    f = xp.argmax if spec.op == "ArgMax" else xp.argmin

    def run(x: Any) -> tuple[Any, ...]:
        a = norm_axis(axis, x.ndim)
        r = x.shape[a] - 1 - f(xp.flip(x, axis=a), axis=a) if last else f(x, axis=a)
        return ((xp.expand_dims(r, a) if keep else r).astype(np.int64),)

    return run


# --------------------------------------------------------------------- shape manipulation

@register_device("Reshape", DEVICE)
def reshape(spec: KernelSpec) -> Run:
    allowzero = spec.attr("allowzero", 0)

    def run(x: Any, s: Any) -> tuple[Any, ...]:
        target = ints(s) or []
        if not allowzero:
            target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
        return (x.reshape(target),)

    return run


@register_device("Flatten", DEVICE)
def flatten(spec: KernelSpec) -> Run:
    axis = spec.attr("axis", 1)

    def run(x: Any) -> tuple[Any, ...]:
        a = norm_axis(axis, x.ndim)
        return (x.reshape(int(np.prod(x.shape[:a])), -1),)

    return run


@register_device("Transpose", DEVICE)
def transpose(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    perm = spec.attr("perm")
    return lambda x: (xp.ascontiguousarray(x.transpose(perm)),)


@register_device("Squeeze", DEVICE)
def squeeze(spec: KernelSpec) -> Run:
    attr_axes = spec.attr("axes")

    def run(x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = ints(axes) if axes is not None else attr_axes
        if ax is None:
            ax = [i for i, d in enumerate(x.shape) if d == 1]
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in {norm_axis(a, x.ndim) for a in ax}]),)

    return run


@register_device("Unsqueeze", DEVICE)
def unsqueeze(spec: KernelSpec) -> Run:
    attr_axes = spec.attr("axes")

    def run(x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = ints(axes) if axes is not None else attr_axes
        rank = x.ndim + len(ax)
        shape = list(x.shape)
        for a in sorted(norm_axis(a, rank) for a in ax):
            shape.insert(a, 1)
        return (x.reshape(shape),)

    return run


@register_device("Concat", DEVICE)
def concat(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    axis = spec.attr("axis")
    return lambda *xs: (xp.concatenate(xs, axis=axis),)


@register_device("Split", DEVICE)
def split(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    axis, attr_split, n = spec.attr("axis", 0), spec.attr("split"), spec.n_outputs

    def run(x: Any, sizes: Any = None) -> tuple[Any, ...]:
        parts = ints(sizes) if sizes is not None else attr_split
        a = norm_axis(axis, x.ndim)
        if parts is None:
            size = -(-x.shape[a] // n)
            parts = [min(size, x.shape[a] - i * size) for i in range(n)]
        return tuple(xp.split(x, np.cumsum(parts)[:-1].tolist(), axis=a))

    return run


@register_device("Slice", DEVICE)
def slice_(spec: KernelSpec) -> Run:
    def run(x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> tuple[Any, ...]:
        st, en = ints(starts) or [], ints(ends) or []
        ax = ints(axes) if axes is not None else list(range(len(st)))
        sp = ints(steps) if steps is not None else [1] * len(st)
        index = [slice(None)] * x.ndim
        for s, e, a, k in zip(st, en, ax or [], sp or []):
            index[norm_axis(a, x.ndim)] = slice(s, e, k)
        return (x[tuple(index)],)

    return run


@register_device("Gather", DEVICE)
def gather(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    axis = spec.attr("axis", 0)

    def run(x: Any, idx: Any) -> tuple[Any, ...]:
        a = norm_axis(axis, x.ndim)
        idx = xp.asarray(idx)
        idx = xp.where(idx < 0, idx + x.shape[a], idx)  # negative indices count from the end
        return (xp.take(x, idx, axis=a),)

    return run


@register_device("Pad", DEVICE)
def pad(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    mode = spec.attr("mode", "constant")

    def run(x: Any, pads: Any = None, value: Any = None, axes: Any = None) -> tuple[Any, ...]:
        p = ints(pads) if pads is not None else spec.attr("pads")
        ax = ints(axes) if axes is not None else list(range(x.ndim))
        width = [(0, 0)] * x.ndim
        for j, a in enumerate(ax or []):
            width[norm_axis(a, x.ndim)] = (p[j], p[j + len(ax)])
        if any(lo < 0 or hi < 0 for lo, hi in width):
            x = x[tuple(slice(max(0, -lo), x.shape[i] - max(0, -hi)) for i, (lo, hi) in enumerate(width))]
            width = [(max(0, lo), max(0, hi)) for lo, hi in width]
        if mode == "constant":
            cv = 0 if value is None or np.size(value) == 0 else float(np.asarray(value).reshape(-1)[0])
            return (xp.pad(x, width, mode="constant", constant_values=cv),)
        return (xp.pad(x, width, mode=mode),)

    return run


@register_device("Expand", DEVICE)
def expand(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    return lambda x, s: (xp.ascontiguousarray(xp.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(ints(s) or [])))),)


@register_device("Tile", DEVICE)
def tile(spec: KernelSpec) -> Run:
    xp = _ctx(spec).xp
    return lambda x, reps: (xp.tile(x, ints(reps)),)
