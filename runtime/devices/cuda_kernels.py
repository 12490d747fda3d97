"""Device kernels of the `cuda` runtime, written against an array module `xp`.

On a GPU node `xp` is CuPy; in CI it is NumPy, a stand-in at the GPU boundary, so the kernels'
math and the plan around them are checked against onnxruntime and TensorFlow golden outputs on
every machine. Only the fused epilogue (`cupy.ElementwiseKernel`), streams and CUDA Graph capture
are GPU-only.

A factory takes the node's static facts (KernelSpec) and a DeviceContext and returns
run(*operands) -> tuple of arrays. Operands arrive already resident where the plan says: data
operands on the device (constants uploaded once, in the compute dtype), shape-like parameter
operands (reshape targets, axes, pads) as host NumPy arrays, so nothing here synchronizes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernels.nn import conv_geometry, out_size, pool_attrs, pool_counts, pool_geometry
from ..kernels.registry import KernelSpec, norm_axis

Run = Callable[..., tuple[Any, ...]]
Factory = Callable[[KernelSpec, "DeviceContext"], Run]

CONV_ALGOS = ("im2col", "shifted")

# Operand positions a kernel reads as host-side parameters (never device data).
PARAM_OPERANDS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Squeeze": frozenset({1}), "Unsqueeze": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}), "Expand": frozenset({1}), "Tile": frozenset({1}),
    "Split": frozenset({1}), "Pad": frozenset({1, 2, 3}), "Clip": frozenset({1, 2}),
    "ConstantOfShape": frozenset({0}), "Range": frozenset({0, 1, 2}), "TopK": frozenset({1}),
    **{op: frozenset({1}) for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
                                      "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp")},
}
# Ops that only read their operand's shape: they run on the host even for device operands.
SHAPE_ONLY = frozenset({"Shape", "Size"})
# Constant operands a kernel uploads itself, in its own layout: the plan passes None for them.
OWN_CONSTS: dict[str, frozenset[int]] = {
    "Conv": frozenset({1, 2}), "FusedConv": frozenset({1, 2}), "MatMul": frozenset({1}), "FusedMatMul": frozenset({1, 2}),
}


@dataclass
class DeviceContext:
    """What kernels may depend on besides the node: the array module and the tuned choices."""

    xp: Any
    compute_dtype: np.dtype = np.dtype(np.float32)
    conv_algo: str = "im2col"
    fused_epilogue: Callable[..., Any] | None = None  # GPU: ElementwiseKernel builder (see cuda.py)
    stats: dict[str, int] = field(default_factory=dict)

    def upload(self, x: Any) -> Any:
        """Host array -> device, float tensors in the compute dtype (fp16 runs stay fp16)."""
        a = np.asarray(x)
        if a.dtype.kind == "f" and a.dtype != self.compute_dtype:
            a = a.astype(self.compute_dtype)
        return self.xp.asarray(a)

    def const(self, spec: KernelSpec, i: int) -> Any:
        c = spec.const(i)
        return None if c is None else self.upload(c)


def _ints(x: Any) -> list[int] | None:
    return None if x is None else [int(v) for v in np.asarray(x).reshape(-1)]


# --------------------------------------------------------------------- activations

def _erf(xp: Any, x: Any) -> Any:
    """erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), in float32 arithmetic."""
    xf = x.astype(np.float32)
    a = xp.abs(xf)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (xp.sign(xf) * (1.0 - poly * xp.exp(-a * a))).astype(x.dtype)


def activation(xp: Any, op: str, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    """The math of one unary op with xp ops; shared by standalone kernels and unfused epilogues."""
    def f32(g: Callable[[Any], Any]) -> Callable[[Any], Any]:  # transcendental math in fp32
        return lambda x: g(x.astype(np.float32)).astype(x.dtype) if x.dtype == np.float16 else g(x)

    if op == "Relu":
        return lambda x: xp.maximum(x, 0)
    if op == "LeakyRelu":
        a = float(attrs.get("alpha", 0.01))
        return lambda x: xp.where(x >= 0, x, x * x.dtype.type(a))
    if op == "Sigmoid":
        return f32(lambda x: 1.0 / (1.0 + xp.exp(-x)))
    if op == "HardSigmoid":
        a, b = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
        return lambda x: xp.clip(x * x.dtype.type(a) + x.dtype.type(b), 0, 1)
    if op == "HardSwish":
        return lambda x: x * (xp.clip(x + x.dtype.type(3), 0, 6) / x.dtype.type(6))
    if op == "Gelu":
        return f32(lambda x: 0.5 * x * (1.0 + _erf(xp, x * np.float32(0.7071067811865476))))
    if op == "Erf":
        return f32(lambda x: _erf(xp, x))
    if op == "Elu":
        a = float(attrs.get("alpha", 1.0))
        return f32(lambda x: xp.where(x > 0, x, (xp.exp(xp.minimum(x, 0)) - 1) * np.float32(a)))
    if op == "Softplus":
        return f32(lambda x: xp.logaddexp(x, np.float32(0)))
    if op == "Clip":
        lo, hi = attrs.get("min"), attrs.get("max")
        return lambda x: xp.clip(x, -np.inf if lo is None else lo, np.inf if hi is None else hi).astype(x.dtype, copy=False)
    simple = {"Tanh": "tanh", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Neg": "negative", "Abs": "abs",
              "Floor": "floor", "Ceil": "ceil", "Reciprocal": "reciprocal", "Sin": "sin", "Cos": "cos",
              "Sign": "sign", "Round": "rint", "Not": "logical_not"}
    if op in simple:
        g = getattr(xp, simple[op])
        return f32(g) if op in ("Tanh", "Exp", "Log", "Sqrt", "Sin", "Cos") else g
    if op in ("Identity", "Dropout"):
        return lambda x: x
    raise KeyError(op)


UNARY_OPS = ["Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Gelu", "Erf", "Elu", "Softplus",
             "Tanh", "Exp", "Log", "Sqrt", "Neg", "Abs", "Floor", "Ceil", "Reciprocal", "Sin", "Cos", "Sign",
             "Round", "Not", "Identity"]


def epilogue(spec: KernelSpec, ctx: DeviceContext) -> Callable[[Any, Any, Any], Any]:
    """y -> act(y + bias + residual). One fused pass on the GPU; separate xp ops on the stand-in."""
    act = spec.attrs.get("activation")
    if ctx.fused_epilogue is not None:
        fused = ctx.fused_epilogue(act)
        if fused is not None:
            return fused
    f = activation(ctx.xp, act[0], act[1]) if act else None

    def run(y: Any, bias: Any, residual: Any) -> Any:
        if bias is not None:
            y = y + bias
        if residual is not None:
            y = y + residual
        return f(y) if f is not None else y

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


def conv(spec: KernelSpec, ctx: DeviceContext) -> Run:
    """NCHW convolution as GEMMs (cuBLAS via xp.matmul); FusedConv adds bias/residual/activation.

    Algorithms for dense k>1 convolutions, chosen per GPU type by tuning: `im2col` gathers all
    taps into one (C*kh*kw, OH*OW) matrix and runs one large GEMM; `shifted` runs one GEMM per
    tap over a strided view and accumulates, trading GEMM size for no im2col buffer.
    """
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

    def run(x: Any, _w: Any = None, _b: Any = None, residual: Any = None) -> tuple[Any, ...]:
        n, c, h, wd = x.shape
        strides, dil, b, e = conv_geometry(spec, (h, wd), (kh, kw))
        oh = out_size(h, kh, strides[0], dil[0], b[0], e[0])
        ow = out_size(wd, kw, strides[1], dil[1], b[1], e[1])
        if c != cg * group:
            raise ValueError(f"Conv {spec.name}: input has {c} channels, weights expect {cg * group}")
        if group == 1 and kh == kw == 1 and strides == [1, 1] and not any(b) and not any(e):
            y = xp.matmul(w2, x.reshape(n, c, h * wd))
        else:
            xpad = _pad(xp, x, b, e)
            if group == c and o == c and cg == 1:  # depthwise: per-channel scaled taps
                y = xp.zeros((n, c, oh, ow), dtype=x.dtype)
                for i in range(kh):
                    for j in range(kw):
                        y += _tap(xp, xpad, i, j, strides, dil, oh, ow) * w[:, 0, i, j].reshape(1, c, 1, 1)
                y = y.reshape(n, o, oh * ow)
            elif group == 1 and algo == "shifted":
                y = None
                for i in range(kh):
                    for j in range(kw):
                        t = xp.ascontiguousarray(_tap(xp, xpad, i, j, strides, dil, oh, ow)).reshape(n, c, oh * ow)
                        p = xp.matmul(w_taps[i][j], t)
                        y = p if y is None else y + p
            else:
                cols = xp.stack([_tap(xp, xpad, i, j, strides, dil, oh, ow) for i in range(kh) for j in range(kw)], axis=2)
                cols = cols.reshape(n, group, cg * kh * kw, oh * ow)  # (N, G, Cg*kh*kw, P): channel-major like w
                og = o // group
                y = xp.matmul(w2.reshape(group, og, cg * kh * kw), cols).reshape(n, o, oh * ow)
        y = y.reshape(n, o, oh, ow)
        return (finish(y, bias if bias is not None or _b is None else _b.reshape(1, -1, 1, 1), residual),)

    ctx.stats[f"conv_{algo}"] = ctx.stats.get(f"conv_{algo}", 0) + 1
    return run


def pool(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    k, is_max, ceil, include_pad = pool_attrs(spec)

    def run(x: Any) -> tuple[Any, ...]:
        n, c, h, wd = x.shape
        geo = pool_geometry(spec, k, h, wd, ceil)
        strides, dil, b, _e, tail, oh, ow = geo
        xpad = _pad(xp, x, b, tail, -np.inf if is_max else 0.0)
        taps = [_tap(xp, xpad, i, j, strides, dil, oh, ow) for i in range(k[0]) for j in range(k[1])]
        out = taps[0].copy()
        for t in taps[1:]:
            out = xp.maximum(out, t) if is_max else out + t
        if is_max:
            return (out,)
        return (out / ctx.upload(pool_counts(k, h, wd, geo, include_pad)).astype(out.dtype),)

    return run


def global_pool(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    is_avg = spec.op == "GlobalAveragePool"

    def run(x: Any) -> tuple[Any, ...]:
        axes = tuple(range(2, x.ndim))
        if is_avg:  # accumulate in fp32 even for fp16 activations
            return (xp.mean(x, axis=axes, keepdims=True, dtype=np.float32).astype(x.dtype),)
        return (xp.max(x, axis=axes, keepdims=True),)

    return run


# --------------------------------------------------------------------- matrix products

def matmul(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    b_const = ctx.const(spec, 1)
    bias = ctx.const(spec, 2) if spec.op == "FusedMatMul" and spec.has(2) else None
    finish = epilogue(spec, ctx)

    def run(a: Any, b: Any, _bias: Any = None, residual: Any = None) -> tuple[Any, ...]:
        bb = b_const if b_const is not None else b
        if a.ndim > 2 and bb.ndim == 2:  # one GEMM over all leading dims
            y = xp.matmul(a.reshape(-1, a.shape[-1]), bb).reshape(a.shape[:-1] + (bb.shape[-1],))
        else:
            y = xp.matmul(a, bb)
        return (finish(y, bias if bias is not None else _bias, residual),)

    return run


def gemm(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    alpha, beta = float(spec.attr("alpha", 1.0)), float(spec.attr("beta", 1.0))
    ta, tb = spec.attr("transA", 0), spec.attr("transB", 0)

    def run(a: Any, b: Any, c: Any = None) -> tuple[Any, ...]:
        y = xp.matmul(a.T if ta else a, b.T if tb else b)
        if alpha != 1.0:
            y = y * y.dtype.type(alpha)
        if c is not None:
            y = y + (c if beta == 1.0 else c * c.dtype.type(beta))
        return (y,)

    return run


# --------------------------------------------------------------------- elementwise

def unary(spec: KernelSpec, ctx: DeviceContext) -> Run:
    f = activation(ctx.xp, spec.op, spec.attrs)
    return lambda x: (f(x),)


def clip(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    lo = spec.const(1) if spec.has(1) else spec.attr("min")
    hi = spec.const(2) if spec.has(2) else spec.attr("max")

    def run(x: Any, lo_in: Any = None, hi_in: Any = None) -> tuple[Any, ...]:
        lo_v = lo if lo is not None else lo_in
        hi_v = hi if hi is not None else hi_in
        lo_f = -np.inf if lo_v is None else float(np.asarray(lo_v))
        hi_f = np.inf if hi_v is None else float(np.asarray(hi_v))
        return (xp.clip(x, lo_f, hi_f).astype(x.dtype, copy=False),)

    return run


_BINARY = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide", "Pow": "power",
           "And": "logical_and", "Or": "logical_or", "Xor": "logical_xor", "Equal": "equal", "Less": "less",
           "Greater": "greater", "LessOrEqual": "less_equal", "GreaterOrEqual": "greater_equal"}


def binary(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    f = getattr(xp, _BINARY[spec.op])
    int_div = spec.op == "Div" and spec.dtypes[0] is not None and spec.dtypes[0].kind in "iu"
    if int_div:  # ONNX integer Div truncates toward zero
        return lambda a, b: (xp.trunc(a / b).astype(a.dtype),)
    if spec.op == "Pow":
        return lambda a, b: (xp.power(a, b.astype(a.dtype)),)
    return lambda a, b: (f(a, b),)


def variadic(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    f = {"Max": xp.maximum, "Min": xp.minimum, "Sum": xp.add, "Mean": xp.add}[spec.op]

    def run(*xs: Any) -> tuple[Any, ...]:
        acc = xs[0]
        for x in xs[1:]:
            acc = f(acc, x)
        return (acc / acc.dtype.type(len(xs)) if spec.op == "Mean" else acc,)

    return run


def where(spec: KernelSpec, ctx: DeviceContext) -> Run:
    return lambda c, a, b: (ctx.xp.where(c, a, b),)


def cast(spec: KernelSpec, ctx: DeviceContext) -> Run:
    from onnx import helper

    to = np.dtype(helper.tensor_dtype_to_np_dtype(spec.attr("to")))
    if to.kind == "f":  # float casts keep the run's compute precision (fp16 engines stay fp16)
        to = ctx.compute_dtype
    return lambda x: (x.astype(to, copy=False),)


# --------------------------------------------------------------------- reductions / normalization

def softmax(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
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


def layer_norm(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
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


def batch_norm(spec: KernelSpec, ctx: DeviceContext) -> Run:
    eps = float(spec.attr("epsilon", 1e-5))

    def run(x: Any, scale: Any, b: Any, mean: Any, var: Any) -> tuple[Any, ...]:
        s = scale / ctx.xp.sqrt(var + var.dtype.type(eps))
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return (x * s.reshape(shape) + (b - mean * s).reshape(shape),)

    return run


def reduce(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    keep = bool(spec.attr("keepdims", 1))
    op = spec.op

    def run(x: Any, axes_in: Any = None) -> tuple[Any, ...]:
        axes = _ints(axes_in) if axes_in is not None else spec.attr("axes")
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


def argminmax(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    axis, keep, last = spec.attr("axis", 0), bool(spec.attr("keepdims", 1)), spec.attr("select_last_index", 0)
    f = xp.argmax if spec.op == "ArgMax" else xp.argmin

    def run(x: Any) -> tuple[Any, ...]:
        a = norm_axis(axis, x.ndim)
        r = x.shape[a] - 1 - f(xp.flip(x, axis=a), axis=a) if last else f(x, axis=a)
        return ((xp.expand_dims(r, a) if keep else r).astype(np.int64),)

    return run


# --------------------------------------------------------------------- shape manipulation

def reshape(spec: KernelSpec, ctx: DeviceContext) -> Run:
    allowzero = spec.attr("allowzero", 0)

    def run(x: Any, s: Any) -> tuple[Any, ...]:
        target = _ints(s) or []
        if not allowzero:
            target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
        return (x.reshape(target),)

    return run


def flatten(spec: KernelSpec, ctx: DeviceContext) -> Run:
    axis = spec.attr("axis", 1)

    def run(x: Any) -> tuple[Any, ...]:
        a = norm_axis(axis, x.ndim)
        return (x.reshape(int(np.prod(x.shape[:a])), -1),)

    return run


def transpose(spec: KernelSpec, ctx: DeviceContext) -> Run:
    perm = spec.attr("perm")
    return lambda x: (ctx.xp.ascontiguousarray(x.transpose(perm)),)


def squeeze(spec: KernelSpec, ctx: DeviceContext) -> Run:
    attr_axes = spec.attr("axes")

    def run(x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _ints(axes) if axes is not None else attr_axes
        if ax is None:
            ax = [i for i, d in enumerate(x.shape) if d == 1]
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in {norm_axis(a, x.ndim) for a in ax}]),)

    return run


def unsqueeze(spec: KernelSpec, ctx: DeviceContext) -> Run:
    attr_axes = spec.attr("axes")

    def run(x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _ints(axes) if axes is not None else attr_axes
        rank = x.ndim + len(ax)
        shape = list(x.shape)
        for a in sorted(norm_axis(a, rank) for a in ax):
            shape.insert(a, 1)
        return (x.reshape(shape),)

    return run


def concat(spec: KernelSpec, ctx: DeviceContext) -> Run:
    axis = spec.attr("axis")
    return lambda *xs: (ctx.xp.concatenate(xs, axis=axis),)


def split(spec: KernelSpec, ctx: DeviceContext) -> Run:
    axis, attr_split, n = spec.attr("axis", 0), spec.attr("split"), spec.n_outputs

    def run(x: Any, sizes: Any = None) -> tuple[Any, ...]:
        parts = _ints(sizes) if sizes is not None else attr_split
        a = norm_axis(axis, x.ndim)
        if parts is None:
            size = -(-x.shape[a] // n)
            parts = [min(size, x.shape[a] - i * size) for i in range(n)]
        return tuple(ctx.xp.split(x, np.cumsum(parts)[:-1].tolist(), axis=a))

    return run


def slice_(spec: KernelSpec, ctx: DeviceContext) -> Run:
    def run(x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> tuple[Any, ...]:
        st, en = _ints(starts) or [], _ints(ends) or []
        ax = _ints(axes) if axes is not None else list(range(len(st)))
        sp = _ints(steps) if steps is not None else [1] * len(st)
        index = [slice(None)] * x.ndim
        for s, e, a, k in zip(st, en, ax or [], sp or []):
            index[norm_axis(a, x.ndim)] = slice(s, e, k)
        return (x[tuple(index)],)

    return run


def gather(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    axis = spec.attr("axis", 0)

    def run(x: Any, idx: Any) -> tuple[Any, ...]:
        a = norm_axis(axis, x.ndim)
        idx = xp.asarray(idx)
        idx = xp.where(idx < 0, idx + x.shape[a], idx)  # negative indices count from the end
        return (xp.take(x, idx, axis=a),)

    return run


def pad(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    mode = spec.attr("mode", "constant")

    def run(x: Any, pads: Any = None, value: Any = None, axes: Any = None) -> tuple[Any, ...]:
        p = _ints(pads) if pads is not None else spec.attr("pads")
        ax = _ints(axes) if axes is not None else list(range(x.ndim))
        width = [(0, 0)] * x.ndim
        for j, a in enumerate(ax or []):
            width[norm_axis(a, x.ndim)] = (p[j], p[j + len(ax)])  # type: ignore[index]
        if any(lo < 0 or hi < 0 for lo, hi in width):
            x = x[tuple(slice(max(0, -lo), x.shape[i] - max(0, -hi)) for i, (lo, hi) in enumerate(width))]
            width = [(max(0, lo), max(0, hi)) for lo, hi in width]
        if mode == "constant":
            cv = 0 if value is None or np.size(value) == 0 else float(np.asarray(value).reshape(-1)[0])
            return (xp.pad(x, width, mode="constant", constant_values=cv),)
        return (xp.pad(x, width, mode=mode),)

    return run


def expand(spec: KernelSpec, ctx: DeviceContext) -> Run:
    xp = ctx.xp
    return lambda x, s: (xp.ascontiguousarray(xp.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(_ints(s) or [])))),)


def tile(spec: KernelSpec, ctx: DeviceContext) -> Run:
    return lambda x, reps: (ctx.xp.tile(x, _ints(reps)),)


def table() -> dict[str, Factory]:
    """op -> device kernel factory; ops not here run as host kernels (see cuda.DevicePlan)."""
    t: dict[str, Factory] = {}
    for ops, f in (
        (("Conv", "FusedConv"), conv), (("MaxPool", "AveragePool"), pool),
        (("GlobalAveragePool", "GlobalMaxPool"), global_pool), (("MatMul", "FusedMatMul"), matmul),
        (("Gemm",), gemm), (UNARY_OPS + ["Dropout"], unary), (("Clip",), clip), (tuple(_BINARY), binary),
        (("Max", "Min", "Sum", "Mean"), variadic), (("Where",), where), (("Cast",), cast),
        (("Softmax", "LogSoftmax"), softmax), (("LayerNormalization",), layer_norm),
        (("BatchNormalization",), batch_norm),
        (("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL1",
          "ReduceL2", "ReduceLogSumExp"), reduce),
        (("ArgMax", "ArgMin"), argminmax), (("Reshape",), reshape), (("Flatten",), flatten),
        (("Transpose",), transpose), (("Squeeze",), squeeze), (("Unsqueeze",), unsqueeze),
        (("Concat",), concat), (("Split",), split), (("Slice",), slice_), (("Gather",), gather),
        (("Pad",), pad), (("Expand",), expand), (("Tile",), tile),
    ):
        for op in ops:
            t[op] = f
    return t
