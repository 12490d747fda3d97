"""Every elementwise unary function, defined once: its attributes and their defaults, its math
written against an array namespace `xp` (NumPy on the host, CuPy on a GPU: they share the API),
and how fused epilogues take it: whether the fusion pass may fold it into a FusedConv or
FusedMatMul, its scalar form in the numba kernels, its oneDNN eltwise post-op, its CUDA C.

The host and cuda kernels, the fusion pass, and the numba, oneDNN and GPU epilogues all read
this table, so an activation cannot mean one thing on one path and something else on another.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import jit
from .jit import SCALAR_CLAMP, SCALAR_GELU, SCALAR_NONE

Params = dict[str, Any]  # an activation's attributes, defaults filled in
Unary = Callable[[Any, Any], Any]  # f(x, out): out is None (a fresh result) or the array to write, possibly x
Act = tuple[str, dict[str, Any]]  # a fused node's `activation` attribute: (op, its attributes)
Eltwise = tuple[str, float, float]  # a oneDNN eltwise post-op: (alg_kind name, alpha, beta)
Scalar = tuple[int, float, float]  # (SCALAR_* form, a, b): how the numba kernels apply an activation in place

# The scalar forms of the numba kernels (jit.SCALAR_NONE, jit.SCALAR_CLAMP: jit.clamp(v, a, b),
# jit.SCALAR_GELU: jit.gelu_erf(v)). Each kernel branches on the form once per row, outside its
# element loop (a per-element dispatch there stops vectorization).


@dataclass(frozen=True)
class Activation:
    """One elementwise unary op: its math, and each fused form of it (absent where it has none)."""

    op: str
    make: Callable[[Any, Params], Unary]  # (xp, params) -> f(x, out)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    wide: bool = False  # float16 operands compute in float32 (transcendental math loses too much in half)
    fusable: bool = False  # the fusion pass folds it into a FusedConv / FusedMatMul epilogue
    scalar: Callable[[Params], Scalar | None] | None = None  # numba's form; None (or a None result): the xp epilogue runs instead
    onednn: Callable[[Params], Eltwise | None] | None = None  # None (or a None result): oneDNN cannot fuse it
    cuda_c: Callable[[Params], str] | None = None  # C expression of float `v` for the GPU's fused epilogue

    def params(self, attrs: Mapping[str, Any]) -> Params:
        return {k: attrs.get(k, d) for k, d in self.defaults.items()}


def _put(xp: Any, r: Any, out: Any) -> Any:
    """`r` as the result of f(x, out): written into `out` when there is one."""
    if out is None:
        return r
    xp.copyto(out, r)
    return out


def _c(v: float) -> str:
    """A float literal for CUDA C."""
    f = float(v)
    if np.isinf(f):
        return "INFINITY" if f > 0 else "-INFINITY"
    return repr(f) + "f"


# ---------------------------------------------------------------- math, one function per activation

def _relu(xp: Any, p: Params) -> Unary:
    return lambda x, out: xp.maximum(x, 0, out=out)


def _leaky_relu(xp: Any, p: Params) -> Unary:
    a = float(p["alpha"])
    return lambda x, out: _put(xp, xp.where(x >= 0, x, x * x.dtype.type(a)), out)


def _sigmoid(xp: Any, p: Params) -> Unary:
    def f(x: Any, out: Any) -> Any:
        r = xp.negative(x, out=out)
        xp.exp(r, out=r)
        r += 1.0
        return xp.reciprocal(r, out=r)

    return f


def _hard_sigmoid(xp: Any, p: Params) -> Unary:
    a, b = float(p["alpha"]), float(p["beta"])

    def f(x: Any, out: Any) -> Any:
        r = xp.multiply(x, a, out=out)
        r += b
        return xp.clip(r, 0.0, 1.0, out=r)

    return f


def _hard_swish(xp: Any, p: Params) -> Unary:
    def f(x: Any, out: Any) -> Any:
        h = xp.add(x, 3.0)
        xp.clip(h, 0.0, 6.0, out=h)
        h *= 1.0 / 6.0
        return xp.multiply(x, h, out=out)

    return f


def _erf_of(xp: Any, x: Any, out: Any) -> Any:
    """erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), in the operand's float precision."""
    a = xp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = 1.0 - poly * xp.exp(-a * a)
    if out is not None:
        return xp.multiply(xp.sign(x), r, out=out)
    return (xp.sign(x) * r).astype(x.dtype, copy=False)


def _erf(xp: Any, p: Params) -> Unary:
    return lambda x, out: _erf_of(xp, x, out)


def _erfc(xp: Any, p: Params) -> Unary:
    return lambda x, out: xp.subtract(1.0, _erf_of(xp, x, None), out=out)


_SQRT_HALF = np.float32(0.7071067811865476)
_SQRT_TWO_OVER_PI = np.float32(0.7978845608028654)


def _silu(xp: Any, p: Params) -> Unary:
    """x * sigmoid(x): the SiLU/Swish that converters write as Sigmoid and Mul (runtime/passes/fusion.py)."""
    sigmoid = _sigmoid(xp, p)

    def f(x: Any, out: Any) -> Any:
        return xp.multiply(x, sigmoid(x, None), out=out)

    return f


def _gelu(xp: Any, p: Params) -> Unary:
    def f(x: Any, out: Any) -> Any:
        e = _erf_of(xp, x * _SQRT_HALF, None)
        e += 1.0
        e *= 0.5
        return xp.multiply(x, e, out=out)

    def tanh_form(x: Any, out: Any) -> Any:  # ONNX Gelu(approximate="tanh")
        t = xp.tanh((x + 0.044715 * x * x * x) * _SQRT_TWO_OVER_PI)
        t += 1.0
        t *= 0.5
        return xp.multiply(x, t, out=out)

    if p["approximate"] == "tanh":
        return tanh_form
    if xp is np and jit.AVAILABLE:
        return lambda x, out: jit.gelu(x, out) if x.dtype == np.float32 else f(x, out)
    return f


def _elu(xp: Any, p: Params) -> Unary:
    a = float(p["alpha"])
    return lambda x, out: _put(xp, xp.where(x > 0, x, (xp.exp(xp.minimum(x, 0)) - 1) * x.dtype.type(a)), out)


def _softplus(xp: Any, p: Params) -> Unary:
    return lambda x, out: xp.logaddexp(x, x.dtype.type(0), out=out)


def _clip(xp: Any, p: Params) -> Unary:
    lo, hi = p["min"], p["max"]  # None: that side is open
    return lambda x, out: xp.clip(x, lo, hi, out=out)


def _identity(xp: Any, p: Params) -> Unary:
    return lambda x, out: x


def _ufunc(name: str) -> Callable[[Any, Params], Unary]:
    def make(xp: Any, p: Params) -> Unary:
        g = getattr(xp, name)
        return lambda x, out: g(x, out=out)

    return make


# ---------------------------------------------------------------- fused forms

def _relu_eltwise(p: Params) -> Eltwise:
    return ("eltwise_relu", 0.0, 0.0)


def _clip_bounds(p: Params) -> tuple[float, float]:
    """Clip's bounds as floats, an open side infinite."""
    return (-np.inf if p["min"] is None else float(p["min"]), np.inf if p["max"] is None else float(p["max"]))


def _clip_eltwise(p: Params) -> Eltwise | None:
    lo, hi = _clip_bounds(p)
    if lo == 0.0 and hi == np.inf:
        return ("eltwise_relu", 0.0, 0.0)
    return ("eltwise_clip", lo, hi) if np.isfinite(lo) and np.isfinite(hi) else None


def _clip_scalar(p: Params) -> Scalar:
    return (SCALAR_CLAMP, *_clip_bounds(p))


def _table(*entries: Activation) -> dict[str, Activation]:
    return {a.op: a for a in entries}


ACTIVATIONS: dict[str, Activation] = _table(
    Activation("Relu", _relu, fusable=True, scalar=lambda p: (SCALAR_CLAMP, 0.0, np.inf), onednn=_relu_eltwise,
               cuda_c=lambda p: "v > 0.f ? v : 0.f"),
    Activation("LeakyRelu", _leaky_relu, {"alpha": 0.01}, fusable=True,
               cuda_c=lambda p: f"v >= 0.f ? v : {_c(p['alpha'])} * v"),
    Activation("Sigmoid", _sigmoid, wide=True, fusable=True, cuda_c=lambda p: "1.f / (1.f + expf(-v))"),
    Activation("HardSigmoid", _hard_sigmoid, {"alpha": 0.2, "beta": 0.5}, fusable=True,
               cuda_c=lambda p: f"fminf(fmaxf({_c(p['alpha'])} * v + {_c(p['beta'])}, 0.f), 1.f)"),
    Activation("Silu", _silu, wide=True, fusable=True, onednn=lambda p: ("eltwise_swish", 1.0, 0.0),
               cuda_c=lambda p: "v / (1.f + expf(-v))"),
    Activation("HardSwish", _hard_swish, fusable=True, cuda_c=lambda p: "v * fminf(fmaxf(v + 3.f, 0.f), 6.f) / 6.f"),
    Activation("Gelu", _gelu, {"approximate": "none"}, wide=True, fusable=True,
               scalar=lambda p: (SCALAR_GELU, 0.0, 0.0) if p["approximate"] == "none" else None,
               onednn=lambda p: ("eltwise_gelu_tanh" if p["approximate"] == "tanh" else "eltwise_gelu_erf", 0.0, 0.0),
               cuda_c=lambda p: "0.5f * v * (1.f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)))" if p["approximate"] == "tanh"
               else "0.5f * v * (1.f + erff(v * 0.70710678f))"),
    Activation("Erf", _erf, wide=True),
    Activation("Erfc", _erfc, wide=True),
    Activation("Elu", _elu, {"alpha": 1.0}, wide=True, fusable=True,
               cuda_c=lambda p: f"v > 0.f ? v : {_c(p['alpha'])} * (expf(v) - 1.f)"),
    Activation("Softplus", _softplus, wide=True, fusable=True, cuda_c=lambda p: "v > 20.f ? v : log1pf(expf(v))"),
    Activation("Clip", _clip, {"min": None, "max": None}, fusable=True, scalar=_clip_scalar, onednn=_clip_eltwise,
               cuda_c=lambda p: "fminf(fmaxf(v, {}), {})".format(*map(_c, _clip_bounds(p)))),
    Activation("Tanh", _ufunc("tanh"), wide=True, fusable=True, cuda_c=lambda p: "tanhf(v)"),
    *(Activation(op, _ufunc(name), wide=True) for op, name in (
        ("Exp", "exp"), ("Log", "log"), ("Sqrt", "sqrt"), ("Sin", "sin"), ("Cos", "cos"))),
    *(Activation(op, _ufunc(name)) for op, name in (
        ("Neg", "negative"), ("Abs", "abs"), ("Floor", "floor"), ("Ceil", "ceil"), ("Reciprocal", "reciprocal"),
        ("Sign", "sign"), ("Round", "rint"), ("Not", "logical_not"))),
    Activation("Identity", _identity),
)
# Ops whose node is y = f(x) with attributes only; Clip's bounds may be operands, so it has kernels of its own.
UNARY_OPS = tuple(op for op in ACTIVATIONS if op != "Clip")
FUSABLE = frozenset(op for op, a in ACTIVATIONS.items() if a.fusable)


def _in_float32(xp: Any, f: Unary) -> Unary:
    def run(x: Any, out: Any) -> Any:
        if x.dtype != np.float16:
            return f(x, out)
        r = f(x.astype(np.float32), None)
        if out is None:
            return r.astype(x.dtype)
        xp.copyto(out, r, casting="unsafe")
        return out

    return run


def _bound(xp: Any, entry: Activation, params: Params, may_be_half: bool) -> Unary:
    f = entry.make(xp, params)
    return _in_float32(xp, f) if entry.wide and may_be_half else f


def bind(xp: Any, op: str, attrs: Mapping[str, Any], may_be_half: bool) -> Unary:
    """f(x, out) for `op` with its attributes resolved once. `may_be_half`: whether operands may
    be float16, which the wide activations then compute in float32 (otherwise no per-call check)."""
    entry = ACTIVATIONS.get(op)
    if entry is None:
        raise KeyError(f"{op} is not an elementwise unary op; expected one of {', '.join(ACTIVATIONS)}")
    return _bound(xp, entry, entry.params(attrs), may_be_half)


def parse(act: Act | None) -> tuple[Activation, Params] | None:
    """The table entry and parameters of a fused node's `activation` attribute; None for none."""
    if not act:
        return None
    entry = ACTIVATIONS.get(act[0])
    if entry is None or not entry.fusable:
        raise ValueError(f"fused activation {act[0]!r}: expected one of {', '.join(sorted(FUSABLE))}")
    return entry, entry.params(act[1])


def epilogue(xp: Any, act: Act | None, may_be_half: bool) -> Unary | None:
    """f(y, out) for a fused node's activation; None for none."""
    parsed = parse(act)
    return None if parsed is None else _bound(xp, *parsed, may_be_half)


def scalar_form(act: Act | None) -> Scalar | None:
    """The numba kernels' (form, a, b) for a fused node's activation; None where they have none."""
    parsed = parse(act)
    if parsed is None:
        return (SCALAR_NONE, 0.0, 0.0)
    entry, p = parsed
    return None if entry.scalar is None else entry.scalar(p)


def cuda_expr(act: Act | None) -> str | None:
    """CUDA C of float `v` for a fused node's activation ("v" for none); None where there is none."""
    parsed = parse(act)
    if parsed is None:
        return "v"
    entry, p = parsed
    return None if entry.cuda_c is None else entry.cuda_c(p)
