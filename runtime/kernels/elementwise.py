"""Host elementwise kernels: unary, binary (broadcasting), variadic, comparisons.

Kernels write in place when the compiler says the operand dies here (memory planning), which
saves an allocation and a cache-cold pass per op on large activations.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .registry import KernelSpec, Run, broadcast, broadcast_bool, broadcast_shape, register, same_as_input

Unary = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


def _erf(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """erf via Abramowitz & Stegun 7.1.26 evaluated in float64 (|error| < 1.5e-7)."""
    xd = np.asarray(x, dtype=np.float64)
    s = np.sign(xd)
    a = np.abs(xd)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = s * (1.0 - poly * np.exp(-a * a))
    if out is None:
        return r.astype(x.dtype, copy=False)
    np.copyto(out, r, casting="unsafe")
    return out


def _hard_sigmoid(alpha: float, beta: float) -> Unary:
    def f(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        r = np.multiply(x, alpha, out=out)
        r += beta
        return np.clip(r, 0.0, 1.0, out=r)

    return f


def _sigmoid(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    r = np.negative(x, out=out)
    np.exp(r, out=r)
    r += 1.0
    return np.reciprocal(r, out=r)


def _hard_swish(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    h = np.add(x, 3.0)
    np.clip(h, 0.0, 6.0, out=h)
    h *= 1.0 / 6.0
    return np.multiply(x, h, out=out)


def _gelu(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    e = _erf(x * np.float32(0.7071067811865476))
    e += 1.0
    e *= 0.5
    return np.multiply(x, e, out=out)


def unary_fn(op: str, attrs: dict) -> Unary:
    """The math of one unary op, shared by standalone kernels and fused epilogues."""
    if op == "Relu":
        return lambda x, out: np.maximum(x, 0, out=out)
    if op == "LeakyRelu":
        a = attrs.get("alpha", 0.01)
        return lambda x, out: _where_out(x >= 0, x, x * np.asarray(a, x.dtype), out)
    if op == "Sigmoid":
        return _sigmoid
    if op == "HardSigmoid":
        return _hard_sigmoid(attrs.get("alpha", 0.2), attrs.get("beta", 0.5))
    if op == "HardSwish":
        return _hard_swish
    if op == "Gelu":
        return _gelu
    if op == "Erf":
        return _erf
    if op == "Erfc":
        return lambda x, out: np.subtract(1.0, _erf(x), out=out, dtype=x.dtype)
    if op == "Elu":
        a = attrs.get("alpha", 1.0)
        return lambda x, out: _where_out(x > 0, x, (np.exp(x) - 1) * np.asarray(a, x.dtype), out)
    if op == "Softplus":
        return lambda x, out: np.logaddexp(x, 0, out=out, dtype=x.dtype)
    if op == "Clip":  # bounds come as attrs (old opsets) or as constants resolved by the factory
        lo, hi = attrs.get("min"), attrs.get("max")
        return lambda x, out: np.clip(x, lo, hi, out=out)
    simple = {
        "Tanh": np.tanh, "Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt, "Neg": np.negative,
        "Abs": np.abs, "Floor": np.floor, "Ceil": np.ceil, "Reciprocal": np.reciprocal,
        "Sin": np.sin, "Cos": np.cos, "Sign": np.sign, "Round": np.rint, "Not": np.logical_not,
    }
    if op in simple:
        f = simple[op]
        return lambda x, out: f(x, out=out)
    if op == "Identity" or op == "Dropout":
        return lambda x, out: x
    raise KeyError(op)


def _where_out(cond: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    r = np.where(cond, a, b)
    if out is None:
        return r
    np.copyto(out, r)
    return out


UNARY_OPS = [
    "Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Gelu", "Erf", "Erfc", "Elu", "Softplus",
    "Tanh", "Exp", "Log", "Sqrt", "Neg", "Abs", "Floor", "Ceil", "Reciprocal", "Sin", "Cos", "Sign",
    "Round", "Not", "Identity",
]


def _writable(x: np.ndarray) -> bool:
    return isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous


@register(UNARY_OPS, same_as_input)
def unary(spec: KernelSpec) -> Run:
    f = unary_fn(spec.op, spec.attrs)
    if spec.op == "Identity":
        return lambda x: (x,)
    if 0 in spec.inplace:
        return lambda x: (f(x, x if _writable(x) and x.dtype.kind == "f" else None),)
    return lambda x: (f(x, None),)


@register("Dropout", lambda s: [(s.shapes[0], s.dtypes[0]), (s.shapes[0], np.dtype(bool))][: s.n_outputs])
def dropout(spec: KernelSpec) -> Run:
    if spec.n_outputs == 2:
        return lambda x, *_: (x, np.ones(x.shape, dtype=bool))
    return lambda x, *_: (x,)


@register("Clip", same_as_input)
def clip(spec: KernelSpec) -> Run:
    lo = spec.const(1) if spec.has(1) else spec.attr("min")
    hi = spec.const(2) if spec.has(2) else spec.attr("max")
    static = (not spec.has(1) or lo is not None) and (not spec.has(2) or hi is not None)
    inplace = 0 in spec.inplace
    if static:
        lo_v = None if lo is None else np.asarray(lo).item()
        hi_v = None if hi is None else np.asarray(hi).item()

        def run(x: np.ndarray, *_: np.ndarray) -> tuple[np.ndarray, ...]:
            return (np.clip(x, lo_v, hi_v, out=x if inplace and _writable(x) else None),)

        return run

    def run_dyn(x: np.ndarray, lo_in: np.ndarray | None = None, hi_in: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        return (np.clip(x, None if lo_in is None else lo_in.item(), None if hi_in is None else hi_in.item()),)

    return run_dyn


BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
    "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
}
COMPARE = {
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal,
}


@register(list(BINARY), broadcast_shape)
def binary(spec: KernelSpec) -> Run:
    f = BINARY[spec.op]
    integer_div = spec.op == "Div" and spec.dtypes[0] is not None and spec.dtypes[0].kind in "iu"
    if integer_div:
        return lambda a, b: (np.floor_divide(a, b) if (np.sign(a) * np.sign(b) >= 0).all() else np.trunc(a / b).astype(a.dtype),)
    if spec.op == "Pow":
        return lambda a, b: (np.power(a, b.astype(a.dtype, copy=False)),)
    ip0, ip1 = 0 in spec.inplace, 1 in spec.inplace

    def run(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        if ip0 and _writable(a) and a.ndim >= np.ndim(b) and a.shape == np.broadcast_shapes(a.shape, np.shape(b)) and a.dtype == np.result_type(a, b):
            return (f(a, b, out=a),)
        if ip1 and _writable(b) and b.ndim >= np.ndim(a) and b.shape == np.broadcast_shapes(np.shape(a), b.shape) and b.dtype == np.result_type(a, b):
            return (f(a, b, out=b),)
        return (f(a, b),)

    return run


@register(list(COMPARE), broadcast_bool)
def compare(spec: KernelSpec) -> Run:
    f = COMPARE[spec.op]
    return lambda a, b: (f(a, b),)


@register("Mod", broadcast_shape)
def mod(spec: KernelSpec) -> Run:
    fmod = spec.attr("fmod", 0)
    return lambda a, b: (np.fmod(a, b) if fmod else np.mod(a, b),)


@register(["Max", "Min", "Sum", "Mean"], broadcast_shape)
def variadic(spec: KernelSpec) -> Run:
    f = {"Max": np.maximum, "Min": np.minimum, "Sum": np.add, "Mean": np.add}[spec.op]

    def run(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
        acc = xs[0]
        for x in xs[1:]:
            acc = f(acc, x)
        if spec.op == "Mean":
            acc = acc / len(xs)
        return (acc,)

    return run


@register("Where", lambda s: [(broadcast(*s.shapes), s.dtypes[1])])
def where(spec: KernelSpec) -> Run:
    return lambda c, a, b: (np.where(c, a, b),)


def _cast_shape(spec: KernelSpec):  # type: ignore[no-untyped-def]
    from onnx import helper

    return [(spec.shapes[0], np.dtype(helper.tensor_dtype_to_np_dtype(spec.attr("to"))))]


@register("Cast", _cast_shape)
def cast(spec: KernelSpec) -> Run:
    to = _cast_shape(spec)[0][1]
    return lambda x: (np.asarray(x).astype(to, copy=False),)

