"""Host elementwise kernels: unary (their math is activations.py's), binary (broadcasting),
variadic, comparisons.

Kernels write in place when the compiler says the operand dies here (memory planning), which
saves an allocation and a cache-cold pass per op on large activations.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import jit
from .activations import UNARY_OPS, Params, bind
from .channel_affine import ChannelAffine
from .registry import BLOCKED_OPERAND, OutputShapes, KernelSpec, Run, broadcast, broadcast_bool, broadcast_shape, register, same_as_input


def _writable(x: np.ndarray) -> bool:
    return isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous


@register(UNARY_OPS, same_as_input)
def unary(spec: KernelSpec) -> Run:
    f = bind(np, spec.op, spec.attrs, may_be_half=spec.dtypes[0] in (None, np.float16))
    if 0 in spec.inplace:
        return lambda x: (f(x, x if _writable(x) and x.dtype.kind == "f" else None),)
    return lambda x: (f(x, None),)


@register("Dropout", lambda s: [(s.shapes[0], s.dtypes[0]), (s.shapes[0], np.dtype(bool))][: s.n_outputs])
def dropout(spec: KernelSpec) -> Run:
    if spec.n_outputs == 2:
        return lambda x, *_: (x, np.ones(x.shape, dtype=bool))
    return lambda x, *_: (x,)


def _item(v: Any) -> Any:
    return None if v is None else np.asarray(v).item()


def clip_bounds(spec: KernelSpec) -> Params | None:
    """Clip's bounds as its activation parameters where they are static (attributes of old
    opsets, constant operands); None where an operand is computed at run time."""
    lo = spec.const(1) if spec.has(1) else spec.attr("min")
    hi = spec.const(2) if spec.has(2) else spec.attr("max")
    if (spec.has(1) and lo is None) or (spec.has(2) and hi is None):
        return None
    return {"min": _item(lo), "max": _item(hi)}


def clip_at_run_time(xp: Any, x: Any, lo: Any, hi: Any) -> Any:
    """Clip with bounds that are operands computed at run time (host values)."""
    return bind(xp, "Clip", {"min": _item(lo), "max": _item(hi)}, may_be_half=False)(x, None)


@register("Clip", same_as_input, params=frozenset({1, 2}))
def clip(spec: KernelSpec) -> Run:
    bounds = clip_bounds(spec)
    if bounds is None:
        return lambda x, lo=None, hi=None: (clip_at_run_time(np, x, lo, hi),)
    f = bind(np, "Clip", bounds, may_be_half=False)
    if 0 in spec.inplace:
        return lambda x, *_: (f(x, x if _writable(x) else None),)
    return lambda x, *_: (f(x, None),)


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
    row_vector = jit.AVAILABLE and (spec.op, False) in jit.ROW_VECTOR_OPS
    blocked = spec.attr(BLOCKED_OPERAND)

    def run(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        if blocked is not None and (a, b)[blocked].ndim == 5:
            x, g = (a, b) if blocked == 0 else (b, a)
            in_place = (ip0, ip1)[blocked] and _writable(x) and x.flags.c_contiguous  # scale_blocked writes through a reshape
            return (jit.scale_blocked(x, g, x if in_place else np.empty(x.shape, x.dtype)),)
        if row_vector:
            for big, vec, vector_first, may_overwrite in ((a, b, False, ip0), (b, a, True, ip1)):
                if _is_row_vector_of(vec, big):
                    out = big if may_overwrite and _writable(big) else np.empty_like(big)
                    return (jit.rows_by_vector(big, vec, spec.op, vector_first, out),)
        if ip0 and _writable(a) and a.ndim >= np.ndim(b) and a.shape == np.broadcast_shapes(a.shape, np.shape(b)) and a.dtype == np.result_type(a, b):
            return (f(a, b, out=a),)
        if ip1 and _writable(b) and b.ndim >= np.ndim(a) and b.shape == np.broadcast_shapes(np.shape(a), b.shape) and b.dtype == np.result_type(a, b):
            return (f(a, b, out=b),)
        return (f(a, b),)

    return run


def _is_row_vector_of(v: np.ndarray, big: np.ndarray) -> bool:
    """v broadcasts over big's last axis only (shape (1, ..., 1, C) or (C,)), both float32 and big
    C-contiguous with many rows: what the row-vector kernel computes."""
    return (isinstance(v, np.ndarray) and isinstance(big, np.ndarray) and big.dtype == v.dtype == np.float32
            and big.ndim >= 2 and v.ndim <= big.ndim and v.size == big.shape[-1] > 1 and v.shape[-1] == v.size
            and big.flags.c_contiguous and big.size >= ROW_VECTOR_MIN_ELEMENTS)


ROW_VECTOR_MIN_ELEMENTS = 4096  # below this NumPy's call is as cheap


@register("MulAdd", same_as_input)
def mul_add(spec: KernelSpec) -> Run:
    """x * scale + shift, scale and shift constant vectors over x's last axis (passes/affine.py);
    with the attribute relu=1, a ReLU in the same pass."""
    scale, shift = spec.const(1), spec.const(2)
    relu = bool(spec.attr("relu", 0))
    if scale is None or shift is None:
        raise ValueError(f"MulAdd {spec.name}: scale and shift must be constants")
    width = scale.size
    affine = ChannelAffine(scale, shift, relu) if jit.AVAILABLE else None

    def run(x: np.ndarray, *_consts: Any) -> tuple[np.ndarray, ...]:
        if x.dtype != np.float32 or x.ndim == 0 or x.shape[-1] != width:
            raise ValueError(f"MulAdd {spec.name}: expected float32 input with {width} values on its last axis, "
                             f"got {x.dtype}{list(x.shape)}")
        if affine is not None:
            return (affine(x),)
        y = x * scale + shift
        return (np.maximum(y, 0, out=y) if relu else y,)

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
        if len(xs) == 1:  # a copy: the output is not a view the memory planner knows of
            return (np.array(xs[0]),)
        acc = xs[0]
        for x in xs[1:]:
            acc = f(acc, x)
        if spec.op == "Mean":
            acc = acc / len(xs)
        return (acc,)

    return run


@register("Where", lambda s: [(broadcast(*s.shapes), s.dtypes[1])])
def where(spec: KernelSpec) -> Run:
    def run(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.where(c, a, b),)

    return run


def _cast_shape(spec: KernelSpec) -> OutputShapes:
    from onnx import helper

    return [(spec.shapes[0], np.dtype(helper.tensor_dtype_to_np_dtype(spec.attr("to"))))]


@register("Cast", _cast_shape)
def cast(spec: KernelSpec) -> Run:
    to = _cast_shape(spec)[0][1]
    return lambda x: (np.asarray(x).astype(to, copy=False),)

